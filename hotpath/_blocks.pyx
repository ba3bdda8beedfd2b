# cython: language_level=3
"""KV block bookkeeping over C arrays: refcounts, a free list, and an LRU of cached prefix blocks.

Invariants (both implementations)::

    block 0           the null block: never handed out, freed, shared or hashed
    refs[b] > 0       in use; in no list
    refs[b] == 0      exactly one of: FREE list (no hash) or CACHED list (holds a hash)
    num_free + num_used == num_total == num_blocks - 1

Both lists are threaded through the `prev`/`next` fields of one flat array of `Block` structs
(refcount, hash and links side by side, one cache line per block) with two sentinel nodes
(`FREE = num_blocks`, `CACHED = num_blocks + 1`), so allocation, free and removal from the
middle (touching a cached block) are O(1) and allocate nothing:

    FREE   <-> 4 <-> 5 <-> 3 <-> FREE        hand-out order (a freed block joins the tail)
    CACHED <-> 1 <-> 7 <-> CACHED            least recently freed first (evicted first)

`allocate(n)` is all-or-nothing: it takes free blocks first, then evicts cached ones from the
LRU head (dropping their hash), and returns None when fewer than n exist. A request's blocks
are freed tail first, so the tail of a prefix chain is evicted before its head. The prefix map
(hash -> block) is a C open-addressing table; no Python object exists per block.

Sharing: `incref` only for a block in use; a cached block found by `lookup` is revived with
`touch` (refcount 0 -> 1, off the LRU). `set_hash` hashes a block once; when another block
already holds that hash it returns False and the block stays unhashed (freed, not cached).
"""

from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_CheckExact
from cpython.number cimport PyNumber_Index
from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memset

from _hashmap cimport I64Map, map_del, map_find, map_free, map_get, map_init, map_put

from ._blocks_py import check_hash, check_num_blocks, reinit_error
from ._limits import MAX_BLOCKS, MAX_REFCOUNT, busy_error


include "_blocks_core.pxi"

if MAX_BLOCKS != BLOCKS_MAX or MAX_REFCOUNT != REFS_MAX:
    raise ImportError("_blocks: the C limits disagree with _limits")


cdef class BlockAllocator:
    """Reference-counted KV blocks, a free list, and an LRU of cached prefix blocks.

    Not thread-safe: callers serialise (see `_limits`); a call that overlaps another call on the
    same allocator raises RuntimeError and changes nothing. Every method is O(1) or O(blocks
    passed) and keeps the GIL.
    """

    cdef Blocks a
    cdef int _busy  # set for the duration of every call that touches the tables
    cdef readonly Py_ssize_t num_blocks
    cdef public long long prefix_hits
    cdef public long long prefix_misses

    def __cinit__(self, *args, **kwargs):
        # Only the null block, so an instance whose __init__ never ran (cls.__new__(cls)) works
        # like BlockAllocator(1).
        if b_init(&self.a, 1) < 0:
            b_free_all(&self.a)
            raise MemoryError("BlockAllocator: out of memory")
        self.num_blocks = 1

    def __init__(self, num_blocks):
        cdef Blocks fresh
        n = PyNumber_Index(num_blocks)
        check_num_blocks(n)
        memset(&fresh, 0, sizeof(Blocks))
        if b_init(&fresh, <Py_ssize_t>n) < 0:
            b_free_all(&fresh)
            raise MemoryError(f"BlockAllocator: out of memory for {n} blocks")
        if self._busy:
            b_free_all(&fresh)
            raise busy_error("BlockAllocator", "__init__")
        b_free_all(&self.a)
        self.a = fresh
        self.num_blocks = n
        self.prefix_hits = 0
        self.prefix_misses = 0

    def __dealloc__(self):
        b_free_all(&self.a)

    cdef inline int _enter(self, str method) except -1:
        if self._busy:
            raise busy_error("BlockAllocator", method)
        self._busy = 1
        return 0

    @property
    def num_free(self):
        """Blocks allocate() can hand out: truly free plus cached evictable."""
        return self.a.n_free + self.a.n_cached

    @property
    def num_cached(self):
        """Blocks with refcount 0 that still hold a reusable prefix."""
        return self.a.n_cached

    @property
    def num_used(self):
        """Blocks with refcount > 0."""
        return self.a.n - 1 - self.a.n_free - self.a.n_cached

    @property
    def num_total(self):
        """Blocks that can ever be handed out (num_blocks - 1: block 0 is the null block)."""
        return self.a.n - 1

    @property
    def evictions(self):
        """Cached blocks whose prefix was dropped to satisfy allocate()."""
        return self.a.evictions

    cdef inline int32_t _block_id(self, object value, bint allow_null) except -1:
        """The id of a block converted by PyNumber_Index, checked against the current table."""
        cdef int overflow = 0
        cdef long long b = PyLong_AsLongLongAndOverflow(value, &overflow)
        if overflow:
            b = -1
        if not allow_null and b == 0:
            raise ValueError("block 0 is the null block; it is never allocated, freed or shared")
        if not (0 if allow_null else 1) <= b < self.a.n:
            lowest = 0 if allow_null else 1
            raise ValueError(f"block {value} is out of range {lowest}..{self.a.n - 1}")
        return <int32_t>b

    cdef inline int64_t _hash(self, object value) except? -1:
        cdef int overflow = 0
        cdef long long h = PyLong_AsLongLongAndOverflow(value, &overflow)
        if overflow:
            check_hash(value)  # raises the ValueError that explains the range
        return h

    def allocate(self, n):
        """n blocks with refcount 1 (free ones first, then LRU cached), or None if short."""
        cdef int overflow = 0
        cdef long long count
        cdef Py_ssize_t i
        cdef int32_t stack[64]
        cdef int32_t* out = stack
        n = PyNumber_Index(n)
        count = PyLong_AsLongLongAndOverflow(n, &overflow)
        if overflow < 0 or (not overflow and count < 0):
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        self._enter("allocate")
        try:
            if overflow or count > self.a.n_free + self.a.n_cached:
                return None
            if count > 64:
                out = <int32_t*>malloc(count * sizeof(int32_t))
                if out == NULL:
                    raise MemoryError("BlockAllocator: out of memory")
            try:
                b_allocate(&self.a, count, out)
                return [out[i] for i in range(count)]
            finally:
                if out != stack:
                    free(out)
        finally:
            self._busy = 0

    def free(self, blocks):
        """Decref each block (pass a request's blocks tail first); at 0 it is cached or freed."""
        cdef list fast
        cdef tuple items
        cdef Py_ssize_t count, i, bad
        cdef Py_ssize_t done = 0
        cdef Py_ssize_t n0 = self.a.n
        cdef int32_t stack[64]
        cdef int32_t* ids = stack
        cdef int32_t b
        # Ids are converted before anything changes. A list of exact ints (the engine's case) is
        # read in place: converting them runs no Python code, so nothing can mutate the list.
        # Anything else is read from a private snapshot, from the first element that is not an
        # exact int on, so an element's __index__ can mutate the caller's list, not this tuple.
        if type(blocks) is list:
            fast = <list>blocks
            count = len(fast)
        else:
            items = tuple(blocks)
            count = len(items)
        if count > 64:
            ids = <int32_t*>malloc(count * sizeof(int32_t))
            if ids == NULL:
                raise MemoryError("BlockAllocator: out of memory")
        try:
            if type(blocks) is list:
                while done < count and PyLong_CheckExact(fast[done]):
                    ids[done] = self._block_id(fast[done], False)
                    done += 1
                if done < count:
                    items = tuple(fast)  # unchanged so far: only exact ints were read
            for i in range(done, count):
                ids[i] = self._block_id(PyNumber_Index(items[i]), False)
            self._enter("free")
            try:
                if self.a.n != n0:  # an __index__ above re-initialised this allocator
                    raise reinit_error("free")
                bad = b_check_free(&self.a, ids, count)
                if bad >= 0:
                    b = ids[bad]
                    refs = self.a.blk[b].refs
                    state = "not allocated" if refs == 0 else f"held {refs} time(s)"
                    raise ValueError(
                        f"double free: block {b} is {state} but freed {refs + 1} time(s)"
                    )
                for i in range(count):
                    b_decref(&self.a, ids[i])
            finally:
                self._busy = 0
        finally:
            if ids != stack:
                free(ids)

    def incref(self, block):
        """Share an allocated block with one more request."""
        cdef int32_t b
        block = PyNumber_Index(block)
        self._enter("incref")
        try:
            b = self._block_id(block, False)
            if self.a.blk[b].refs == 0:
                raise ValueError(f"block {b} is not allocated; use touch() to reuse a cached block")
            if self.a.blk[b].refs >= REFS_MAX:
                raise ValueError(f"block {b} already has the most references ({REFS_MAX})")
            self.a.blk[b].refs += 1
        finally:
            self._busy = 0

    def ref_count(self, block):
        """Current reference count of a block (0 when free or cached)."""
        block = PyNumber_Index(block)
        self._enter("ref_count")
        try:
            return self.a.blk[self._block_id(block, True)].refs
        finally:
            self._busy = 0

    def lookup(self, block_hash):
        """Block holding this hash, or -1; refcounts and LRU order are unchanged."""
        cdef int64_t h = self._hash(PyNumber_Index(block_hash))
        self._enter("lookup")
        try:
            return map_get(&self.a.by_hash, h, -1)
        finally:
            self._busy = 0

    def touch(self, block):
        """Reuse a cached block: take it off the evictable list with refcount 1."""
        cdef int32_t b
        block = PyNumber_Index(block)
        self._enter("touch")
        try:
            b = self._block_id(block, False)
            if self.a.blk[b].refs > 0:
                raise ValueError(
                    f"block {b} is in use (refcount {self.a.blk[b].refs}); use incref()"
                )
            if not self.a.blk[b].hashed:
                raise ValueError(f"block {b} is free and holds no prefix; allocate() it instead")
            b_touch(&self.a, b)
        finally:
            self._busy = 0

    def set_hash(self, block, block_hash):
        """Record that an allocated block holds this full block; False if another block already does."""
        cdef int32_t b
        cdef int64_t h
        block = PyNumber_Index(block)
        block_hash = PyNumber_Index(block_hash)
        self._enter("set_hash")
        try:
            b = self._block_id(block, False)
            h = self._hash(block_hash)
            if self.a.blk[b].refs == 0:
                raise ValueError(f"block {b} is not allocated; only a block in use can be hashed")
            if self.a.blk[b].hashed:
                if self.a.blk[b].hash == h:
                    return True
                raise ValueError(
                    f"block {b} already holds hash {self.a.blk[b].hash}; blocks are hashed once"
                )
            if map_find(&self.a.by_hash, h) >= 0:
                return False
            if map_put(&self.a.by_hash, h, b) < 0:
                raise MemoryError("BlockAllocator: out of memory")
            self.a.blk[b].hashed = 1
            self.a.blk[b].hash = h
            return True
        finally:
            self._busy = 0

    def block_hash(self, block):
        """The hash recorded for a block, or None."""
        cdef int32_t b
        block = PyNumber_Index(block)
        self._enter("block_hash")
        try:
            b = self._block_id(block, True)
            return self.a.blk[b].hash if self.a.blk[b].hashed else None
        finally:
            self._busy = 0

    def record_lookup(self, hit):
        """Count one prefix-cache lookup as a hit or a miss."""
        if hit:
            self.prefix_hits += 1
        else:
            self.prefix_misses += 1

    def free_order(self):
        """Truly free blocks in hand-out order, then cached blocks LRU first (for tests)."""
        cdef int32_t head, b
        out = []
        self._enter("free_order")
        try:
            for head in (<int32_t>self.a.n, <int32_t>(self.a.n + 1)):
                b = self.a.blk[head].next
                while b != head:
                    out.append(b)
                    b = self.a.blk[b].next
            return out
        finally:
            self._busy = 0
