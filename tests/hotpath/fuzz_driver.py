"""Child process of test_fuzz.py: hostile calls on every public method of every hot-path class.

Run as `python tests/hotpath/fuzz_driver.py --examples N [--trace FILE]`; sloserve.hotpath is
whichever implementation the environment selects (SLOSERVE_NO_EXTENSIONS). Hypothesis draws
programs of calls with huge and negative integers, wrong types, NaN and infinities, objects
whose `__index__` / `__float__` changes its answer, raises, mutates the list it sits in, calls
back into the same object or re-initialises it, on instances whose `__init__` may never have
run, and runs two programs at once from two threads on one object. Every call must return or
raise one of the expected exceptions; afterwards the object must still be consistent. A crash
kills this process, which the parent reports with the last program written to --trace.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import sys
import threading
from collections.abc import Callable
from typing import Any

import sloserve.hotpath as H
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


class Hostile(Exception):
    """Raised by the hostile numbers' own conversion methods."""


# What a call may raise: bad values, wrong types, an empty queue, a float conversion of a huge
# int, an overlapping call (the thread-safety guard), and the hostile objects' own errors.
EXPECTED = (ValueError, TypeError, IndexError, OverflowError, RuntimeError, Hostile)

INT_EDGES = [
    2**24,
    2**24 + 1,
    2**31 - 3,
    2**31 - 2,
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**61,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
    2**100,
    -1,
    -2,
    -(2**31),
    -(2**63),
    -(2**63) - 1,
    -(2**100),
]
# Constructor sizes: small, or past every limit (a valid size just under a limit would only
# test the machine's memory, not the hot path).
CTOR_EDGES = [2**31, 2**32, 2**61, 2**62 + 1, 2**63, 2**64, 2**100, -1, -(2**63), -(2**63) - 1]
FLOAT_EDGES = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308, 5e-324, 10**400, 2**63]


class Box:
    """Filled in before a program runs: the object under test, for the call-back specs."""

    target: Any = None


def small_ctor_args(kind: str) -> tuple:
    return {"queue": (0.9, 0.1, 1e-3, 4), "blocks": (6,), "experts": (2, 4, 2, 8)}[kind]


class HostileNumber:
    """An int- and float-like whose conversion misbehaves as its spec says."""

    def __init__(self, spec: tuple, box: type[Box], kind: str, home: list | None) -> None:
        self.spec, self.box, self.kind, self.home, self.calls = spec, box, kind, home, 0

    def _value(self) -> Any:
        self.calls += 1
        how, *rest = self.spec
        if how == "flip":  # a different answer every other call
            return rest[0] if self.calls % 2 else rest[1]
        if how == "raise":
            raise Hostile("conversion refused")
        if how == "mutate" and self.home is not None:  # the list this number sits in
            self.home.clear() if self.calls % 2 else self.home.extend(range(50))
        elif how == "reenter" and self.box.target is not None:
            try:
                call(
                    self.box.target, rest[1], [materialize(a, self.box, self.kind) for a in rest[2]]
                )
            except EXPECTED:
                pass
        elif how == "reinit" and self.box.target is not None:
            try:
                self.box.target.__init__(*small_ctor_args(self.kind))
            except EXPECTED:
                pass
        return rest[0]

    def __index__(self) -> int:
        value = self._value()
        return int(value) if isinstance(value, int) else 0

    def __float__(self) -> float:
        value = self._value()
        return float(value) if not isinstance(value, int) or abs(value) < 2**1000 else math.inf

    def __bool__(self) -> bool:
        return bool(self.__index__())

    def __repr__(self) -> str:
        return f"Hostile{self.spec}"


def materialize(spec: Any, box: type[Box], kind: str, home: list | None = None) -> Any:
    """The argument a spec describes (plain values stand for themselves)."""
    if (
        isinstance(spec, tuple)
        and spec
        and spec[0] in ("flip", "raise", "mutate", "reenter", "reinit")
    ):
        return HostileNumber(spec, box, kind, home)
    if isinstance(spec, tuple) and spec and spec[0] == "list":
        home: list = []
        home.extend(materialize(s, box, kind, home) for s in spec[1])
        return home
    if isinstance(spec, tuple) and spec and spec[0] == "gen":  # a generator that fails midway
        items = [materialize(s, box, kind) for s in spec[1]]

        def gen():
            yield from items
            raise Hostile("iteration refused")

        return gen()
    return spec


def call(target: Any, method: str, args: list) -> Any:
    if method == "__contains__":
        return args[0] in target
    if method == "__len__":
        return len(target)
    attr = getattr(target, method)
    return attr(*args) if callable(attr) else attr


# --- strategies -----------------------------------------------------------------------------

small_ints = st.integers(-3, 14)
plain_ints = small_ints | st.sampled_from(INT_EDGES)
wrong_types = st.sampled_from([1.5, "7", None, b"1", [1], math.nan])


def hostile(inner: st.SearchStrategy, methods: list[tuple[str, int]]) -> st.SearchStrategy:
    """Specs of hostile numbers whose honest answer is drawn from `inner`."""
    reenter = st.sampled_from(methods).flatmap(
        lambda m: st.tuples(
            st.just("reenter"),
            inner,
            st.just(m[0]),
            st.lists(small_ints, min_size=m[1], max_size=m[1]),
        )
    )
    return st.one_of(
        st.tuples(st.just("flip"), inner, plain_ints),
        st.tuples(st.just("raise")),
        st.tuples(st.just("mutate"), inner),
        st.tuples(st.just("reinit"), inner),
        reenter,
    )


def int_arg(methods: list[tuple[str, int]]) -> st.SearchStrategy:
    return st.one_of(
        plain_ints, plain_ints, plain_ints, wrong_types, hostile(small_ints, methods), st.booleans()
    )


def float_arg(methods: list[tuple[str, int]]) -> st.SearchStrategy:
    return st.one_of(
        st.floats(-5.0, 5.0),
        st.sampled_from(FLOAT_EDGES),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from(["1.0", None, 1j]),
        hostile(st.floats(-2.0, 2.0), methods),
    )


def ctor_int(methods: list[tuple[str, int]]) -> st.SearchStrategy:
    return st.one_of(
        st.integers(-1, 12),
        st.integers(0, 12),
        st.sampled_from(CTOR_EDGES),
        wrong_types,
        st.tuples(st.just("flip"), st.integers(0, 12), st.sampled_from(CTOR_EDGES + [10**6])),
        st.tuples(st.just("raise")),
    )


def list_arg(methods: list[tuple[str, int]]) -> st.SearchStrategy:
    items = st.lists(int_arg(methods), max_size=8)
    return st.one_of(
        items.map(lambda xs: ("list", tuple(xs))),
        items.map(lambda xs: ("gen", tuple(xs))),
        st.lists(small_ints, max_size=70).map(lambda xs: ("list", tuple(xs))),
        wrong_types,
        st.just(("list", ())),
    )


QUEUE_METHODS = [
    ("push", 4),
    ("peek", 0),
    ("pop", 0),
    ("remove", 1),
    ("rekey", 1),
    ("handles_in_order", 0),
    ("__len__", 0),
    ("__contains__", 1),
]
BLOCK_METHODS = [
    ("allocate", 1),
    ("free", 1),
    ("incref", 1),
    ("ref_count", 1),
    ("lookup", 1),
    ("touch", 1),
    ("set_hash", 2),
    ("block_hash", 1),
    ("record_lookup", 1),
    ("free_order", 0),
]
EXPERT_METHODS = [
    ("acquire", 2),
    ("slot_of", 2),
    ("is_pinned", 2),
    ("pin", 2),
    ("unpin", 2),
    ("reserve_rows", 1),
    ("release_rows", 0),
]


def queue_call() -> st.SearchStrategy:
    i, f = int_arg(QUEUE_METHODS), float_arg(QUEUE_METHODS)
    return st.one_of(
        st.tuples(st.just("push"), st.tuples(i, f, i, f)),
        st.tuples(
            st.just("push"),
            st.tuples(small_ints, st.floats(-1, 3), st.integers(0, 99), st.floats(0, 1)),
        ),
        st.tuples(st.sampled_from(["peek", "pop", "handles_in_order", "__len__"]), st.just(())),
        st.tuples(st.sampled_from(["remove", "__contains__"]), st.tuples(i)),
        st.tuples(st.just("rekey"), st.tuples(f)),
        st.tuples(st.sampled_from(["aging", "max_wait_s", "length_weight_s"]), st.just(())),
        st.tuples(st.just("__init__"), st.tuples(f, f, f, ctor_int(QUEUE_METHODS))),
    )


def block_call() -> st.SearchStrategy:
    i = int_arg(BLOCK_METHODS)
    return st.one_of(
        st.tuples(st.just("allocate"), st.tuples(i)),
        st.tuples(st.just("allocate"), st.tuples(st.integers(0, 5))),
        st.tuples(st.just("free"), st.tuples(list_arg(BLOCK_METHODS))),
        st.tuples(
            st.sampled_from(
                ["incref", "ref_count", "touch", "block_hash", "lookup", "record_lookup"]
            ),
            st.tuples(i),
        ),
        st.tuples(st.just("set_hash"), st.tuples(i, i)),
        st.tuples(
            st.sampled_from(
                [
                    "free_order",
                    "num_free",
                    "num_cached",
                    "num_used",
                    "num_total",
                    "evictions",
                    "num_blocks",
                ]
            ),
            st.just(()),
        ),
        st.tuples(st.just("__init__"), st.tuples(ctor_int(BLOCK_METHODS))),
    )


def expert_call() -> st.SearchStrategy:
    i = int_arg(EXPERT_METHODS)
    return st.one_of(
        st.tuples(
            st.sampled_from(["acquire", "slot_of", "is_pinned", "pin", "unpin"]), st.tuples(i, i)
        ),
        st.tuples(
            st.sampled_from(["acquire", "pin", "unpin"]),
            st.tuples(st.integers(0, 2), st.integers(0, 4)),
        ),
        st.tuples(st.just("reserve_rows"), st.tuples(i)),
        st.tuples(
            st.sampled_from(["release_rows", "hits", "misses", "rows_in_use", "peak_rows"]),
            st.just(()),
        ),
        st.tuples(st.just("__init__"), st.tuples(*[ctor_int(EXPERT_METHODS)] * 4)),
    )


KINDS: dict[str, tuple[Callable[..., Any], Callable[[], st.SearchStrategy], st.SearchStrategy]] = {
    "queue": (
        H.RequestQueue,
        queue_call,
        st.tuples(
            st.floats(0.5, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 1e-2), st.integers(0, 64)
        ),
    ),
    "blocks": (H.BlockAllocator, block_call, st.tuples(st.integers(1, 24))),
    "experts": (
        H.ExpertAllocator,
        expert_call,
        st.tuples(st.integers(1, 3), st.integers(4, 6), st.integers(1, 4), st.integers(0, 64)),
    ),
}


def program(kind: str) -> st.SearchStrategy:
    """(how to create the object, its constructor arguments, the calls)."""
    _, calls, ctor = KINDS[kind]
    return st.tuples(
        st.sampled_from(["init", "init", "new"]),  # "new": cls.__new__(cls), __init__ never runs
        ctor,
        st.lists(calls(), min_size=1, max_size=25),
    )


# --- running a program and checking the object afterwards -------------------------------------


TRACE: Any = None


def trace(label: str, prog: Any) -> None:
    """Write the program about to run (what the parent prints if this process dies)."""
    if TRACE is not None:
        TRACE.seek(0)
        TRACE.truncate()
        TRACE.write(f"{label}: {prog!r}\n")
        TRACE.flush()


def create(kind: str, how: str, ctor: tuple) -> Any:
    cls = KINDS[kind][0]
    return cls.__new__(cls) if how == "new" else cls(*ctor)


STATS = {"calls": 0, "raised": 0}


def run_calls(obj: Any, kind: str, calls: list, box: type[Box]) -> None:
    for method, specs in calls:
        STATS["calls"] += 1
        args = [materialize(s, box, kind) for s in specs]
        try:
            call(obj, method, args)
        except EXPECTED:
            STATS["raised"] += 1


def check_consistent(obj: Any, kind: str) -> None:
    """The object's invariants, read through its public API (no call may fail here)."""
    if kind == "queue":
        order = obj.handles_in_order()
        assert len(order) == len(set(order)) == len(obj), order
        assert all(h in obj for h in order)
        assert [obj.pop() for _ in range(len(obj))] == order
    elif kind == "blocks":
        free = obj.free_order()
        assert len(free) == len(set(free)) == obj.num_free
        assert obj.num_free + obj.num_used == obj.num_total == obj.num_blocks - 1
        refs = [obj.ref_count(b) for b in range(obj.num_blocks)]
        assert refs[0] == 0 and all(refs[b] == 0 for b in free)
        assert sum(r > 0 for r in refs) == obj.num_used
        for b in range(1, obj.num_blocks):
            h = obj.block_hash(b)
            assert h is None or obj.lookup(h) == b
        assert obj.allocate(obj.num_free) is not None and obj.num_free == 0
    else:
        for layer in range(obj.num_layers):
            slots = [obj.slot_of(layer, x) for x in range(obj.num_experts)]
            live = [s for s in slots if s >= 0]
            assert len(live) == len(set(live)) <= obj.slots_per_layer
            assert all(0 <= s < obj.slots_per_layer for s in live)
        assert obj.rows_in_use <= obj.workspace_rows


def one_thread(kind: str, prog: tuple) -> None:
    trace(kind, prog)
    how, ctor, calls = prog

    class B(Box):
        pass

    try:
        obj = create(kind, how, ctor)
    except EXPECTED:
        return
    B.target = obj
    run_calls(obj, kind, calls, B)
    check_consistent(obj, kind)


def two_threads(kind: str, prog: tuple, other: list) -> None:
    trace(f"{kind} x2", (prog, other))
    how, ctor, calls = prog

    class B(Box):
        pass

    try:
        obj = create(kind, how, ctor)
    except EXPECTED:
        return
    B.target = obj
    failures: list[BaseException] = []
    start = threading.Barrier(2)

    def run(program_calls: list) -> None:
        try:
            start.wait()
            for _ in range(3):
                run_calls(obj, kind, program_calls, B)
        except BaseException as exc:  # reported below: only EXPECTED may escape a call
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in (calls, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    check_consistent(obj, kind)


def target_batch_size_calls(args: tuple) -> None:
    trace("target_batch_size", args)
    try:
        H.target_batch_size(*[materialize(a, Box, "queue") for a in args])
    except EXPECTED:
        pass


def make_one_thread_test(kind: str, config: settings) -> Callable[[], None]:
    @config
    @given(program(kind))
    def test(prog: tuple) -> None:
        one_thread(kind, prog)

    return test


def make_two_thread_test(kind: str, config: settings) -> Callable[[], None]:
    @config
    @given(program(kind), st.lists(KINDS[kind][1](), min_size=1, max_size=25))
    def test(prog: tuple, other: list) -> None:
        two_threads(kind, prog, other)

    return test


def main() -> int:
    global TRACE
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--trace", default=None)
    opts = parser.parse_args()
    faulthandler.enable()
    sys.setswitchinterval(1e-5)  # more interleavings in the two-thread programs
    if opts.trace:
        TRACE = open(opts.trace, "w")  # noqa: SIM115 - held for the whole run
    config = settings(
        max_examples=opts.examples,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )
    few = settings(config, max_examples=max(opts.examples // 3, 10))
    tests = []
    for kind in KINDS:
        tests += [make_one_thread_test(kind, config), make_two_thread_test(kind, few)]
    i, f = int_arg(QUEUE_METHODS), float_arg(QUEUE_METHODS)
    tests.append(few(given(st.tuples(i, i) | st.tuples(i, i, f))(target_batch_size_calls)))
    for test in tests:
        test()
    module = sys.modules[H.RequestQueue.__module__]
    print(
        f"{H.IMPLEMENTATION}: {len(tests)} hostile-call tests passed ({opts.examples} examples "
        f"each): {STATS['calls']} calls, {STATS['raised']} raised an expected exception; "
        f"module {module.__file__}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
