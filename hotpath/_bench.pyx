# cython: language_level=3
"""The churns behind benchmarks/hotpath.py and the GIL-release tests, over private copies of the
queue and block cores: a module of its own, so the shipped `_queue` and `_blocks` carry no
benchmark code. `_bench_py` runs the same operations through the public Python twins and must
return the same checksums.
"""

from libc.math cimport pow
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memset

from _hashmap cimport I64Map, map_del, map_find, map_free, map_get, map_init, map_put

from ._limits import MAX_BLOCKS, MAX_QUEUE_CAPACITY

include "_queue_core.pxi"
include "_blocks_core.pxi"


cdef inline uint64_t lcg(uint64_t x) noexcept nogil:
    return x * <uint64_t>6364136223846793005ULL + <uint64_t>1442695040888963407ULL


# --- the queue: pop / push / remove ------------------------------------------------------------

ctypedef struct QueueChurn:
    uint64_t checksum
    Py_ssize_t done
    int64_t advanced
    int rc


cdef QueueChurn queue_churn(Queue* q, Py_ssize_t n_live, Py_ssize_t n_ops, uint64_t x,
                            const int64_t* probe, int64_t probe_target) noexcept nogil:
    cdef QueueChurn res
    cdef uint64_t r
    cdef int64_t next_handle = 0, victim, start = 0, seen = 0
    cdef double now = 0.0
    cdef Py_ssize_t i
    res.checksum = 0
    res.done = 0
    res.rc = 0
    if probe != NULL:
        start = probe_read(probe)
    for i in range(n_live):
        x = lcg(x)
        r = x >> 33
        res.rc |= q_push(q, next_handle, now + <double>(r % 2000) * 0.001,
                         <int64_t>((r >> 11) % 4096), now)
        next_handle += 1
    for i in range(n_ops):
        now += 1e-6
        res.checksum = res.checksum * 1000003 + <uint64_t>q_remove_at(q, 0)
        x = lcg(x)
        r = x >> 33
        res.rc |= q_push(q, next_handle, now + <double>(r % 2000) * 0.001,
                         <int64_t>((r >> 11) % 4096), now)
        next_handle += 1
        if i % 8 == 7:
            victim = next_handle - 1 - <int64_t>(r % 16)
            if q_remove(q, victim):
                res.checksum = res.checksum * 1000003 + <uint64_t>victim
                x = lcg(x)
                r = x >> 33
                res.rc |= q_push(q, next_handle, now + <double>(r % 2000) * 0.001,
                                 <int64_t>((r >> 11) % 4096), now)
                next_handle += 1
        res.done = i + 1
        if probe != NULL and i % 256 == 255:
            seen = probe_read(probe)
            if seen - start >= probe_target:
                break
    res.advanced = probe_read(probe) - start if probe != NULL else 0
    return res


def _bench_queue(Py_ssize_t n_live, Py_ssize_t n_ops, uint64_t seed=1, int64_t[::1] probe=None,
                 int64_t probe_target=0, bint release_gil=True):
    """Churn a private queue of n_live entries for n_ops pop+push(+remove) ops in ONE nogil section.

    Returns (checksum of popped handles, ops done, probe advance). With `probe`, the C loop
    re-reads probe[0] every 256 ops and stops once another thread has advanced it by
    probe_target: a test of GIL release (release_gil=False runs the same loop holding the GIL,
    the negative control).
    """
    cdef Queue q
    cdef QueueChurn res
    cdef const int64_t* probe_ptr = NULL
    if n_live < 1 or n_live > MAX_QUEUE_CAPACITY or n_ops < 0:
        raise ValueError(
            f"need 1 <= n_live <= {MAX_QUEUE_CAPACITY} and n_ops >= 0, got {n_live}, {n_ops}"
        )
    if probe is not None:
        probe_ptr = &probe[0]
    if q_init(&q, n_live + 1, 0.95, 0.2, 1e-4) < 0:
        q_free(&q)
        raise MemoryError("_bench_queue: out of memory")
    if release_gil:
        with nogil:
            res = queue_churn(&q, n_live, n_ops, seed, probe_ptr, probe_target)
    else:
        res = queue_churn(&q, n_live, n_ops, seed, probe_ptr, probe_target)
    q_free(&q)
    if res.rc != 0:
        raise MemoryError("_bench_queue: out of memory")
    return res.checksum, res.done, res.advanced


# --- the blocks: allocate / share / free -------------------------------------------------------

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
        start = probe_read(probe)
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
            seen = probe_read(probe)
            if seen - start >= probe_target:
                break
    res.advanced = probe_read(probe) - start if probe != NULL else 0
    return res


def _bench_blocks(Py_ssize_t num_blocks, Py_ssize_t n_requests, Py_ssize_t n_ops,
                  uint64_t seed=1, int64_t[::1] probe=None, int64_t probe_target=0,
                  bint release_gil=True):
    """Churn n_requests simulated requests over a private allocator in ONE nogil section.

    Each op picks a request: one holding blocks frees them tail first; an idle one looks up a
    prefix hash (sharing or touching the hit), allocates the rest and hashes its first block.
    Returns (checksum of handed-out ids, ops done, probe advance, blocks in use); `probe`
    works as in `_bench_queue`.
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
