# Included by _queue.pyx: a churn of pop/push/remove over a private queue, for
# benchmarks/hotpath.py and the GIL-release test. `_queue_py._bench_queue` runs the same
# operations through the public API and must return the same checksum.

cdef inline uint64_t lcg(uint64_t x) noexcept nogil:
    return x * <uint64_t>6364136223846793005ULL + <uint64_t>1442695040888963407ULL


cdef inline int64_t read_probe(const int64_t* p) noexcept nogil:
    return (<volatile const int64_t*>p)[0]


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
        start = read_probe(probe)
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
            seen = read_probe(probe)
            if seen - start >= probe_target:
                break
    res.advanced = read_probe(probe) - start if probe != NULL else 0
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
