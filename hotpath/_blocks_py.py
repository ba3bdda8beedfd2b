"""Pure-Python twin of `_blocks.pyx`: KV block bookkeeping with prefix reuse.

Same API, same block ids, same errors as the compiled module; see `_blocks.pyx` for the
invariants. The two intrusive lists of the compiled module are `OrderedDict`s here (O(1)
pop-front, append and removal from the middle, implemented in C by CPython).
"""

from __future__ import annotations

import operator
from _thread import allocate_lock
from collections import OrderedDict

from ._limits import MAX_BLOCKS, MAX_REFCOUNT, busy_error

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def check_hash(block_hash: int) -> int:
    """Block hashes are signed 64-bit ints (e.g. Python's hash() of a tuple)."""
    block_hash = operator.index(block_hash)
    if not _INT64_MIN <= block_hash <= _INT64_MAX:
        raise ValueError(
            f"block_hash must fit in a signed 64-bit int, got {block_hash!r} "
            "(use hash(...) or int.from_bytes(digest[:8], 'little', signed=True))"
        )
    return block_hash


def check_num_blocks(num_blocks: int) -> None:
    """Raise ValueError unless 1 <= num_blocks <= MAX_BLOCKS (block ids are int32 in C)."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1 (block 0 is the null block), got {num_blocks}")
    if num_blocks > MAX_BLOCKS:
        raise ValueError(
            f"num_blocks must be <= {MAX_BLOCKS} (sloserve.hotpath.MAX_BLOCKS; block ids are "
            f"int32), got {num_blocks}"
        )


def reinit_error(method: str) -> ValueError:
    """The error of a call whose argument conversion re-initialised the allocator under it."""
    return ValueError(
        f"BlockAllocator.{method}: the allocator was re-initialised while the arguments were "
        "converted (by an __index__); nothing was changed"
    )


class BlockAllocator:
    """Reference-counted KV blocks, a free list, and an LRU of cached prefix blocks (twin).

    Not thread-safe: callers serialise (see `_limits`); a call that overlaps another call on the
    same allocator raises RuntimeError and changes nothing, as in the compiled module.
    """

    __slots__ = (
        "num_blocks",
        "prefix_hits",
        "prefix_misses",
        "evictions",
        "_refs",
        "_hashes",
        "_by_hash",
        "_free",
        "_cached",
        "_guard",
    )

    def __new__(cls, *args: object, **kwargs: object) -> BlockAllocator:
        # Like the compiled __cinit__: an instance whose __init__ never ran holds only the null
        # block and works like BlockAllocator(1).
        self = super().__new__(cls)
        self._guard = allocate_lock()
        self._reset(1)
        return self

    def __init__(self, num_blocks: int) -> None:
        num_blocks = operator.index(num_blocks)
        check_num_blocks(num_blocks)
        if not self._guard.acquire(False):
            raise busy_error("BlockAllocator", "__init__")
        try:
            self._reset(num_blocks)
        finally:
            self._guard.release()

    def _reset(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.prefix_hits = 0
        self.prefix_misses = 0
        self.evictions = 0
        self._refs = [0] * num_blocks
        self._hashes: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def _enter(self, method: str) -> None:
        if not self._guard.acquire(False):
            raise busy_error("BlockAllocator", method)

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out: truly free plus cached evictable."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks with refcount 0 that still hold a reusable prefix."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks with refcount > 0."""
        return self.num_blocks - 1 - len(self._free) - len(self._cached)

    @property
    def num_total(self) -> int:
        """Blocks that can ever be handed out (num_blocks - 1: block 0 is the null block)."""
        return self.num_blocks - 1

    def _check_block(self, block: int) -> int:
        """An already converted block id, checked: in range and not the null block."""
        if block == 0:
            raise ValueError("block 0 is the null block; it is never allocated, freed or shared")
        if not 0 < block < self.num_blocks:
            raise ValueError(f"block {block} is out of range 1..{self.num_blocks - 1}")
        return block

    def _check_any(self, block: int) -> int:
        """An already converted block id, checked: in range (the null block included)."""
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is out of range 0..{self.num_blocks - 1}")
        return block

    def allocate(self, n: int) -> list[int] | None:
        """n blocks with refcount 1 (free ones first, then LRU cached), or None if short."""
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        self._enter("allocate")
        try:
            if n > len(self._free) + len(self._cached):
                return None
            out = []
            free, cached, refs = self._free, self._cached, self._refs
            for _ in range(n):
                if free:
                    block = free.popitem(last=False)[0]
                else:
                    block = cached.popitem(last=False)[0]
                    del self._by_hash[self._hashes[block]]
                    self._hashes[block] = None
                    self.evictions += 1
                refs[block] = 1
                out.append(block)
            return out
        finally:
            self._guard.release()

    def free(self, blocks: list[int]) -> None:
        """Decref each block (pass a request's blocks tail first); at 0 it is cached or freed."""
        # A private snapshot: an element's __index__ may mutate the caller's list, not this tuple.
        n0 = self.num_blocks
        blocks = [self._check_block(operator.index(b)) for b in tuple(blocks)]
        self._enter("free")
        try:
            if self.num_blocks != n0:  # an __index__ above re-initialised this allocator
                raise reinit_error("free")
            refs = self._refs
            seen: dict[int, int] = {}
            for block in blocks:
                seen[block] = seen.get(block, 0) + 1
                if seen[block] > refs[block]:
                    state = "not allocated" if refs[block] == 0 else f"held {refs[block]} time(s)"
                    raise ValueError(
                        f"double free: block {block} is {state} but freed {seen[block]} time(s)"
                    )
            for block in blocks:
                refs[block] -= 1
                if refs[block] == 0:
                    if self._hashes[block] is None:
                        self._free[block] = None
                    else:
                        self._cached[block] = None
        finally:
            self._guard.release()

    def incref(self, block: int) -> None:
        """Share an allocated block with one more request."""
        block = operator.index(block)
        self._enter("incref")
        try:
            block = self._check_block(block)
            if self._refs[block] == 0:
                raise ValueError(
                    f"block {block} is not allocated; use touch() to reuse a cached block"
                )
            if self._refs[block] >= MAX_REFCOUNT:
                raise ValueError(f"block {block} already has the most references ({MAX_REFCOUNT})")
            self._refs[block] += 1
        finally:
            self._guard.release()

    def ref_count(self, block: int) -> int:
        """Current reference count of a block (0 when free or cached)."""
        block = operator.index(block)
        self._enter("ref_count")
        try:
            return self._refs[self._check_any(block)]
        finally:
            self._guard.release()

    def lookup(self, block_hash: int) -> int:
        """Block holding this hash, or -1; refcounts and LRU order are unchanged."""
        block_hash = check_hash(block_hash)
        self._enter("lookup")
        try:
            return self._by_hash.get(block_hash, -1)
        finally:
            self._guard.release()

    def touch(self, block: int) -> None:
        """Reuse a cached block: take it off the evictable list with refcount 1."""
        block = operator.index(block)
        self._enter("touch")
        try:
            block = self._check_block(block)
            if self._refs[block] > 0:
                raise ValueError(
                    f"block {block} is in use (refcount {self._refs[block]}); use incref()"
                )
            if block not in self._cached:
                raise ValueError(
                    f"block {block} is free and holds no prefix; allocate() it instead"
                )
            del self._cached[block]
            self._refs[block] = 1
        finally:
            self._guard.release()

    def set_hash(self, block: int, block_hash: int) -> bool:
        """Record that an allocated block holds this full block; False if another block already does."""
        block, block_hash = operator.index(block), operator.index(block_hash)
        self._enter("set_hash")
        try:
            block = self._check_block(block)
            block_hash = check_hash(block_hash)
            if self._refs[block] == 0:
                raise ValueError(
                    f"block {block} is not allocated; only a block in use can be hashed"
                )
            current = self._hashes[block]
            if current is not None:
                if current == block_hash:
                    return True
                raise ValueError(
                    f"block {block} already holds hash {current}; blocks are hashed once"
                )
            if block_hash in self._by_hash:
                return False
            self._hashes[block] = block_hash
            self._by_hash[block_hash] = block
            return True
        finally:
            self._guard.release()

    def block_hash(self, block: int) -> int | None:
        """The hash recorded for a block, or None."""
        block = operator.index(block)
        self._enter("block_hash")
        try:
            return self._hashes[self._check_any(block)]
        finally:
            self._guard.release()

    def record_lookup(self, hit: bool) -> None:
        """Count one prefix-cache lookup as a hit or a miss."""
        if hit:
            self.prefix_hits += 1
        else:
            self.prefix_misses += 1

    def free_order(self) -> list[int]:
        """Truly free blocks in hand-out order, then cached blocks LRU first (for tests)."""
        self._enter("free_order")
        try:
            return [*self._free, *self._cached]
        finally:
            self._guard.release()
