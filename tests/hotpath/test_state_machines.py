"""Random operation sequences run on the compiled module and the twin side by side.

Every call must give the same result or the same error in both; after each step the invariants
are checked against a small model: the queue's order is the documented rule, no block is handed
out twice or lost, refcounts and hashes match, pinned experts stay resident.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.hotpath.conftest import load_impl

C, P = load_impl("cython"), load_impl("python")
SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def both(objs, method: str, *args):
    """Call `method` on both objects; assert identical outcomes; return ("ok", value) or the error."""
    outcomes = []
    for obj in objs:
        try:
            outcomes.append(("ok", getattr(obj, method)(*args)))
        except (ValueError, IndexError, TypeError) as exc:
            outcomes.append((type(exc).__name__, str(exc)))
    assert outcomes[0] == outcomes[1], (method, args, outcomes)
    return outcomes[0]


class QueueMachine(RuleBasedStateMachine):
    """Push/pop/peek/remove/rekey on both queues; the order must follow the documented rule."""

    AGING, MAX_WAIT, WEIGHT = 0.9, 0.05, 1e-3

    def __init__(self) -> None:
        super().__init__()
        self.queues = [
            impl.RequestQueue(
                aging=self.AGING, max_wait_s=self.MAX_WAIT, length_weight_s=self.WEIGHT
            )
            for impl in (C, P)
        ]
        self.now = 100.0
        self.seq = 0
        self.model: dict[int, dict] = {}

    def ref_order(self) -> list[int]:
        def sort_key(item):
            handle, e = item
            if e["starved"]:
                return (0, e["seq"], 0.0)
            return (1, e["key"], e["seq"])

        return [h for h, _ in sorted(self.model.items(), key=sort_key)]

    def ref_key(self, e: dict) -> float:
        base = (e["deadline"] - self.now) + self.WEIGHT * e["tokens"]
        scale = max(self.AGING ** e["steps"], 1e-300)
        return base * scale if base >= 0 else base / scale

    @rule(
        handle=st.integers(-3, 12),
        slack=st.floats(-1.0, 1.0) | st.sampled_from([math.inf, math.nan, 0.0]),
        tokens=st.integers(-1, 500),
    )
    def push(self, handle, slack, tokens):
        kind, _ = both(self.queues, "push", handle, self.now + slack, tokens, self.now)
        valid = handle not in self.model and not math.isnan(slack) and tokens >= 0
        assert (kind == "ok") == valid
        if valid:
            e = {"deadline": self.now + slack, "tokens": tokens, "push": self.now, "steps": 0}
            e.update(seq=self.seq, starved=False)
            e["key"] = self.ref_key(e)
            self.model[handle] = e
            self.seq += 1

    @rule()
    def pop(self):
        expected = self.ref_order()[:1]
        kind, value = both(self.queues, "pop")
        if expected:
            assert (kind, value) == ("ok", expected[0])
            del self.model[value]
        else:
            assert kind == "IndexError"

    @rule()
    def peek(self):
        kind, value = both(self.queues, "peek")
        assert (kind == "ok") == bool(self.model)
        if self.model:
            assert value == self.ref_order()[0]

    @rule(handle=st.integers(-3, 12))
    def remove(self, handle):
        kind, _ = both(self.queues, "remove", handle)
        assert (kind == "ok") == (handle in self.model)
        self.model.pop(handle, None)

    @rule(dt=st.sampled_from([0.0, 0.001, 0.01, 0.03, 0.2]))
    def tick(self, dt):
        self.now += dt

    @rule()
    def rekey(self):
        both(self.queues, "rekey", self.now)
        for e in self.model.values():
            e["steps"] += 1
            e["starved"] = e["starved"] or self.now - e["push"] > self.MAX_WAIT
            e["key"] = self.ref_key(e)

    @invariant()
    def same_order_as_the_rule(self):
        expected = self.ref_order()
        for q in self.queues:
            assert q.handles_in_order() == expected
            assert len(q) == len(expected)
            assert all(h in q for h in expected)


class BlockMachine(RuleBasedStateMachine):
    """Allocate/free/share/hash/touch on both allocators against a refcount model."""

    N = 10

    def __init__(self) -> None:
        super().__init__()
        self.allocs = [impl.BlockAllocator(self.N) for impl in (C, P)]
        self.refs = [0] * self.N
        self.hashes: dict[int, int] = {}  # block -> hash
        self.held: list[list[int]] = []  # live "requests", each a list of references

    def cached(self) -> set[int]:
        return {b for b, h in self.hashes.items() if self.refs[b] == 0}

    @rule(n=st.integers(-1, 6))
    def allocate(self, n):
        kind, blocks = both(self.allocs, "allocate", n)
        if n < 0:
            assert kind == "ValueError"
            return
        available = [b for b in range(1, self.N) if self.refs[b] == 0]
        if n > len(available):
            assert blocks is None
            return
        unhashed = [b for b in available if b not in self.hashes]
        assert len(set(blocks)) == n and 0 not in blocks
        assert all(self.refs[b] == 0 for b in blocks), "a block was handed out twice"
        # truly free blocks first, cached ones only when those run out
        if n <= len(unhashed):
            assert set(blocks) <= set(unhashed)
        else:
            assert set(unhashed) <= set(blocks)
        for b in blocks:
            self.refs[b] = 1
            self.hashes.pop(b, None)
        self.held.append(blocks)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_request(self, data):
        blocks = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        assert both(self.allocs, "free", blocks[::-1])[0] == "ok"
        for b in blocks:
            self.refs[b] -= 1

    @rule(blocks=st.lists(st.integers(-1, 11), max_size=4))
    def free_arbitrary(self, blocks):
        kind, _ = both(self.allocs, "free", blocks)
        counts = {b: blocks.count(b) for b in blocks}
        valid = all(0 < b < self.N and self.refs[b] >= c for b, c in counts.items())
        assert (kind == "ok") == valid
        if valid:
            for b in blocks:
                self.refs[b] -= 1
            # forget the freed references from the live requests
            for b in blocks:
                for req in self.held:
                    if b in req:
                        req.remove(b)
                        break
            self.held = [req for req in self.held if req]

    @rule(h=st.integers(0, 6))
    def share_by_hash(self, h):
        kind, block = both(self.allocs, "lookup", h)
        expected = next((b for b, bh in self.hashes.items() if bh == h), -1)
        assert block == expected
        both(self.allocs, "record_lookup", block >= 0)
        if block < 0:
            return
        method = "incref" if self.refs[block] > 0 else "touch"
        assert both(self.allocs, method, block)[0] == "ok"
        self.refs[block] += 1
        self.held.append([block])

    @rule(block=st.integers(0, 10), h=st.integers(0, 6))
    def set_hash(self, block, h):
        kind, value = both(self.allocs, "set_hash", block, h)
        if not 0 < block < self.N or self.refs[block] == 0:
            assert kind == "ValueError"
        elif block in self.hashes:
            assert (kind == "ok") == (self.hashes[block] == h)
        elif h in self.hashes.values():
            assert (kind, value) == ("ok", False)
        else:
            assert (kind, value) == ("ok", True)
            self.hashes[block] = h

    @rule(block=st.integers(-1, 10))
    def touch_or_incref_arbitrary(self, block):
        for method in ("touch", "incref"):
            kind, _ = both(self.allocs, method, block)
            if kind == "ok":
                self.refs[block] += 1
                self.held.append([block])

    @invariant()
    def no_block_lost_or_doubled(self):
        used = {b for b in range(1, self.N) if self.refs[b] > 0}
        cached = self.cached()
        orders = [a.free_order() for a in self.allocs]
        assert orders[0] == orders[1]
        order = orders[0]
        assert len(order) == len(set(order)) and 0 not in order
        assert set(order) | used == set(range(1, self.N)) and not set(order) & used
        n_free = len(order) - len(cached)
        assert set(order[n_free:]) == cached  # cached blocks sit after the truly free ones
        for a in self.allocs:
            assert (a.num_free, a.num_cached, a.num_used, a.num_total) == (
                len(order),
                len(cached),
                len(used),
                self.N - 1,
            )
            assert [a.ref_count(b) for b in range(self.N)] == self.refs
            assert [a.block_hash(b) for b in range(self.N)] == [
                self.hashes.get(b) for b in range(self.N)
            ]
        assert sum(len(r) for r in self.held) == sum(self.refs)
        assert self.allocs[0].prefix_hits == self.allocs[1].prefix_hits


class ExpertMachine(RuleBasedStateMachine):
    """acquire/pin/unpin/rows on both allocators; pinned experts must stay resident."""

    L, E, S, ROWS = 2, 6, 3, 20

    def __init__(self) -> None:
        super().__init__()
        self.allocs = [impl.ExpertAllocator(self.L, self.E, self.S, self.ROWS) for impl in (C, P)]
        self.pinned: set[tuple[int, int]] = set()

    @rule(layer=st.integers(0, 2), expert=st.integers(0, 6))
    def acquire(self, layer, expert):
        resident = 0 <= layer < self.L and 0 <= expert < self.E and self.slot(layer, expert) >= 0
        kind, value = both(self.allocs, "acquire", layer, expert)
        if kind == "ok":
            assert value[1] == resident

    def slot(self, layer, expert) -> int:
        return self.allocs[0].slot_of(layer, expert)

    @rule(layer=st.integers(0, 1), expert=st.integers(0, 5))
    def pin(self, layer, expert):
        if both(self.allocs, "pin", layer, expert)[0] == "ok":
            self.pinned.add((layer, expert))

    @rule(layer=st.integers(0, 1), expert=st.integers(0, 5))
    def unpin(self, layer, expert):
        if both(self.allocs, "unpin", layer, expert)[0] == "ok":
            self.pinned.remove((layer, expert))

    @rule(n=st.integers(-1, 12))
    def reserve(self, n):
        both(self.allocs, "reserve_rows", n)

    @rule()
    def release(self):
        both(self.allocs, "release_rows")

    @invariant()
    def consistent(self):
        for layer in range(self.L):
            slots = [[a.slot_of(layer, x) for x in range(self.E)] for a in self.allocs]
            assert slots[0] == slots[1]
            live = [s for s in slots[0] if s >= 0]
            assert len(live) == len(set(live)) <= self.S and all(0 <= s < self.S for s in live)
        for layer, expert in self.pinned:
            assert self.slot(layer, expert) >= 0 and self.allocs[1].is_pinned(layer, expert)
        fields = ("hits", "misses", "evictions", "rows_in_use", "peak_rows")
        a, b = ([getattr(x, f) for f in fields] for x in self.allocs)
        assert a == b and a[3] <= self.ROWS


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = SETTINGS
TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = SETTINGS
TestExpertMachine = ExpertMachine.TestCase
TestExpertMachine.settings = SETTINGS


def test_bench_churns_agree():
    """The nogil C churns and the twins' public-API churns produce the same checksums."""
    assert C.bench_queue(300, 5000, 11) == P.bench_queue(300, 5000, 11)
    assert C.bench_blocks(600, 80, 5000, 11) == P.bench_blocks(600, 80, 5000, 11)
