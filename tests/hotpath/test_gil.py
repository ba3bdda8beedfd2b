"""The compiled hot path releases the GIL where the work is O(n), and says why everywhere else.

A Python thread counts in a shared int64 buffer while a GIL-free section runs; the C code reads
the counter when the section starts and, before it ends, waits until the counter has advanced
by TARGET. With the GIL held no Python thread can run in between, so the advance would be
exactly 0 (the release_gil=False controls prove it); no timing is involved.

Covered this way: the churns behind the benchmarks (`_bench_queue`, `_bench_blocks`) and the two
O(n) methods the scheduler calls every step, `RequestQueue.rekey` and
`RequestQueue.handles_in_order` (through the `_set_gil_probe` hook). Every other public method
keeps the GIL; `HOLDS_GIL` states why for each one, and a test checks that the table covers the
whole public API, so a new method needs a reason or a GIL test.
"""

from __future__ import annotations

import math
import threading
from array import array

import pytest

from tests.hotpath.conftest import load_impl

C = load_impl("cython")
TARGET = 1000
MAX_OPS = 20_000_000  # only reached if the counter never moves (the GIL was held)
MAX_SPINS = 10**10  # a GIL-free section waits this many reads at most (seconds, not reached)
CONTROL_SPINS = 200_000

_O1 = "O(1) on C fields; releasing and re-taking the GIL would cost more than the work"
_LOG = "O(log n) sift over C structs (~100 ns); a GIL hand-off costs more and stalls the caller"
_K = "O(k) for the k ids passed, converting Python ints per element, which needs the GIL"
_COUNTER = "updates a Python-visible counter only"
HOLDS_GIL = {
    "RequestQueue.__len__": _O1,
    "RequestQueue.__contains__": _O1 + " (one hash probe)",
    "RequestQueue.push": _LOG,
    "RequestQueue.peek": _O1,
    "RequestQueue.pop": _LOG,
    "RequestQueue.remove": _LOG,
    "BlockAllocator.allocate": _K + "; the result is a Python list built as it goes",
    "BlockAllocator.free": _K,
    "BlockAllocator.incref": _O1,
    "BlockAllocator.ref_count": _O1,
    "BlockAllocator.lookup": _O1 + " (one hash probe)",
    "BlockAllocator.touch": _O1,
    "BlockAllocator.set_hash": _O1 + " (one hash insert)",
    "BlockAllocator.block_hash": _O1,
    "BlockAllocator.record_lookup": _COUNTER,
    "BlockAllocator.free_order": "tests only; builds a Python list per block",
    "ExpertAllocator.acquire": _O1 + " (LRU relink)",
    "ExpertAllocator.slot_of": _O1,
    "ExpertAllocator.is_pinned": _O1,
    "ExpertAllocator.pin": _O1,
    "ExpertAllocator.unpin": _O1,
    "ExpertAllocator.reserve_rows": _O1 + " (a bump pointer)",
    "ExpertAllocator.release_rows": _O1,
}
RELEASES_GIL = {"RequestQueue.rekey", "RequestQueue.handles_in_order"}


def run_with_counter(batch, **kwargs):
    counter = array("q", [0])
    stop = threading.Event()
    started = threading.Event()

    def count() -> None:
        started.set()
        while not stop.is_set():
            counter[0] += 1

    thread = threading.Thread(target=count, daemon=True)
    thread.start()
    started.wait()
    try:
        return batch(counter, **kwargs)
    finally:
        stop.set()
        thread.join()


BATCHES = {
    "queue": lambda probe, ops=MAX_OPS, **kw: C.bench_queue(1000, ops, 1, probe, TARGET, **kw),
    "blocks": lambda probe, ops=MAX_OPS, **kw: C.bench_blocks(
        4000, 400, ops, 1, probe, TARGET, **kw
    ),
}


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_python_thread_progresses_inside_the_nogil_batch(kind):
    result = run_with_counter(BATCHES[kind])
    done, advanced = result[1], result[2]
    assert advanced >= TARGET, f"the counter thread never ran during the batch ({advanced})"
    assert done < MAX_OPS


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_control_holding_the_gil_freezes_the_counter(kind):
    result = run_with_counter(BATCHES[kind], ops=200_000, release_gil=False)
    assert result[1] == 200_000 and result[2] == 0


def full_queue(n: int = 2000):
    q = C.RequestQueue(max_wait_s=math.inf, capacity=n)
    for handle in range(n):
        q.push(handle, float(handle % 97), handle % 13, 0.0)
    return q


SECTIONS = {
    "RequestQueue.rekey": lambda q: q.rekey(1.0),
    "RequestQueue.handles_in_order": lambda q: q.handles_in_order(),
}


def run_section(name: str, release_gil: bool, max_spins: int) -> tuple[int, object]:
    q = full_queue()

    def batch(counter):
        q._set_gil_probe(counter, TARGET, max_spins, release_gil)
        try:
            result = SECTIONS[name](q)
            return q._probe_advance, result
        finally:
            q._set_gil_probe(None)

    return run_with_counter(batch)


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_scheduler_methods_run_their_pass_without_the_gil(name):
    advanced, result = run_section(name, True, MAX_SPINS)
    assert advanced >= TARGET, f"no Python thread ran during {name} ({advanced})"
    if name.endswith("handles_in_order"):
        assert sorted(result) == list(range(2000))


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_control_the_same_pass_holding_the_gil_freezes_the_counter(name):
    advanced, _ = run_section(name, False, CONTROL_SPINS)
    assert advanced == 0


def test_every_public_method_either_releases_the_gil_or_says_why_not():
    public = set()
    for cls in (C.RequestQueue, C.BlockAllocator, C.ExpertAllocator):
        for attr in dir(cls):
            if attr.startswith("_") and attr not in ("__len__", "__contains__"):
                continue
            if callable(getattr(cls, attr)):
                public.add(f"{cls.__name__}.{attr}")
    assert public == set(HOLDS_GIL) | RELEASES_GIL
    assert not set(HOLDS_GIL) & RELEASES_GIL
