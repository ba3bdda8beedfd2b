"""Partial expert residency: a few device slots per MoE layer in front of every expert in host memory.

The hot path's `ExpertAllocator` decides which slot an expert gets (LRU over unpinned slots).
Host copies are page-locked only when CUDA exists. Invariants (read before changing `use`):

* An expert is pinned in the allocator from the moment it is acquired for a step until the
  caller has finished with its weights, so no later acquire in the same chunk evicts it. Chunks
  hold at most ``slots - len(pinned)`` experts, so a free-able slot always exists.
* On CUDA, copies run on a side stream. A copy into a slot first waits for the event recorded
  after the slot's last reader was queued (not for the whole current stream), so a prefetch for
  layer i+1 overlaps layer i's compute; the current stream waits on each copy's event before the
  expert's weights are read. Copies of one chunk likewise overlap the experts ahead of them.
* A prefetch uses at most the unpinned slots and never evicts another expert of the same
  prediction; a prediction that misses costs bytes, never a wrong result: a needed expert that is
  not resident is copied in (a miss) before it runs.
* Pinned ("preloaded") experts are chosen by routing statistics and never evicted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch
from sloserve.layers.quant import Int8Linear
from sloserve.memory.expert_stats import ExpertCounters

# (expert, w13 [2I, H], w2 [H, I]): the plain weights, or int8 ones as Int8Linear
Slot = tuple[int, torch.Tensor | Int8Linear, torch.Tensor | Int8Linear]


class ExpertSlots:
    """`slots` device slots per MoE layer over host copies of all `num_experts` experts."""

    def __init__(
        self,
        host: list[tuple[torch.Tensor, torch.Tensor]],
        slots: int,
        alloc,
        counters: ExpertCounters,
        carve: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """`scales`: int8 experts (`host` int8, `dtype` torch.int8), each layer's float32 scale per
        row (s13 [E, 2I], s2 [E, H]); their slots are carved beside the weights' and copied with them."""
        self.device, self.slots, self._alloc, self.counters = device, slots, alloc, counters
        self._cuda = device.type == "cuda"
        pin = self._cuda and torch.cuda.is_available()
        self._host_w13 = [_host_copy(w13, dtype, pin) for w13, _ in host]
        self._host_w2 = [_host_copy(w2, dtype, pin) for _, w2 in host]
        layers = len(host)
        self._w13 = carve("expert_slots.w13", (layers, slots, *self._host_w13[0].shape[1:]), dtype)
        self._w2 = carve("expert_slots.w2", (layers, slots, *self._host_w2[0].shape[1:]), dtype)
        self._host_scales = scales
        self._s13 = self._s2 = None
        if scales is not None:
            f32 = torch.float32
            self._s13 = carve("expert_slots.s13", (layers, slots, scales[0][0].shape[1]), f32)
            self._s2 = carve("expert_slots.s2", (layers, slots, scales[0][1].shape[1]), f32)
        slot_tensors = [t for t in (self._w13, self._w2, self._s13, self._s2) if t is not None]
        self.expert_bytes = sum(t[0, 0].numel() * t.element_size() for t in slot_tensors)
        # expert whose weights each slot holds
        self._in_slot = [[-1] * slots for _ in range(layers)]
        self._pinned: list[set[int]] = [set() for _ in range(layers)]
        # copied ahead, not used yet
        self.prefetched: list[set[int]] = [set() for _ in range(layers)]
        if self._cuda:
            self._stream = torch.cuda.Stream(device=device)
            self._copied = [[torch.cuda.Event() for _ in range(slots)] for _ in range(layers)]
            self._read = [[torch.cuda.Event() for _ in range(slots)] for _ in range(layers)]
            # a copy the current stream awaits
            self._pending = [[False] * slots for _ in range(layers)]
            self._miss_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def host_pinned(self) -> bool:
        return self._host_w13[0].is_pinned()

    def use(self, li: int, active: Sequence[int]) -> Iterator[Slot]:
        """Each active expert's weights, resident ones (pinned first) before misses."""
        pinned = self._pinned[li]
        # Resident experts first: they are used before the misses of this step can evict them
        # (ascending order would make LRU evict exactly the experts needed next step).
        cold = sorted(
            (e for e in active if e not in pinned), key=lambda e: self._alloc.slot_of(li, e) < 0
        )
        for e in active:
            if e in pinned:
                slot, hit = self._alloc.acquire(li, e)
                assert hit, "a preloaded expert must stay resident"
                self.counters.hits += 1
                yield e, *self._ready(li, slot)
                self._done_reading(li, slot)
        capacity = self.slots - len(pinned)
        for start in range(0, len(cold), capacity):
            yield from self._chunk(li, cold[start : start + capacity])

    def hold(
        self, li: int, active: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
        """Make every active expert resident at once and hold it: (w13 [S, 2I, H], w2 [S, H, I], slot per expert).

        None (nothing changed) when they do not all fit beside the pinned experts. `release` ends the hold.
        """
        pinned = self._pinned[li]
        if sum(1 for e in active if e not in pinned) > self.slots - len(pinned):
            return None
        slot_of = [-1] * len(self._host_w13[li])
        misses = []
        # resident ones first
        for e in sorted(active, key=lambda e: self._alloc.slot_of(li, e) < 0):
            slot, hit = self._alloc.acquire(li, e)
            if e not in pinned:
                self._alloc.pin(li, e)
            slot_of[e] = slot
            if not hit:
                misses.append((e, slot))
        self.counters.hits += len(active) - len(misses)
        if misses:
            self._load(li, misses)
        for e in active:
            self._ready(li, slot_of[e])
        return self._w13[li], self._w2[li], slot_of

    def release(self, li: int, active: Sequence[int], slot_of: list[int]) -> None:
        """The held experts' compute is queued: record it for later copies, make them evictable again."""
        for e in active:
            self._done_reading(li, slot_of[e])
            if e not in self._pinned[li]:
                self._alloc.unpin(li, e)

    def _chunk(self, li: int, chunk: list[int]) -> Iterator[Slot]:
        ready: list[tuple[int, int]] = []
        try:
            misses = []
            for e in chunk:
                slot, hit = self._alloc.acquire(li, e)
                self._alloc.pin(li, e)
                ready.append((e, slot))
                if not hit:
                    misses.append((e, slot))
            self.counters.hits += len(chunk) - len(misses)
            if misses:
                self._load(li, misses)
            for e, slot in ready:
                yield e, *self._ready(li, slot)
                self._done_reading(li, slot)
        finally:
            for e, _ in ready:
                self._alloc.unpin(li, e)

    def _load(self, li: int, misses: list[tuple[int, int]]) -> None:
        """Copy the missed experts in, timing the copies as the miss stall.

        On CUDA that is the side stream's copy time (the compute stream waits at most that long for
        them; the waits for the slots' earlier readers are queued before the timing starts).
        """
        self.counters.misses += len(misses)
        self.counters.bytes_copied += len(misses) * self.expert_bytes
        if not self._cuda:
            started = time.perf_counter()
            for e, slot in misses:
                self._copy_in(li, e, slot)
            # host copies: the stall itself
            self.counters.miss_stall_s += time.perf_counter() - started
            return
        for _, slot in misses:
            self._stream.wait_event(self._read[li][slot])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self._stream)
        for e, slot in misses:
            self._copy_in(li, e, slot, wait=False)
        end.record(self._stream)
        self._miss_events.append((start, end))

    def prefetch(self, li: int, experts: Sequence[int]) -> int:
        """Copy `experts` (most wanted first) into unpinned slots ahead of use; returns the copies made.

        Predicted experts already resident become most recently used; at most the unpinned slots
        are used, so a prefetch never evicts another expert of the same prediction.
        """
        pinned = self._pinned[li]
        wanted = [e for e in experts if e not in pinned][: self.slots - len(pinned)]
        cold = [e for e in wanted if self._alloc.slot_of(li, e) < 0]
        # the resident ones become most recently used: the copies below evict others
        for e in wanted:
            if e not in cold:
                self._alloc.acquire(li, e)
        for e in cold:
            slot, _ = self._alloc.acquire(li, e)
            self._copy_in(li, e, slot)
            self.prefetched[li].add(e)
        self.counters.prefetches += len(cold)
        self.counters.prefetch_bytes += len(cold) * self.expert_bytes
        self.counters.bytes_copied += len(cold) * self.expert_bytes
        return len(cold)

    def pin(self, order: list[list[int]], top_k: int) -> list[list[int]]:
        """Pin the first `top_k` experts of each layer's `order` (unpinning the rest), copying them in."""
        if not 0 <= top_k < self.slots:
            raise ValueError(
                f"preload top_k must be in 0..{self.slots - 1} (one slot per layer stays "
                f"free for the other experts), got {top_k}"
            )
        chosen: list[list[int]] = []
        for li, ranked in enumerate(order):
            hottest = ranked[:top_k]
            pinned = self._pinned[li]
            for e in pinned - set(hottest):
                self._alloc.unpin(li, e)
                pinned.discard(e)
            for e in hottest:
                if e in pinned:
                    continue
                slot, hit = self._alloc.acquire(li, e)
                self._alloc.pin(li, e)
                pinned.add(e)
                if not hit:
                    self._copy_in(li, e, slot)
                    self.counters.preload_bytes += self.expert_bytes
            chosen.append(sorted(hottest))
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            self._pending = [[False] * self.slots for _ in self._pending]
        return chosen

    def end_step(self) -> None:
        """After the step synchronised: add the CUDA miss copies' durations to the stall time."""
        if self._cuda and self._miss_events:
            for start, end in self._miss_events:
                self.counters.miss_stall_s += start.elapsed_time(end) / 1000.0
            self._miss_events.clear()

    def resident(self) -> list[int]:
        return [sum(1 for e in slots if e >= 0) for slots in self._in_slot]

    def pinned(self) -> list[list[int]]:
        return [sorted(p) for p in self._pinned]

    def _ready(
        self, li: int, slot: int
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[Int8Linear, Int8Linear]:
        """The slot's weights, once the current stream has waited for a copy still in flight."""
        if self._cuda and self._pending[li][slot]:
            torch.cuda.current_stream(self.device).wait_event(self._copied[li][slot])
            self._pending[li][slot] = False
        if self._s13 is not None:
            return (
                Int8Linear(self._w13[li, slot], self._s13[li, slot], None),
                Int8Linear(self._w2[li, slot], self._s2[li, slot], None),
            )
        return self._w13[li, slot], self._w2[li, slot]

    def _done_reading(self, li: int, slot: int) -> None:
        """The expert's compute is queued: a later copy into this slot waits for it, and only for it."""
        if self._cuda:
            self._read[li][slot].record(torch.cuda.current_stream(self.device))

    def _copy_in(self, li: int, expert: int, slot: int, wait: bool = True) -> None:
        """Copy one expert from host memory into its slot (side stream + events on CUDA).

        `wait` False: the caller has already made the side stream wait for the slot's last reader.
        """
        if self._cuda:
            if wait:
                self._stream.wait_event(self._read[li][slot])
            with torch.cuda.stream(self._stream):
                self._w13[li, slot].copy_(self._host_w13[li][expert], non_blocking=True)
                self._w2[li, slot].copy_(self._host_w2[li][expert], non_blocking=True)
                self._copied[li][slot].record(self._stream)
            self._pending[li][slot] = True
        else:
            self._w13[li, slot].copy_(self._host_w13[li][expert])
            self._w2[li, slot].copy_(self._host_w2[li][expert])
            if self._host_scales is not None:
                self._s13[li, slot].copy_(self._host_scales[li][0][expert])
                self._s2[li, slot].copy_(self._host_scales[li][1][expert])
        self._in_slot[li][slot] = expert


def _host_copy(source: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A contiguous host copy; page-locked only when CUDA can use it."""
    host = source.detach().to(device="cpu", dtype=dtype).contiguous()
    return host.pin_memory() if pin else host
