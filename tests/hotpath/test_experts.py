"""ExpertAllocator: exact slots, LRU eviction, pinning, workspace rows, and bad input."""

from __future__ import annotations

import pytest


def test_slots_fill_in_order_then_evict_lru(impl):
    e = impl.ExpertAllocator(num_layers=2, num_experts=8, slots_per_layer=3, workspace_rows=16)
    assert [e.acquire(0, x) for x in (5, 2, 7)] == [(0, False), (1, False), (2, False)]
    assert e.acquire(0, 5) == (0, True)  # 5 becomes most recent; LRU is now 2
    assert e.acquire(0, 1) == (1, False)  # evicts 2
    assert e.slot_of(0, 2) == -1 and e.slot_of(0, 1) == 1
    assert e.acquire(0, 2) == (2, False)  # evicts 7 (LRU)
    assert e.acquire(1, 2) == (0, False)  # layers are independent
    assert (e.hits, e.misses, e.evictions) == (1, 6, 2)


def test_pinned_experts_are_never_evicted(impl):
    e = impl.ExpertAllocator(1, 8, 2, 0)
    e.acquire(0, 3)
    e.acquire(0, 4)
    e.pin(0, 3)
    e.pin(0, 3)  # idempotent
    assert e.is_pinned(0, 3) and not e.is_pinned(0, 4) and not e.is_pinned(0, 6)
    assert [e.acquire(0, x) for x in (5, 6, 3, 7)] == [
        (1, False),
        (1, False),
        (0, True),
        (1, False),
    ]
    e.pin(0, 7)
    with pytest.raises(ValueError, match="all 2 slots of layer 0 are pinned"):
        e.acquire(0, 1)
    e.unpin(0, 3)  # rejoins as most recently used; 7 stays pinned
    assert e.acquire(0, 1) == (0, False)
    assert e.slot_of(0, 3) == -1


def test_unpin_order_is_most_recent(impl):
    e = impl.ExpertAllocator(1, 8, 3, 0)
    for x in (0, 1, 2):
        e.acquire(0, x)
    e.pin(0, 0)
    e.unpin(0, 0)  # 0 is now the most recently used: LRU order 1, 2, 0
    assert [e.acquire(0, x)[0] for x in (5, 6, 7)] == [1, 2, 0]


def test_workspace_rows(impl):
    e = impl.ExpertAllocator(1, 4, 1, workspace_rows=100)
    assert e.reserve_rows(60) == 0
    assert e.reserve_rows(50) is None
    assert e.reserve_rows(40) == 60
    assert e.reserve_rows(0) == 100
    assert e.reserve_rows(1) is None
    assert (e.rows_in_use, e.peak_rows) == (100, 100)
    e.release_rows()
    assert e.rows_in_use == 0 and e.reserve_rows(10) == 0 and e.peak_rows == 100


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 4, 1, 0), "num_layers must be >= 1"),
        ((1, 0, 1, 0), "num_experts must be >= 1"),
        ((1, 4, 0, 0), "slots_per_layer must be >= 1"),
        ((1, 4, 1, -1), "workspace_rows must be >= 0"),
        ((1, 4, 5, 0), r"slots_per_layer \(5\) must be <= num_experts \(4\)"),
    ],
)
def test_bad_constructor_arguments(impl, args, match):
    with pytest.raises(ValueError, match=match):
        impl.ExpertAllocator(*args)


def test_bad_calls(impl):
    e = impl.ExpertAllocator(2, 4, 2, 10)
    e.acquire(0, 1)
    cases = [
        (lambda: e.acquire(2, 0), "layer 2 is out of range 0..1"),
        (lambda: e.acquire(-1, 0), "layer -1 is out of range"),
        (lambda: e.acquire(0, 4), "expert 4 is out of range 0..3"),
        (lambda: e.pin(0, 2), "expert 2 of layer 0 is not resident"),
        (lambda: e.unpin(0, 1), "expert 1 of layer 0 is not pinned"),
        (lambda: e.unpin(1, 1), "expert 1 of layer 1 is not pinned"),
        (lambda: e.slot_of(0, -1), "expert -1 is out of range"),
        (lambda: e.reserve_rows(-1), "negative number of rows"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    assert (e.hits, e.misses, e.rows_in_use, e.slot_of(0, 1)) == (0, 1, 0, 0)
