# cython: language_level=3
"""Header-only int64 -> int64 hash map in C (open addressing, linear probing).

Shared by `_queue.pyx` (handle -> slot) and `_blocks.pyx` (block hash -> block id) through the
include path; every function is inline, so no module is imported at run time. Deletion shifts
later entries back (no tombstones), so probe chains never grow with churn. Keys are any int64;
values must be >= 0 (a negative value marks an empty cell), and key and value share one 16-byte
cell so a probe touches one cache line. No Python object per entry; the table doubles when it
is half full. A zeroed I64Map (cap 0, no cells) is a valid empty map: lookups find nothing and
the first put allocates.
"""

from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free, malloc


ctypedef struct MapCell:
    int64_t key
    int64_t val  # < 0: empty


ctypedef struct I64Map:
    MapCell* cells
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
    """Empty table for at least `min_entries` before growing; -1 when out of memory or range."""
    cdef Py_ssize_t cap = 16
    cdef Py_ssize_t i
    m.cells = NULL
    m.cap = 0
    m.size = 0
    # 2**40 is far below PY_SSIZE_T_MAX / (4 * sizeof(MapCell)): the doubling and the byte
    # size below never wrap.
    if min_entries < 0 or min_entries > (<Py_ssize_t>1 << 40):
        return -1
    while cap < 2 * min_entries:
        cap *= 2
    m.cells = <MapCell*>malloc(cap * sizeof(MapCell))
    m.cap = cap
    m.size = 0
    if m.cells == NULL:
        m.cap = 0
        return -1
    for i in range(cap):
        m.cells[i].val = -1
    return 0


cdef inline void map_free(I64Map* m) noexcept nogil:
    free(m.cells)
    m.cells = NULL
    m.cap = 0
    m.size = 0


cdef inline Py_ssize_t map_find(I64Map* m, int64_t key) noexcept nogil:
    """Table index holding `key`, or -1."""
    cdef Py_ssize_t mask, i
    if m.cap == 0:
        return -1
    mask = m.cap - 1
    i = _home(m, key)
    while m.cells[i].val >= 0:
        if m.cells[i].key == key:
            return i
        i = (i + 1) & mask
    return -1


cdef inline int64_t map_get(I64Map* m, int64_t key, int64_t missing) noexcept nogil:
    """Value stored for `key`, or `missing`."""
    cdef Py_ssize_t i = map_find(m, key)
    return missing if i < 0 else m.cells[i].val


cdef inline int _map_grow(I64Map* m) noexcept nogil:
    cdef I64Map bigger
    cdef Py_ssize_t i
    if map_init(&bigger, m.cap) < 0:
        return -1
    for i in range(m.cap):
        if m.cells[i].val >= 0:
            map_put(&bigger, m.cells[i].key, m.cells[i].val)
    map_free(m)
    m[0] = bigger
    return 0


cdef inline int map_put(I64Map* m, int64_t key, int64_t val) noexcept nogil:
    """Insert or overwrite (val >= 0); -1 when out of memory (the map is unchanged then)."""
    cdef Py_ssize_t mask, i
    if 2 * (m.size + 1) > m.cap and _map_grow(m) < 0:
        return -1
    mask = m.cap - 1
    i = _home(m, key)
    while m.cells[i].val >= 0:
        if m.cells[i].key == key:
            m.cells[i].val = val
            return 0
        i = (i + 1) & mask
    m.cells[i].key = key
    m.cells[i].val = val
    m.size += 1
    return 0


cdef inline bint map_del(I64Map* m, int64_t key) noexcept nogil:
    """Remove `key`; False when it was absent."""
    cdef Py_ssize_t i = map_find(m, key)
    cdef Py_ssize_t mask = m.cap - 1
    cdef Py_ssize_t j, home
    if i < 0:
        return False
    j = i
    while True:
        j = (j + 1) & mask
        if m.cells[j].val < 0:
            break
        home = _home(m, m.cells[j].key)
        # Move entry j back into the hole at i unless its home lies cyclically in (i, j].
        if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
            m.cells[i] = m.cells[j]
            i = j
    m.cells[i].val = -1
    m.size -= 1
    return True
