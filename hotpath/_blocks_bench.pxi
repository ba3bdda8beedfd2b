# Included by _blocks.pyx: a churn of allocate/share/free over a private allocator, for
# benchmarks/hotpath.py and the GIL-release test. `_blocks_py._bench_blocks` runs the same
# operations through the public API and must return the same checksum.

cdef inline uint64_t lcg(uint64_t x) noexcept nogil:
    return x * <uint64_t>6364136223846793005ULL + <uint64_t>1442695040888963407ULL


cdef inline int64_t read_probe(const int64_t* p) noexcept nogil:
    return (<volatile const int64_t*>p)[0]


cdef enum:
    MAX_HELD = 16  # blocks per simulated request
    BENCH_MAX_REQUESTS = 16777216  # 2**24: the held table stays small and its size cannot wrap


ctypedef struct BlockChurn:
    uint64_t checksum
    Py_ssize_t done
    int64_t advanced


cdef BlockChurn block_churn(Blocks* a, int32_t* held, int32_t* cnt, Py_ssize_t n_requests,
                            Py_ssize_t n_ops, uint64_t x, const int64_t* probe,
                            int64_t probe_target) noexcept nogil:
    cdef BlockChurn res
    cdef uint64_t r
    cdef uint64_t hash_space = 4 * <uint64_t>n_requests
    cdef Py_ssize_t i, j, k, want, got
    cdef int64_t h, b, start = 0, seen = 0
    res.checksum = 0
    res.done = 0
    if probe != NULL:
        start = read_probe(probe)
    for i in range(n_ops):
        x = lcg(x)
        r = x >> 33
        k = <Py_ssize_t>(r % <uint64_t>n_requests)
        if cnt[k] > 0:
            j = cnt[k]
            while j > 0:  # tail first
                j -= 1
                b_decref(a, held[k * MAX_HELD + j])
            cnt[k] = 0
        else:
            want = 1 + <Py_ssize_t>((r >> 8) % MAX_HELD)
            h = <int64_t>((r >> 12) % hash_space)
            got = 0
            b = map_get(&a.by_hash, h, -1)
            if b >= 0:
                if a.blk[b].refs > 0:
                    a.blk[b].refs += 1
                else:
                    b_touch(a, <int32_t>b)
                held[k * MAX_HELD] = <int32_t>b
                got = 1
            if b_allocate(a, want - got, &held[k * MAX_HELD + got]) < 0:
                if got:
                    b_decref(a, held[k * MAX_HELD])
            else:
                if got == 0:
                    b = held[k * MAX_HELD]
                    map_put(&a.by_hash, h, b)
                    a.blk[b].hashed = 1
                    a.blk[b].hash = h
                for j in range(want):
                    res.checksum = res.checksum * 1000003 + <uint64_t>held[k * MAX_HELD + j]
                cnt[k] = <int32_t>want
        res.done = i + 1
        if probe != NULL and i % 256 == 255:
            seen = read_probe(probe)
            if seen - start >= probe_target:
                break
    res.advanced = read_probe(probe) - start if probe != NULL else 0
    return res



def _bench_blocks(Py_ssize_t num_blocks, Py_ssize_t n_requests, Py_ssize_t n_ops,
                  uint64_t seed=1, int64_t[::1] probe=None, int64_t probe_target=0,
                  bint release_gil=True):
    """Churn n_requests simulated requests over a private allocator in ONE nogil section.

    Each op picks a request: one holding blocks frees them tail first; an idle one looks up a
    prefix hash (sharing or touching the hit), allocates the rest and hashes its first block.
    Returns (checksum of handed-out ids, ops done, probe advance, blocks in use); `probe`
    works as in `_queue._bench_queue`.
    """
    cdef Blocks a
    cdef BlockChurn res
    cdef int32_t* held
    cdef int32_t* cnt
    cdef Py_ssize_t used
    cdef const int64_t* probe_ptr = NULL
    if (not 2 <= num_blocks <= MAX_BLOCKS or not 1 <= n_requests <= BENCH_MAX_REQUESTS
            or n_ops < 0):
        raise ValueError(f"need 2 <= num_blocks <= {MAX_BLOCKS}, "
                         f"1 <= n_requests <= {BENCH_MAX_REQUESTS}, n_ops >= 0")
    if probe is not None:
        probe_ptr = &probe[0]
    memset(&a, 0, sizeof(Blocks))
    held = <int32_t*>malloc(n_requests * MAX_HELD * sizeof(int32_t))
    cnt = <int32_t*>calloc(n_requests, sizeof(int32_t))
    if held == NULL or cnt == NULL or b_init(&a, num_blocks) < 0:
        free(held)
        free(cnt)
        b_free_all(&a)
        raise MemoryError("_bench_blocks: out of memory")
    if release_gil:
        with nogil:
            res = block_churn(&a, held, cnt, n_requests, n_ops, seed, probe_ptr, probe_target)
    else:
        res = block_churn(&a, held, cnt, n_requests, n_ops, seed, probe_ptr, probe_target)
    used = a.n - 1 - a.n_free - a.n_cached
    b_free_all(&a)
    free(held)
    free(cnt)
    return res.checksum, res.done, res.advanced, used
