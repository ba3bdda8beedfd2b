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

from cpython.number cimport PyNumber_Index
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memset

from _hashmap cimport I64Map, map_del, map_find, map_free, map_get, map_init, map_put

from ._blocks_py import check_hash


include "_blocks_core.pxi"


cdef class BlockAllocator:
    """Reference-counted KV blocks, a free list, and an LRU of cached prefix blocks."""

    cdef Blocks a
    cdef readonly Py_ssize_t num_blocks
    cdef public long long prefix_hits
    cdef public long long prefix_misses

    def __init__(self, num_blocks):
        cdef Py_ssize_t n = PyNumber_Index(num_blocks)
        if n < 1:
            raise ValueError(f"num_blocks must be >= 1 (block 0 is the null block), got {n}")
        if n > 2**31 - 3:
            raise ValueError(f"num_blocks must be < 2**31 - 2, got {n}")
        b_free_all(&self.a)
        self.num_blocks = n
        self.prefix_hits = 0
        self.prefix_misses = 0
        if b_init(&self.a, n) < 0:
            b_free_all(&self.a)
            raise MemoryError(f"BlockAllocator: out of memory for {n} blocks")

    def __dealloc__(self):
        b_free_all(&self.a)

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

    cdef int32_t _check_block(self, block) except -1:
        cdef int64_t b
        try:
            b = PyNumber_Index(block)
        except OverflowError:
            b = -1
        if b == 0:
            raise ValueError("block 0 is the null block; it is never allocated, freed or shared")
        if not 0 < b < self.a.n:
            raise ValueError(f"block {block} is out of range 1..{self.a.n - 1}")
        return <int32_t>b

    cdef int32_t _check_any(self, block) except -1:
        cdef int64_t b
        try:
            b = PyNumber_Index(block)
        except OverflowError:
            b = -1
        if not 0 <= b < self.a.n:
            raise ValueError(f"block {block} is out of range 0..{self.a.n - 1}")
        return <int32_t>b

    def allocate(self, n):
        """n blocks with refcount 1 (free ones first, then LRU cached), or None if short."""
        cdef Py_ssize_t count = PyNumber_Index(n)
        cdef Py_ssize_t i
        cdef int32_t stack[64]
        cdef int32_t* out = stack
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({count})")
        if count > self.a.n_free + self.a.n_cached:
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

    def free(self, blocks):
        """Decref each block (pass a request's blocks tail first); at 0 it is cached or freed."""
        cdef list items = blocks if type(blocks) is list else list(blocks)
        cdef Py_ssize_t count = len(items)
        cdef Py_ssize_t i, bad
        cdef int32_t stack[64]
        cdef int32_t* ids = stack
        cdef int32_t b
        if count > 64:
            ids = <int32_t*>malloc(count * sizeof(int32_t))
            if ids == NULL:
                raise MemoryError("BlockAllocator: out of memory")
        try:
            for i in range(count):
                ids[i] = self._check_block(items[i])
            bad = b_check_free(&self.a, ids, count)
            if bad >= 0:
                b = ids[bad]
                refs = self.a.blk[b].refs
                state = "not allocated" if refs == 0 else f"held {refs} time(s)"
                raise ValueError(f"double free: block {b} is {state} but freed {refs + 1} time(s)")
            for i in range(count):
                b_decref(&self.a, ids[i])
        finally:
            if ids != stack:
                free(ids)

    def incref(self, block):
        """Share an allocated block with one more request."""
        cdef int32_t b = self._check_block(block)
        if self.a.blk[b].refs == 0:
            raise ValueError(f"block {b} is not allocated; use touch() to reuse a cached block")
        self.a.blk[b].refs += 1

    def ref_count(self, block):
        """Current reference count of a block (0 when free or cached)."""
        return self.a.blk[self._check_any(block)].refs

    def lookup(self, block_hash):
        """Block holding this hash, or -1; refcounts and LRU order are unchanged."""
        cdef int64_t h
        try:
            h = PyNumber_Index(block_hash)
        except OverflowError:
            check_hash(block_hash)
            raise
        return map_get(&self.a.by_hash, h, -1)

    def touch(self, block):
        """Reuse a cached block: take it off the evictable list with refcount 1."""
        cdef int32_t b = self._check_block(block)
        if self.a.blk[b].refs > 0:
            raise ValueError(f"block {b} is in use (refcount {self.a.blk[b].refs}); use incref()")
        if not self.a.blk[b].hashed:
            raise ValueError(f"block {b} is free and holds no prefix; allocate() it instead")
        b_touch(&self.a, b)

    def set_hash(self, block, block_hash):
        """Record that an allocated block holds this full block; False if another block already does."""
        cdef int32_t b = self._check_block(block)
        cdef int64_t h
        try:
            h = PyNumber_Index(block_hash)
        except OverflowError:
            check_hash(block_hash)
            raise
        if self.a.blk[b].refs == 0:
            raise ValueError(f"block {b} is not allocated; only a block in use can be hashed")
        if self.a.blk[b].hashed:
            if self.a.blk[b].hash == h:
                return True
            raise ValueError(f"block {b} already holds hash {self.a.blk[b].hash}; blocks are hashed once")
        if map_find(&self.a.by_hash, h) >= 0:
            return False
        if map_put(&self.a.by_hash, h, b) < 0:
            raise MemoryError("BlockAllocator: out of memory")
        self.a.blk[b].hashed = 1
        self.a.blk[b].hash = h
        return True

    def block_hash(self, block):
        """The hash recorded for a block, or None."""
        cdef int32_t b = self._check_any(block)
        return self.a.blk[b].hash if self.a.blk[b].hashed else None

    def record_lookup(self, hit):
        """Count one prefix-cache lookup as a hit or a miss."""
        if hit:
            self.prefix_hits += 1
        else:
            self.prefix_misses += 1

    def free_order(self):
        """Truly free blocks in hand-out order, then cached blocks LRU first (for tests)."""
        out = []
        cdef int32_t head
        cdef int32_t b
        for head in (<int32_t>self.a.n, <int32_t>(self.a.n + 1)):
            b = self.a.blk[head].next
            while b != head:
                out.append(b)
                b = self.a.blk[b].next
        return out


include "_blocks_bench.pxi"
