# Included by _blocks.pyx: the C structs and `noexcept nogil` cores of the block allocator.
# The invariants are in the module docstring of _blocks.pyx.

cdef enum:
    BLOCKS_MAX = 2147483645  # _limits.MAX_BLOCKS: ids and links are int32, plus two sentinels
    REFS_MAX = 2147483647  # _limits.MAX_REFCOUNT


ctypedef struct Block:  # 24 bytes: one cache line holds a block's whole state
    int32_t prev
    int32_t next
    int32_t refs
    int32_t hashed
    int64_t hash


ctypedef struct Blocks:
    Block* blk  # [num_blocks + 2]: the last two are the FREE and CACHED sentinels
    I64Map by_hash
    Py_ssize_t n
    Py_ssize_t n_free
    Py_ssize_t n_cached
    int64_t evictions


cdef inline void list_unlink(Blocks* a, int32_t b) noexcept nogil:
    a.blk[a.blk[b].prev].next = a.blk[b].next
    a.blk[a.blk[b].next].prev = a.blk[b].prev


cdef inline void list_append(Blocks* a, int32_t head, int32_t b) noexcept nogil:
    cdef int32_t tail = a.blk[head].prev
    a.blk[tail].next = b
    a.blk[b].prev = tail
    a.blk[b].next = head
    a.blk[head].prev = b


cdef int b_init(Blocks* a, Py_ssize_t n) noexcept nogil:
    """Every block but 0 free, in id order; -1 when out of memory (then b_free_all it)."""
    cdef Py_ssize_t b
    if n < 1 or n > BLOCKS_MAX:
        a.blk = NULL
        a.by_hash.cells = NULL
        a.by_hash.cap = 0
        a.by_hash.size = 0
        a.n = 0
        return -1
    a.n = n
    a.n_free = n - 1
    a.n_cached = 0
    a.evictions = 0
    a.blk = <Block*>calloc(n + 2, sizeof(Block))
    if map_init(&a.by_hash, n) < 0 or a.blk == NULL:
        return -1
    a.blk[n].prev = a.blk[n].next = <int32_t>n
    a.blk[n + 1].prev = a.blk[n + 1].next = <int32_t>(n + 1)
    for b in range(1, n):
        list_append(a, <int32_t>n, <int32_t>b)
    return 0


cdef void b_free_all(Blocks* a) noexcept nogil:
    free(a.blk)
    map_free(&a.by_hash)
    a.blk = NULL
    a.n = 0


cdef int b_allocate(Blocks* a, Py_ssize_t count, int32_t* out) noexcept nogil:
    """Fill out[0:count] (free blocks first, then LRU cached); -1 and no change when short."""
    cdef Py_ssize_t i
    cdef int32_t b
    cdef int32_t free_head = <int32_t>a.n
    cdef int32_t cached_head = <int32_t>(a.n + 1)
    if count > a.n_free + a.n_cached:
        return -1
    for i in range(count):
        if a.n_free > 0:
            b = a.blk[free_head].next
            a.n_free -= 1
        else:
            b = a.blk[cached_head].next
            a.n_cached -= 1
            map_del(&a.by_hash, a.blk[b].hash)
            a.blk[b].hashed = 0
            a.evictions += 1
        list_unlink(a, b)
        a.blk[b].refs = 1
        out[i] = b
    return 0


cdef inline void b_decref(Blocks* a, int32_t b) noexcept nogil:
    a.blk[b].refs -= 1
    if a.blk[b].refs == 0:
        if a.blk[b].hashed:
            list_append(a, <int32_t>(a.n + 1), b)
            a.n_cached += 1
        else:
            list_append(a, <int32_t>a.n, b)
            a.n_free += 1


cdef Py_ssize_t b_check_free(Blocks* a, const int32_t* ids, Py_ssize_t count) noexcept nogil:
    """Index of the first occurrence that would free a block below refcount 0, else -1."""
    cdef Py_ssize_t i, j, bad = -1
    for i in range(count):
        a.blk[ids[i]].refs -= 1
        if a.blk[ids[i]].refs < 0:
            bad = i
            i += 1
            break
    else:
        i = count
    for j in range(i):  # restore: validation changes nothing
        a.blk[ids[j]].refs += 1
    return bad


cdef int b_touch(Blocks* a, int32_t b) noexcept nogil:
    list_unlink(a, b)
    a.n_cached -= 1
    a.blk[b].refs = 1
    return 0
