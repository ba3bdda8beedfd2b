# cython: language_level=3
"""Header-only int64 -> int64 hash map in C (open addressing, linear probing).

Shared by `_queue.pyx` (handle -> slot) and `_blocks.pyx` (block hash -> block id) through the
include path; every function is inline, so no module is imported at run time. Deletion shifts
later entries back (no tombstones), so probe chains never grow with churn. No Python object
per entry; the table doubles when it is half full.
"""

from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport calloc, free, malloc


ctypedef struct I64Map:
    int64_t* keys
    int64_t* vals
    unsigned char* used
    Py_ssize_t cap  # a power of two
    Py_ssize_t size


cdef inline Py_ssize_t _home(I64Map* m, int64_t key) noexcept nogil:
    # splitmix64 finaliser: consecutive handles and hashes spread over the table.
    cdef uint64_t x = <uint64_t>key
    x ^= x >> 30
    x *= <uint64_t>0xBF58476D1CE4E5B9ULL
    x ^= x >> 27
    x *= <uint64_t>0x94D049BB133111EBULL
    x ^= x >> 31
    return <Py_ssize_t>(x & <uint64_t>(m.cap - 1))


cdef inline int map_init(I64Map* m, Py_ssize_t min_entries) noexcept nogil:
    """Empty table for at least `min_entries` before growing; -1 when out of memory."""
    cdef Py_ssize_t cap = 16
    while cap < 2 * min_entries:
        cap *= 2
    m.keys = <int64_t*>malloc(cap * sizeof(int64_t))
    m.vals = <int64_t*>malloc(cap * sizeof(int64_t))
    m.used = <unsigned char*>calloc(cap, 1)
    m.cap = cap
    m.size = 0
    if m.keys == NULL or m.vals == NULL or m.used == NULL:
        map_free(m)
        return -1
    return 0


cdef inline void map_free(I64Map* m) noexcept nogil:
    free(m.keys)
    free(m.vals)
    free(m.used)
    m.keys = NULL
    m.vals = NULL
    m.used = NULL
    m.cap = 0
    m.size = 0


cdef inline Py_ssize_t map_find(I64Map* m, int64_t key) noexcept nogil:
    """Table index holding `key`, or -1."""
    cdef Py_ssize_t mask = m.cap - 1
    cdef Py_ssize_t i = _home(m, key)
    while m.used[i]:
        if m.keys[i] == key:
            return i
        i = (i + 1) & mask
    return -1


cdef inline int64_t map_get(I64Map* m, int64_t key, int64_t missing) noexcept nogil:
    """Value stored for `key`, or `missing`."""
    cdef Py_ssize_t i = map_find(m, key)
    return missing if i < 0 else m.vals[i]


cdef inline int _map_grow(I64Map* m) noexcept nogil:
    cdef I64Map bigger
    cdef Py_ssize_t i
    if map_init(&bigger, m.cap) < 0:
        return -1
    for i in range(m.cap):
        if m.used[i]:
            map_put(&bigger, m.keys[i], m.vals[i])
    map_free(m)
    m[0] = bigger
    return 0


cdef inline int map_put(I64Map* m, int64_t key, int64_t val) noexcept nogil:
    """Insert or overwrite; -1 when out of memory (the map is unchanged then)."""
    cdef Py_ssize_t mask, i
    if 2 * (m.size + 1) > m.cap and _map_grow(m) < 0:
        return -1
    mask = m.cap - 1
    i = _home(m, key)
    while m.used[i]:
        if m.keys[i] == key:
            m.vals[i] = val
            return 0
        i = (i + 1) & mask
    m.used[i] = 1
    m.keys[i] = key
    m.vals[i] = val
    m.size += 1
    return 0


cdef inline bint map_del(I64Map* m, int64_t key) noexcept nogil:
    """Remove `key`; False when it was absent."""
    cdef Py_ssize_t mask = m.cap - 1
    cdef Py_ssize_t i = map_find(m, key)
    cdef Py_ssize_t j, home
    if i < 0:
        return False
    j = i
    while True:
        j = (j + 1) & mask
        if not m.used[j]:
            break
        home = _home(m, m.keys[j])
        # Move entry j back into the hole at i unless its home lies cyclically in (i, j].
        if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
            m.keys[i] = m.keys[j]
            m.vals[i] = m.vals[j]
            i = j
    m.used[i] = 0
    m.size -= 1
    return True
