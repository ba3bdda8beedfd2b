"""Where MoE expert weights live: all resident on the device, or a cache of resident slots.

Each MoE layer's routed experts are stacked as ``w13[E, 2I, H]`` (gate rows, then up rows) and
``w2[E, H, I]``. With ``slots_per_layer`` set, only that many experts per layer sit in device
slots carved from the pool; the rest live in host memory (pinned only when CUDA exists) and are
copied into a slot when a step routes tokens to them. The hot path's ``ExpertAllocator`` decides
which slot an expert gets (LRU over unpinned slots, hit/miss counters) and, with
``workspace_rows`` set, hands out rows of the per-layer MoE workspace carved once at start-up.

Invariants of the partial mode (read before changing `experts`):

* An expert is pinned in the allocator from the moment it is acquired for a step until the
  caller has finished with its weights, so no later acquire in the same chunk evicts it. Chunks
  hold at most ``slots_per_layer - len(preloaded)`` experts, so a free-able slot always exists.
* On CUDA, copies run on a side stream that first waits for all work already queued on the
  current stream (earlier readers of the slot being overwritten); the current stream waits on
  each copy's event before the expert's weights are read. Copies of one chunk therefore overlap
  the compute of the experts ahead of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Weights = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class MoeWorkspace:
    """Per-layer scratch carved once: rows of (token, expert) pairs in expert-major order."""

    rows: torch.Tensor  # [n, H] gathered inputs; reused for the un-sorted contributions
    gate_up: torch.Tensor  # [n, 2I]
    act: torch.Tensor  # [n, I]
    out: torch.Tensor  # [n, H] expert outputs, expert-major


class ExpertStore:
    """Stacked routed-expert weights of every MoE layer, fully or partly resident on `device`."""

    def __init__(
        self,
        weights: Mapping[int, Weights] | Sequence[Weights],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        slots_per_layer: int | None = None,
        pool: Any | None = None,
        workspace_rows: int = 0,
        resident_in_pool: bool = True,  # False: all-resident experts keep the (device) tensors given
    ) -> None:
        items = dict(weights) if isinstance(weights, Mapping) else dict(enumerate(weights))
        if not items:
            raise ValueError("ExpertStore needs the weights of at least one MoE layer")
        self.device = torch.device(device)
        self._pool = pool
        self._resident_in_pool = resident_in_pool
        self.layers = tuple(sorted(items))
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        first_w13, first_w2 = items[self.layers[0]]
        self.num_experts, two_i, self.hidden_size = first_w13.shape
        self.intermediate_size = two_i // 2
        self.dtype = dtype or first_w13.dtype
        for layer, (w13, w2) in items.items():
            _check_shapes(layer, w13, w2, self.num_experts, self.hidden_size, self.intermediate_size)
        if slots_per_layer is not None and slots_per_layer < 1:
            raise ValueError(f"expert slots per layer must be >= 1 (or None for all), got {slots_per_layer}")
        self.partial = slots_per_layer is not None and slots_per_layer < self.num_experts
        self.slots_per_layer = slots_per_layer if self.partial else self.num_experts
        self._cuda = self.device.type == "cuda"
        self.hits = 0
        self.misses = 0
        self.bytes_copied = 0
        self.preload_bytes = 0
        num_layers = len(self.layers)
        self._counts = torch.zeros(num_layers, self.num_experts, dtype=torch.int64, device=self.device)
        self._pinned: list[set[int]] = [set() for _ in range(num_layers)]
        shape13 = (self.num_experts, 2 * self.intermediate_size, self.hidden_size)
        shape2 = (self.num_experts, self.hidden_size, self.intermediate_size)
        from sloserve.hotpath import ExpertAllocator

        if workspace_rows < 0:
            raise ValueError(f"MoE workspace rows must be >= 0, got {workspace_rows}")
        # Level 1 (slots) is used in the partial mode only; level 2 sizes the per-step workspace.
        self._alloc = ExpertAllocator(num_layers, self.num_experts, self.slots_per_layer, workspace_rows)
        self._workspace = None
        if workspace_rows:
            h, i = self.hidden_size, self.intermediate_size
            self._workspace = MoeWorkspace(*(self._carve(f"moe_workspace.{name}", (workspace_rows, width))
                                             for name, width in (("rows", h), ("gate_up", 2 * i), ("act", i),
                                                                 ("out", h))))
        if not self.partial:
            self._w13 = [self._place(f"experts.{layer}.w13", shape13, items[layer][0]) for layer in self.layers]
            self._w2 = [self._place(f"experts.{layer}.w2", shape2, items[layer][1]) for layer in self.layers]
            return
        # Partial residency: host copies + device slots chosen by the hot path's allocator.
        pin = self._cuda and torch.cuda.is_available()
        self._host_w13 = [_host_copy(items[layer][0], self.dtype, pin) for layer in self.layers]
        self._host_w2 = [_host_copy(items[layer][1], self.dtype, pin) for layer in self.layers]
        slots = self.slots_per_layer
        self._slot_w13 = self._carve("expert_slots.w13", (num_layers, slots, *shape13[1:]))
        self._slot_w2 = self._carve("expert_slots.w2", (num_layers, slots, *shape2[1:]))
        self._expert_bytes = (shape13[1] * shape13[2] + shape2[1] * shape2[2]) * self._slot_w13.element_size()
        if self._cuda:
            self._stream = torch.cuda.Stream(device=self.device)
            self._events = [[torch.cuda.Event() for _ in range(slots)] for _ in range(num_layers)]

    # -- placement -------------------------------------------------------------------------

    def _carve(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if self._pool is not None:
            return self._pool.carve(name, shape, self.dtype)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _place(self, name: str, shape: tuple[int, ...], source: torch.Tensor) -> torch.Tensor:
        if self._pool is None or not self._resident_in_pool:
            return source.to(device=self.device, dtype=self.dtype).contiguous()
        out = self._pool.carve(name, shape, self.dtype)
        out.copy_(source)
        return out

    @staticmethod
    def workspace_bytes(rows: int, hidden: int, intermediate: int, dtype: torch.dtype) -> int:
        """Pool bytes the workspace of `rows` (token, expert) pairs takes (for sizing the pool)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return rows * (2 * hidden + 3 * intermediate) * itemsize + 4 * 256

    # -- the per-step interface ---------------------------------------------------------------

    def reserve_workspace(self, rows: int) -> MoeWorkspace | None:
        """Views of `rows` workspace rows for one MoE layer, or None (no workspace, or too many rows)."""
        if self._workspace is None:
            return None
        offset = self._alloc.reserve_rows(rows)
        if offset is None:
            return None
        ws = self._workspace
        return MoeWorkspace(*(t[offset : offset + rows] for t in (ws.rows, ws.gate_up, ws.act, ws.out)))

    def release_workspace(self) -> None:
        """The layer is done with its workspace rows."""
        if self._workspace is not None:
            self._alloc.release_rows()

    def layer_index(self, layer: int) -> int:
        """Dense index of a model layer among the MoE layers; ValueError for a dense layer."""
        try:
            return self._index[layer]
        except KeyError:
            raise ValueError(f"layer {layer} has no routed experts (MoE layers: {list(self.layers)})") from None

    def record_counts(self, layer: int, counts: torch.Tensor) -> None:
        """Add one step's tokens-per-expert counts [E] to the routing statistics (no host sync)."""
        self._counts[self.layer_index(layer)] += counts

    def experts(self, layer: int, active: Sequence[int]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield (expert, w13[2I, H], w2[H, I]) for each expert in `active`, making it resident first.

        The weights a step receives stay valid until the generator advances past them.
        """
        li = self.layer_index(layer)
        if not self.partial:
            self.hits += len(active)
            for e in active:
                yield e, self._w13[li][e], self._w2[li][e]
            return
        pinned = self._pinned[li]
        # Resident experts first: they are used before the misses of this step can evict them
        # (ascending order would make LRU evict exactly the experts needed next step).
        cold = sorted((e for e in active if e not in pinned), key=lambda e: self._alloc.slot_of(li, e) < 0)
        for e in active:
            if e in pinned:
                slot, hit = self._alloc.acquire(li, e)
                assert hit, "a preloaded expert must stay resident"
                self.hits += 1
                yield e, self._slot_w13[li, slot], self._slot_w2[li, slot]
        capacity = self.slots_per_layer - len(pinned)
        for start in range(0, len(cold), capacity):
            yield from self._chunk(li, cold[start : start + capacity])

    def _chunk(self, li: int, chunk: list[int]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        ready: list[tuple[int, int, bool]] = []
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            for e in chunk:
                slot, hit = self._alloc.acquire(li, e)
                self._alloc.pin(li, e)
                ready.append((e, slot, hit))
                if hit:
                    self.hits += 1
                else:
                    self.misses += 1
                    self._copy_in(li, e, slot)
            for e, slot, hit in ready:
                if self._cuda and not hit:
                    torch.cuda.current_stream(self.device).wait_event(self._events[li][slot])
                yield e, self._slot_w13[li, slot], self._slot_w2[li, slot]
        finally:
            for e, _, _ in ready:
                self._alloc.unpin(li, e)

    def _copy_in(self, li: int, expert: int, slot: int) -> None:
        """Copy one expert from host memory into its slot (side stream + event on CUDA)."""
        if self._cuda:
            with torch.cuda.stream(self._stream):
                self._slot_w13[li, slot].copy_(self._host_w13[li][expert], non_blocking=True)
                self._slot_w2[li, slot].copy_(self._host_w2[li][expert], non_blocking=True)
                self._events[li][slot].record(self._stream)
        else:
            self._slot_w13[li, slot].copy_(self._host_w13[li][expert])
            self._slot_w2[li, slot].copy_(self._host_w2[li][expert])
        self.bytes_copied += self._expert_bytes

    # -- statistics --------------------------------------------------------------------------

    def routing_counts(self) -> torch.Tensor:
        """Tokens routed to each expert so far, [num MoE layers, E] (a host copy)."""
        return self._counts.cpu()

    def preload(self, top_k: int) -> list[list[int]]:
        """Make each layer's `top_k` most-routed experts resident and pin them; returns them per layer."""
        if not self.partial:
            return [sorted(range(self.num_experts)) for _ in self.layers]
        if not 0 <= top_k < self.slots_per_layer:
            raise ValueError(
                f"preload top_k must be in 0..{self.slots_per_layer - 1} (one slot per layer stays "
                f"free for the other experts), got {top_k}"
            )
        counts = self.routing_counts()
        chosen: list[list[int]] = []
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for li in range(len(self.layers)):
            for e in self._pinned[li]:
                self._alloc.unpin(li, e)
            self._pinned[li].clear()
            # NOTE: stable order: most tokens first, then the lower expert id.
            hottest = sorted(range(self.num_experts), key=lambda e, c=counts[li]: (-int(c[e]), e))[:top_k]
            for e in hottest:
                slot, hit = self._alloc.acquire(li, e)
                self._alloc.pin(li, e)
                self._pinned[li].add(e)
                if not hit:
                    self._copy_in(li, e, slot)
                    self.bytes_copied -= self._expert_bytes
                    self.preload_bytes += self._expert_bytes
            chosen.append(sorted(hottest))
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return chosen

    def stats(self) -> dict[str, Any]:
        """Hits, misses, hit rate and bytes copied by steps (preloads counted apart)."""
        total = self.hits + self.misses
        return {
            "resident": "partial" if self.partial else "all",
            "moe_layers": len(self.layers),
            "num_experts": self.num_experts,
            "slots_per_layer": self.slots_per_layer,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / total if total else 1.0,
            "bytes_copied": self.bytes_copied,
            "preload_bytes": self.preload_bytes,
            "host_pinned": self.partial and self._host_w13[0].is_pinned(),
        }

    def reset_stats(self) -> None:
        """Zero the hit/miss/byte counters (routing statistics are kept)."""
        self.hits = self.misses = self.bytes_copied = self.preload_bytes = 0


def _check_shapes(layer: int, w13: torch.Tensor, w2: torch.Tensor, e: int, h: int, i: int) -> None:
    if tuple(w13.shape) != (e, 2 * i, h) or tuple(w2.shape) != (e, h, i):
        raise ValueError(
            f"MoE layer {layer}: expected w13 {(e, 2 * i, h)} and w2 {(e, h, i)} "
            f"(experts stacked, gate rows then up rows), got {tuple(w13.shape)} and {tuple(w2.shape)}"
        )


def _host_copy(source: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A contiguous host copy; page-locked only when CUDA can use it."""
    host = source.detach().to(device="cpu", dtype=dtype).contiguous()
    return host.pin_memory() if pin else host
