# Included by _blocks.pyx: a churn of allocate/share/free over a private allocator, in one nogil
# section, for benchmarks/hotpath.py and the GIL-release test. `_blocks_py._bench_blocks` runs
# the same operations through the public API and must return the same checksum.

DEF BENCH_MAX_BLOCKS = 16


def _bench_blocks(Py_ssize_t num_blocks, Py_ssize_t n_requests, Py_ssize_t n_ops,
                  uint64_t seed=1, int64_t[::1] probe=None, int64_t probe_target=0):
    """Returns (checksum of handed-out block ids, ops done, probe advance, blocks in use)."""
    cdef Blocks a
    cdef int32_t* held
    cdef int32_t* cnt
    cdef uint64_t x = seed, r, checksum = 0
    cdef uint64_t hash_space = 4 * <uint64_t>n_requests
    cdef Py_ssize_t i, j, k, want, got, done = 0, used
    cdef int64_t h, b, start = 0, seen = 0
    cdef const int64_t* probe_ptr = NULL
    if num_blocks < 2 or n_requests < 1 or n_ops < 0:
        raise ValueError("need num_blocks >= 2, n_requests >= 1, n_ops >= 0")
    if probe is not None:
        probe_ptr = &probe[0]
    held = <int32_t*>malloc(n_requests * BENCH_MAX_BLOCKS * sizeof(int32_t))
    cnt = <int32_t*>calloc(n_requests, sizeof(int32_t))
    if held == NULL or cnt == NULL or b_init(&a, num_blocks) < 0:
        free(held)
        free(cnt)
        b_free_all(&a)
        raise MemoryError("_bench_blocks: out of memory")
    with nogil:
        if probe_ptr != NULL:
            start = read_probe(probe_ptr)
            seen = start
        for i in range(n_ops):
            x = lcg(x)
            r = x >> 33
            k = <Py_ssize_t>(r % <uint64_t>n_requests)
            if cnt[k] > 0:
                j = cnt[k]
                while j > 0:  # tail first
                    j -= 1
                    b_decref(&a, held[k * BENCH_MAX_BLOCKS + j])
                cnt[k] = 0
            else:
                want = 1 + <Py_ssize_t>((r >> 8) % BENCH_MAX_BLOCKS)
                h = <int64_t>((r >> 12) % hash_space)
                got = 0
                b = map_get(&a.by_hash, h, -1)
                if b >= 0:
                    if a.refs[b] > 0:
                        a.refs[b] += 1
                    else:
                        b_touch(&a, <int32_t>b)
                    held[k * BENCH_MAX_BLOCKS] = <int32_t>b
                    got = 1
                if b_allocate(&a, want - got, &held[k * BENCH_MAX_BLOCKS + got]) < 0:
                    if got:
                        b_decref(&a, held[k * BENCH_MAX_BLOCKS])
                else:
                    if got == 0:
                        b = held[k * BENCH_MAX_BLOCKS]
                        map_put(&a.by_hash, h, b)
                        a.hashed[b] = 1
                        a.hashes[b] = h
                    for j in range(want):
                        checksum = checksum * 1000003 + <uint64_t>held[k * BENCH_MAX_BLOCKS + j]
                    cnt[k] = <int32_t>want
            done = i + 1
            if probe_ptr != NULL and i % 256 == 255:
                seen = read_probe(probe_ptr)
                if seen - start >= probe_target:
                    break
        if probe_ptr != NULL:
            seen = read_probe(probe_ptr)
    used = a.n - 1 - a.n_free - a.n_cached
    b_free_all(&a)
    free(held)
    free(cnt)
    return checksum, done, seen - start, used
