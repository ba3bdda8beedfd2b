"""Issue 10: the hot path raises, never crashes.

The five crashes of the issue each have a regression test that runs in a subprocess (on the code
before the fix each of them died there with SIGSEGV or corrupted the queue), for the compiled
module and the twin alike. The in-process tests below them pin the rest of the contract: size
limits shared with config validation, every argument converted exactly once, and the
thread-safety contract (not thread-safe: callers serialise; an overlapping call raises
RuntimeError and changes nothing).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
from array import array
from pathlib import Path

import pytest
import sloserve.hotpath as hotpath
from sloserve.config import CacheConfig, SchedulerConfig

from tests.hotpath.conftest import load_impl

ROOT = Path(__file__).resolve().parents[2]
IMPLS = ("cython", "python")


def child_env(impl: str) -> dict[str, str]:
    """The environment of a child that imports `impl` as sloserve.hotpath."""
    env = {k: v for k, v in os.environ.items() if k != "SLOSERVE_NO_EXTENSIONS"}
    if impl == "python":
        env["SLOSERVE_NO_EXTENSIONS"] = "1"
    return env


def describe(proc: subprocess.CompletedProcess) -> str:
    """Why a child failed: the signal that killed it, or its exit status, and its output."""
    rc = proc.returncode
    how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
    return (
        f"child {how}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    )


def run_child(impl: str, body: str, timeout: float = 300) -> str:
    """Run `body` in a fresh interpreter with H = sloserve.hotpath of `impl`; return its stdout."""
    prelude = (
        "import faulthandler; faulthandler.enable()\n"
        "import sloserve.hotpath as H\n"
        f"assert H.IMPLEMENTATION == {impl!r}, H.IMPLEMENTATION\n"
        "Q, B, E = H.RequestQueue, H.BlockAllocator, H.ExpertAllocator\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body)],
        cwd=ROOT,
        env=child_env(impl),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, describe(proc)
    return proc.stdout


# --- the five crashes of the issue, one regression test each -------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_regression_1_instances_whose_init_never_ran_work(impl):
    out = run_child(
        impl,
        """
        assert B.__new__(B).lookup(5) == -1  # segfaulted: the hash table had capacity 0
        assert (5 in Q.__new__(Q)) is False  # segfaulted likewise
        q = Q.__new__(Q)  # an empty queue with the default parameters
        assert (len(q), q.aging, q.handles_in_order()) == (0, 0.95, [])
        q.push(1, 2.0, 10, 0.0)
        q.push(2, 1.0, 10, 0.0)
        q.rekey(0.1)
        assert q.peek() == 2 and q.pop() == 2 and 1 in q and q.pop() == 1
        a = B.__new__(B)  # only the null block
        assert (a.num_blocks, a.num_free, a.allocate(1), a.allocate(0)) == (1, 0, None, [])
        assert (a.ref_count(0), a.block_hash(0), a.free_order()) == (0, None, [])
        for call in (lambda: a.free([1]), lambda: a.incref(1), lambda: a.touch(1),
                     lambda: a.set_hash(1, 5)):
            try:
                call()
            except ValueError as exc:
                assert "out of range" in str(exc), exc
            else:
                raise AssertionError("a block id of an empty allocator was accepted")
        e = E.__new__(E)  # zero layers
        for name in ("acquire", "slot_of", "is_pinned", "pin", "unpin"):
            try:
                getattr(e, name)(0, 0)
            except ValueError as exc:
                assert "layer 0 is out of range" in str(exc), exc
            else:
                raise AssertionError(name)
        assert (e.reserve_rows(0), e.reserve_rows(1)) == (0, None)
        e.release_rows()
        e.__init__(1, 4, 2, 8)  # a late __init__ makes it a normal allocator
        assert e.acquire(0, 3) == (0, False)
        print("ok")
        """,
    )
    assert out.strip() == "ok"


@pytest.mark.parametrize("impl", IMPLS)
def test_regression_2_huge_sizes_are_a_value_error(impl):
    out = run_child(
        impl,
        """
        cases = [
            (lambda: Q(capacity=2**61), "capacity must be <="),  # segfaulted: wrapped malloc
            (lambda: Q(capacity=2**64), "capacity must be <="),
            (lambda: Q(capacity=H.MAX_QUEUE_CAPACITY + 1), "capacity must be <="),
            (lambda: B(2**61), "num_blocks must be <="),
            (lambda: B(2**64), "num_blocks must be <="),
            (lambda: B(H.MAX_BLOCKS + 1), "num_blocks must be <="),
            (lambda: E(2**40, 2**40, 1, 0), "num_layers \\\\* num_experts must be <="),
            (lambda: E(2**33, 2**33, 2**33, 0), "num_layers \\\\* num_experts must be <="),
            (lambda: E(1, 4, 1, 2**70), "workspace_rows must be <="),
        ]
        import re
        for call, match in cases:
            try:
                call()
            except ValueError as exc:
                assert re.search(match, str(exc)), (match, exc)
            else:
                raise AssertionError(match)
        q = Q(capacity=0)
        q.push(2**63 - 1, 1.0, 2**63 - 1, 0.0)  # the extremes that fit are accepted
        assert q.pop() == 2**63 - 1
        e = E(1, 4, 1, H.MAX_WORKSPACE_ROWS)
        assert e.reserve_rows(2**62) == 0 and e.reserve_rows(1) is None
        assert e.reserve_rows(2**200) is None
        assert H.target_batch_size(2**70, 1000) == 2**70 and H.target_batch_size(2**70, 0) == 0
        print("ok")
        """,
    )
    assert out.strip() == "ok"


@pytest.mark.parametrize("impl", IMPLS)
def test_regression_3_free_with_an_index_that_mutates_the_list(impl):
    out = run_child(
        impl,
        """
        class Clears:
            def __init__(self, blocks, value):
                self.blocks, self.value = blocks, value
            def __index__(self):
                self.blocks.clear()  # read past the end of this list: segfault before the fix
                return self.value

        class Grows(Clears):
            def __index__(self):
                self.blocks.extend(range(10_000))
                return self.value

        class Reinits(Clears):
            def __index__(self):
                a.__init__(8)
                return self.value

        a = B(100)
        for kind in (Clears, Grows):
            assert a.allocate(59) == list(range(1, 60)), a.free_order()[:5]
            blocks = []
            blocks.append(kind(blocks, 1))
            blocks.extend(range(2, 60))
            a.free(blocks)  # a snapshot: the 59 blocks given are freed, the mutation is ignored
            assert (a.num_used, a.num_free) == (0, 99)
            a.__init__(100)
        a.allocate(5)
        blocks = []
        blocks.append(Reinits(blocks, 1))
        blocks.extend(range(2, 6))
        try:
            a.free(blocks)
        except ValueError as exc:
            assert "re-initialised" in str(exc), exc
        else:
            raise AssertionError("free() went on after its allocator was re-initialised")
        assert (a.num_blocks, a.num_used, a.num_free) == (8, 0, 7)
        print("ok")
        """,
    )
    assert out.strip() == "ok"


@pytest.mark.parametrize("impl", IMPLS)
def test_regression_4_expert_ids_are_converted_once(impl):
    out = run_child(
        impl,
        """
        class Flip:
            # The first conversion is in range, any later one far outside (read out of bounds).
            def __init__(self, first, later):
                self.first, self.later, self.calls = first, later, 0
            def __index__(self):
                self.calls += 1
                return self.first if self.calls == 1 else self.later

        e = E(2, 4, 2, 0)
        for later in (10**9, -(10**9), 2**62):
            layer, expert = Flip(0, later), Flip(1, later)
            assert e.acquire(layer, expert) == (0, False) or e.slot_of(0, 1) == 0
            assert (layer.calls, expert.calls) == (1, 1)
        for name in ("slot_of", "is_pinned", "pin", "unpin"):
            layer, expert = Flip(1, 10**9), Flip(3, -(10**9))
            try:
                getattr(e, name)(layer, expert)
            except ValueError as exc:
                assert "of layer 1 is not" in str(exc), exc
            assert (layer.calls, expert.calls) == (1, 1), name
        assert e.slot_of(0, 1) == 0 and e.acquire(1, 3) == (0, False)
        print("ok")
        """,
    )
    assert out.strip() == "ok"


@pytest.mark.parametrize("impl", IMPLS)
def test_regression_5_rekey_against_push_from_another_thread(impl):
    """Unserialised rekey + push/pop: each call succeeds or raises RuntimeError; nothing is lost."""
    out = run_child(
        impl,
        """
        import sys, threading, time
        sys.setswitchinterval(1e-6)
        box = [Q(max_wait_s=1e9, capacity=0)]
        stop = threading.Event()
        collisions = [0, 0]

        def rekeyer():
            while not stop.is_set():
                try:
                    box[0].rekey(1.0)
                except RuntimeError:
                    collisions[1] += 1
                time.sleep(0)  # yield: the pusher gets windows in which its calls succeed

        thread = threading.Thread(target=rekeyer)
        thread.start()
        handle, rounds, end = 0, 0, time.monotonic() + 2.0
        try:
            while time.monotonic() < end:
                q = box[0] = Q(max_wait_s=1e9, capacity=0)  # fresh: its arrays grow by realloc
                queued = set()
                for _ in range(3000):
                    try:
                        q.push(handle, 2.0 + (handle % 97) * 0.01, handle % 13, 1.0)
                        queued.add(handle)
                    except RuntimeError:
                        collisions[0] += 1
                    handle += 1
                popped = []
                while len(q):
                    try:
                        popped.append(q.pop())
                    except RuntimeError:
                        collisions[0] += 1
                # Before the fix: duplicates and losses within the first rounds, or SIGSEGV.
                assert len(popped) == len(set(popped)) and set(popped) == queued, rounds
                rounds += 1
        finally:
            stop.set()
            thread.join()
        print(rounds, sum(collisions))
        """,
    )
    rounds, collisions = map(int, out.split())
    assert rounds >= 1
    if impl == "cython":  # the GIL-free rekey overlaps pushes: the guard must have fired
        assert collisions > 0


# --- limits shared with config validation --------------------------------------------------------


def test_config_enforces_the_hot_path_limits():
    assert SchedulerConfig(max_waiting=hotpath.MAX_QUEUE_CAPACITY).max_waiting > 0
    with pytest.raises(ValueError, match="max waiting must be <="):
        SchedulerConfig(max_waiting=hotpath.MAX_QUEUE_CAPACITY + 1)
    with pytest.raises(ValueError, match="max waiting must be <="):
        SchedulerConfig(max_waiting=2**61)
    assert CacheConfig(expert_slots_per_layer=64).expert_slots_per_layer == 64
    with pytest.raises(ValueError, match="expert slots per layer must be <="):
        CacheConfig(expert_slots_per_layer=hotpath.MAX_EXPERT_ENTRIES + 1)


def test_limits_keep_c_sizes_far_from_overflow():
    assert hotpath.MAX_QUEUE_CAPACITY <= hotpath.MAX_QUEUE_ENTRIES < 2**31
    assert hotpath.MAX_BLOCKS + 2 < 2**31 and hotpath.MAX_REFCOUNT < 2**31
    assert hotpath.MAX_EXPERT_ENTRIES * 2 < 2**31 and hotpath.MAX_WORKSPACE_ROWS < 2**63


# --- every argument converted exactly once -------------------------------------------------------


class Counted:
    """An int-like that counts its conversions."""

    def __init__(self, value: int) -> None:
        self.value, self.calls = value, 0

    def __index__(self) -> int:
        self.calls += 1
        return self.value


class CountedFloat:
    """A float-like that counts its conversions."""

    def __init__(self, value: float) -> None:
        self.value, self.calls = value, 0

    def __float__(self) -> float:
        self.calls += 1
        return self.value


def calls_with_counted_arguments(impl):
    """(label, call(args), args) for every method that converts a number."""
    q = impl.RequestQueue(max_wait_s=math.inf)
    q.push(5, 1.0, 0, 0.0)
    a = impl.BlockAllocator(8)
    a.allocate(3)
    a.set_hash(1, 11)
    e = impl.ExpertAllocator(2, 4, 2, 10)
    e.acquire(1, 2)
    return [
        (
            "RequestQueue()",
            lambda *x: impl.RequestQueue(*x),
            [CountedFloat(0.9), CountedFloat(0.1), CountedFloat(0.0), Counted(4)],
        ),
        ("push", q.push, [Counted(6), CountedFloat(2.0), Counted(3), CountedFloat(0.0)]),
        ("contains", lambda x: x in q, [Counted(5)]),
        ("remove", q.remove, [Counted(5)]),
        ("rekey", q.rekey, [CountedFloat(1.0)]),
        ("target_batch_size", impl.target_batch_size, [Counted(8), Counted(3), CountedFloat(0.9)]),
        ("BlockAllocator()", lambda *x: impl.BlockAllocator(*x), [Counted(4)]),
        ("allocate", a.allocate, [Counted(1)]),
        ("incref", a.incref, [Counted(2)]),
        ("ref_count", a.ref_count, [Counted(2)]),
        ("lookup", a.lookup, [Counted(11)]),
        ("set_hash", a.set_hash, [Counted(2), Counted(12)]),
        ("block_hash", a.block_hash, [Counted(2)]),
        ("free", lambda *x: a.free(list(x)), [Counted(3), Counted(2)]),
        (
            "ExpertAllocator()",
            lambda *x: impl.ExpertAllocator(*x),
            [Counted(1), Counted(4), Counted(2), Counted(0)],
        ),
        ("acquire", e.acquire, [Counted(0), Counted(3)]),
        ("slot_of", e.slot_of, [Counted(1), Counted(2)]),
        ("is_pinned", e.is_pinned, [Counted(1), Counted(2)]),
        ("pin", e.pin, [Counted(1), Counted(2)]),
        ("unpin", e.unpin, [Counted(1), Counted(2)]),
        ("reserve_rows", e.reserve_rows, [Counted(4)]),
    ]


def test_every_number_is_converted_exactly_once(impl):
    for label, call, args in calls_with_counted_arguments(impl):
        call(*args)
        assert [arg.calls for arg in args] == [1] * len(args), label


def test_numbers_that_do_not_fit_are_value_errors_in_both(impl):
    a = impl.BlockAllocator(4)
    e = impl.ExpertAllocator(1, 4, 1, 0)
    q = impl.RequestQueue()
    for call in (
        lambda: a.allocate(-(2**64)),
        lambda: a.free([2**64]),
        lambda: a.incref(2**64),
        lambda: a.touch(-(2**64)),
        lambda: a.ref_count(2**100),
        lambda: a.set_hash(2**64, 1),
        lambda: a.block_hash(-(2**64)),
        lambda: e.acquire(2**64, 0),
        lambda: e.slot_of(0, -(2**64)),
        lambda: e.reserve_rows(-(2**64)),
        lambda: q.remove(-(2**64)),
        lambda: q.push(0, 1.0, -(2**70), 0.0),
    ):
        with pytest.raises(ValueError):
            call()
    assert a.allocate(2**64) is None and (2**64 in q) is False


# --- the thread-safety contract ------------------------------------------------------------------


def test_an_overlapping_call_raises_and_changes_nothing():
    """Deterministic: another thread calls into the queue while rekey runs without the GIL."""
    c = load_impl("cython")
    q = c.RequestQueue(max_wait_s=math.inf)
    for handle in range(500):
        q.push(handle, float(handle), 0, 0.0)
    before = q.handles_in_order()
    probe = array("q", [0])
    outcomes: list[str] = []
    stop = threading.Event()

    def intruder() -> None:
        handle = 10**6
        while not stop.is_set():
            handle += 1
            for call in (lambda h=handle: q.push(h, 0.0, 0, 0.0), q.pop, lambda: 3 in q, q.peek):
                try:
                    call()
                    outcomes.append("ok")
                except RuntimeError as exc:
                    outcomes.append("busy" if "not thread-safe" in str(exc) else repr(exc))
                probe[0] += 1

    q._set_gil_probe(probe, 8, 10**10, True)  # rekey waits for 8 attempts inside its pass
    thread = threading.Thread(target=intruder, daemon=True)
    thread.start()
    try:
        q.rekey(0.5)
        advance = q._probe_advance
    finally:
        stop.set()
        thread.join()
        q._set_gil_probe(None)
    assert advance >= 8 and outcomes.count("busy") >= 7
    assert set(outcomes) <= {"ok", "busy"}, outcomes
    # Calls before or after the pass went through whole, calls during it changed nothing: the
    # queue holds distinct handles, each either queued before or pushed by the intruder.
    remaining = q.handles_in_order()
    assert len(remaining) == len(set(remaining)) == len(q)
    assert all(h in before or h > 10**6 for h in remaining)
    assert [q.pop() for _ in range(len(q))] == remaining


def test_twin_refuses_a_call_while_another_is_in_progress():
    p = load_impl("python")
    objs = [p.RequestQueue(), p.BlockAllocator(4), p.ExpertAllocator(1, 2, 1, 4)]
    calls = [
        lambda: objs[0].push(1, 1.0, 0, 0.0),
        lambda: objs[1].allocate(1),
        lambda: objs[2].acquire(0, 0),
    ]
    for obj, call in zip(objs, calls, strict=True):
        obj._guard.acquire()  # what another thread's call in progress holds
        try:
            with pytest.raises(RuntimeError, match="not thread-safe"):
                call()
        finally:
            obj._guard.release()
        call()  # and afterwards the object works
    assert (len(objs[0]), objs[1].num_used, objs[2].misses) == (1, 1, 1)


def test_serialised_calls_from_two_threads_never_collide(impl):
    """The contract's normal case: two threads sharing a lock, no RuntimeError, exact state."""
    q = impl.RequestQueue(max_wait_s=math.inf, capacity=0)
    a = impl.BlockAllocator(64)
    lock = threading.Lock()
    held: list[list[int]] = [[], []]
    pushed: list[set[int]] = [set(), set()]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(3000):
                with lock:
                    q.push(k * 10**6 + i, float(i % 17), i % 5, 0.0)
                    pushed[k].add(k * 10**6 + i)
                    if i % 3 == 0:
                        q.rekey(0.001 * i)
                    if i % 7 == 0:
                        q.pop()
                    blocks = a.allocate(1 + i % 4)
                    if blocks is not None:
                        held[k].extend(blocks)
                    if len(held[k]) > 16:
                        a.free(held[k][::-1])
                        held[k] = []
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    order = q.handles_in_order()
    assert len(order) == len(set(order)) == len(q) and set(order) <= pushed[0] | pushed[1]
    assert a.num_used == len(held[0]) + len(held[1])
    assert not set(held[0]) & set(held[1])
