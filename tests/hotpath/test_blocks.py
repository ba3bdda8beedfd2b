"""BlockAllocator: exact block ids and list order on hand-made cases, and every bad input."""

from __future__ import annotations

import pytest


def counts(a) -> tuple[int, int, int, int]:
    return a.num_free, a.num_cached, a.num_used, a.num_total


def test_fresh_allocator_hands_out_ids_in_order(impl):
    a = impl.BlockAllocator(8)
    assert counts(a) == (7, 0, 0, 7)
    assert a.allocate(3) == [1, 2, 3]
    assert a.allocate(2) == [4, 5]
    assert a.allocate(0) == []
    assert counts(a) == (2, 0, 5, 7)
    assert a.ref_count(0) == 0 and a.ref_count(3) == 1


def test_freed_blocks_join_the_tail_in_the_order_given(impl):
    a = impl.BlockAllocator(8)
    first = a.allocate(3)
    a.allocate(2)
    a.free(first[::-1])  # tail first: 3, 2, 1
    assert a.free_order() == [6, 7, 3, 2, 1]
    assert a.allocate(3) == [6, 7, 3]


def test_all_or_nothing(impl):
    a = impl.BlockAllocator(5)
    assert a.allocate(2) == [1, 2]
    assert a.allocate(3) is None
    assert counts(a) == (2, 0, 2, 4)
    assert a.free_order() == [3, 4]


def test_cached_prefix_survives_free_and_is_evicted_lru_first(impl):
    a = impl.BlockAllocator(6)  # usable blocks 1..5
    req = a.allocate(3)
    assert req == [1, 2, 3]
    assert a.set_hash(1, 101) and a.set_hash(2, 102)
    a.free(req[::-1])  # 3 is unhashed -> free list; 2 then 1 -> cached LRU
    assert counts(a) == (5, 2, 0, 5)
    assert a.free_order() == [4, 5, 3, 2, 1]
    assert a.lookup(101) == 1 and a.lookup(102) == 2 and a.lookup(103) == -1
    assert a.block_hash(1) == 101 and a.block_hash(3) is None
    a.touch(1)  # prefix hit: reused with refcount 1, off the evictable list
    assert a.ref_count(1) == 1 and counts(a) == (4, 1, 1, 5)
    assert a.allocate(4) == [4, 5, 3, 2]  # free first, then evicts 2 and drops its hash
    assert a.lookup(102) == -1 and a.block_hash(2) is None and a.evictions == 1
    assert a.lookup(101) == 1  # in use, still findable for sharing
    assert a.allocate(1) is None


def test_shared_block_is_freed_at_refcount_zero(impl):
    a = impl.BlockAllocator(4)
    (b,) = a.allocate(1)
    a.set_hash(b, 7)
    a.incref(b)
    assert a.ref_count(b) == 2
    a.free([b])
    assert a.ref_count(b) == 1 and a.num_cached == 0
    a.free([b])
    assert a.ref_count(b) == 0 and a.num_cached == 1 and a.lookup(7) == b
    a.allocate(2)
    a.touch(b)
    a.free(
        [
            b,
        ]
    )
    assert a.free_order() == [b]


def test_same_block_twice_in_one_free(impl):
    a = impl.BlockAllocator(4)
    (b,) = a.allocate(1)
    a.incref(b)
    a.free([b, b])
    assert a.ref_count(b) == 0 and a.free_order() == [2, 3, 1]


def test_eviction_order_follows_tail_first_frees(impl):
    a = impl.BlockAllocator(7)
    r1 = a.allocate(3)
    r2 = a.allocate(3)
    for i, b in enumerate(r1 + r2):
        a.set_hash(b, 1000 + i)
    a.free(r2[::-1])
    a.free(r1[::-1])
    assert a.free_order() == [6, 5, 4, 3, 2, 1]
    assert a.allocate(2) == [6, 5]  # request 2's chain tail goes first
    assert [a.lookup(1000 + i) for i in range(6)] == [1, 2, 3, 4, -1, -1]


def test_duplicate_hash_keeps_the_first_block(impl):
    a = impl.BlockAllocator(4)
    b1, b2 = a.allocate(2)
    assert a.set_hash(b1, 42) is True
    assert a.set_hash(b2, 42) is False
    assert a.block_hash(b2) is None and a.lookup(42) == b1
    assert a.set_hash(b1, 42) is True  # idempotent
    with pytest.raises(ValueError, match="already holds hash 42"):
        a.set_hash(b1, 43)
    a.free([b2, b1])
    assert a.free_order() == [3, b2, b1]  # b2 unhashed -> free list; b1 cached


def test_extreme_hashes(impl):
    a = impl.BlockAllocator(4)
    b1, b2, b3 = a.allocate(3)
    for b, h in ((b1, -(2**63)), (b2, 2**63 - 1), (b3, 0)):
        assert a.set_hash(b, h)
    assert [a.lookup(h) for h in (-(2**63), 2**63 - 1, 0, 1)] == [b1, b2, b3, -1]


def test_counters(impl):
    a = impl.BlockAllocator(3)
    a.record_lookup(True)
    a.record_lookup(False)
    a.record_lookup(False)
    assert (a.prefix_hits, a.prefix_misses) == (1, 2)


def test_only_the_null_block(impl):
    a = impl.BlockAllocator(1)
    assert counts(a) == (0, 0, 0, 0)
    assert a.allocate(1) is None and a.allocate(0) == []


def test_bad_input(impl):
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        impl.BlockAllocator(0)
    a = impl.BlockAllocator(4)
    b1, b2 = a.allocate(2)
    before = (counts(a), a.free_order(), a.ref_count(b1), a.ref_count(b2))
    cases = [
        (lambda: a.allocate(-1), "negative number of blocks"),
        (lambda: a.free([0]), "block 0 is the null block"),
        (lambda: a.free([b2, 0]), "block 0 is the null block"),
        (lambda: a.free([9]), r"block 9 is out of range 1\.\.3"),
        (lambda: a.free([-1]), "out of range"),
        (lambda: a.free([2**70]), "out of range"),
        (lambda: a.free([3]), "double free: block 3 is not allocated"),
        (lambda: a.free([b2, b1, b1]), f"double free: block {b1} is held 1 time"),
        (lambda: a.incref(3), "block 3 is not allocated; use touch"),
        (lambda: a.incref(0), "null block"),
        (lambda: a.touch(b1), f"block {b1} is in use"),
        (lambda: a.touch(3), "block 3 is free and holds no prefix"),
        (lambda: a.set_hash(3, 5), "block 3 is not allocated"),
        (lambda: a.set_hash(b1, 2**64), "block_hash must fit in a signed 64-bit int"),
        (lambda: a.lookup(-(2**63) - 1), "block_hash must fit in a signed 64-bit int"),
        (lambda: a.ref_count(4), "out of range"),
        (lambda: a.block_hash(-1), "out of range"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
        assert (counts(a), a.free_order(), a.ref_count(b1), a.ref_count(b2)) == before, match
    with pytest.raises(TypeError):
        a.allocate(1.5)
    with pytest.raises(TypeError):
        a.free([1.0])
