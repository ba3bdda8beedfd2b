"""Where MoE expert weights live: all resident on the device, or a cache of resident slots.

Each MoE layer's routed experts are stacked as ``w13[E, 2I, H]`` (gate rows, then up rows) and
``w2[E, H, I]``. With ``slots_per_layer`` set below E, only that many experts per layer sit in
device slots carved from the pool; the rest live in host memory and are copied into a slot when
a step routes tokens to them or a prediction names them (`ExpertSlots`, memory/expert_slots.py,
holds the invariants). With ``workspace_rows`` set, the hot path's `ExpertAllocator` also hands
out rows of the per-layer MoE workspace carved once at start-up.

A step (`begin_step` ... `end_step`, driven by the runner) may carry a prediction: the experts
each MoE layer will likely route to. Entering layer i (`before_layer`) prefetches layer i+1's
predicted experts. Routing statistics (memory/expert_stats.py) stay on the device; pinning the
hottest (`pin_hottest`: by the EMA of each expert's share; `preload`: by cumulative counts)
reads them once.

With ``quantization="int8"`` (a CPU only) each expert is held as int8 rows with a float32 scale
per row (Int8Linear's layout, quantized per expert as the store places it): resident stacks, host
copies and slots alike; `experts` then yields Int8Linear pairs, whose products pick W8A8 or W8A16
by row count as a dense projection's do.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from sloserve.layers.quant import Int8Linear
from sloserve.memory.expert_slots import ExpertSlots
from sloserve.memory.expert_stats import ExpertCounters, RoutingStats

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
        max_seqs: int = 0,  # sequences per step whose routing is captured for the next step's prediction
        grouped: bool
        | None = None,  # two grouped GEMMs per layer (None: on CUDA when torch has them)
        quantization: str = "none",  # "int8": int8 rows and per-row scales (a CPU only)
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
            _check_shapes(
                layer, w13, w2, self.num_experts, self.hidden_size, self.intermediate_size
            )
        if quantization not in ("none", "int8"):
            raise ValueError(f"expert quantization must be none or int8, got {quantization!r}")
        self.int8 = quantization == "int8"
        if self.int8 and self.device.type != "cpu":
            raise ValueError(f"int8 experts run on a CPU only, not on {self.device.type}")
        # the experts' own dtype (the workspace keeps the activations' dtype, self.dtype)
        self.weight_dtype = torch.int8 if self.int8 else self.dtype
        scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.int8:
            for layer, (w13, w2) in items.items():
                (q13, s13), (q2, s2) = quantize_experts(w13), quantize_experts(w2)
                items[layer], scales[layer] = (q13, q2), (s13, s2)
        if slots_per_layer is not None and slots_per_layer < 1:
            raise ValueError(
                f"expert slots per layer must be >= 1 (or None for all), got {slots_per_layer}"
            )
        self.partial = slots_per_layer is not None and slots_per_layer < self.num_experts
        self.slots_per_layer = slots_per_layer if self.partial else self.num_experts
        num_layers = len(self.layers)
        self.counters = ExpertCounters()
        self.routing = RoutingStats(num_layers, self.num_experts, self.device, max_seqs)
        self._predicted: list[list[int]] = [[] for _ in range(num_layers)]  # this step's, per layer
        shape13 = (self.num_experts, 2 * self.intermediate_size, self.hidden_size)
        shape2 = (self.num_experts, self.hidden_size, self.intermediate_size)
        from sloserve.hotpath import ExpertAllocator

        if workspace_rows < 0:
            raise ValueError(f"MoE workspace rows must be >= 0, got {workspace_rows}")
        # Level 1 (slots) is used in the partial mode only; level 2 sizes the per-step workspace.
        self._alloc = ExpertAllocator(
            num_layers, self.num_experts, self.slots_per_layer, workspace_rows
        )
        self._workspace = None
        if workspace_rows:
            h, i = self.hidden_size, self.intermediate_size
            self._workspace = MoeWorkspace(
                *(
                    self._carve(f"moe_workspace.{name}", (workspace_rows, width))
                    for name, width in (("rows", h), ("gate_up", 2 * i), ("act", i), ("out", h))
                )
            )
        self._slots: ExpertSlots | None = None
        self._s13 = self._s2 = None
        if not self.partial:
            wd = self.weight_dtype
            self._w13 = [
                self._place(f"experts.{layer}.w13", shape13, items[layer][0], wd)
                for layer in self.layers
            ]
            self._w2 = [
                self._place(f"experts.{layer}.w2", shape2, items[layer][1], wd)
                for layer in self.layers
            ]
            if self.int8:
                f32 = torch.float32
                self._s13 = [
                    self._place(f"experts.{layer}.s13", shape13[:2], scales[layer][0], f32)
                    for layer in self.layers
                ]
                self._s2 = [
                    self._place(f"experts.{layer}.s2", shape2[:2], scales[layer][1], f32)
                    for layer in self.layers
                ]
        else:  # partial residency: host copies + device slots chosen by the hot path's allocator
            self._slots = ExpertSlots(
                [items[layer] for layer in self.layers],
                self.slots_per_layer,
                self._alloc,
                self.counters,
                self._carve,
                self.device,
                self.weight_dtype,
                [scales[layer] for layer in self.layers] if self.int8 else None,
            )
        self.grouped = (
            self._grouped_works()
            if grouped is None and self.device.type == "cuda"
            else bool(grouped)
        )
        if self.grouped and self.int8:
            raise ValueError("int8 experts run per expert, not in grouped GEMMs")
        # All resident + grouped GEMMs: the layers never learn their active experts on the host, so
        # uses are counted on the device and folded into the hits when the step ends.
        self._device_uses = None
        if self.grouped and self._slots is None:
            self._device_uses = torch.zeros((), dtype=torch.int64, device=self.device)

    # -- placement -------------------------------------------------------------------------

    def _carve(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        dtype = dtype or self.dtype
        if self._pool is not None:
            return self._pool.carve(name, shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _place(
        self, name: str, shape: tuple[int, ...], source: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        if self._pool is None or not self._resident_in_pool:
            return source.to(device=self.device, dtype=dtype).contiguous()
        out = self._pool.carve(name, shape, dtype)
        out.copy_(source)
        return out

    def _grouped_works(self) -> bool:
        """Whether torch's grouped GEMM runs here, without a host sync, on both of a layer's
        projections laid out like ours (a tiny probe under CUDA's sync-debug mode).

        Two ways it fails on a CUDA machine (seen on the first GPU, docs/design/moe-offload.md):
        torch's kernel wants every stride a multiple of 16 bytes, which an intermediate size of 12
        in bf16 is not (24 bytes a row of the activations); and where it has no kernel for the
        dtype (fp32) torch loops over the groups on the host, reading the offsets back each
        layer. Either way the per-expert path serves instead (one host read per layer).
        """
        if not hasattr(torch, "_grouped_mm"):
            return False
        h, i = self.hidden_size, self.intermediate_size
        offs = torch.tensor([1, 2], dtype=torch.int32, device=self.device)
        w13 = torch.zeros(2, 2 * i, h, dtype=self.dtype, device=self.device)
        w2 = torch.zeros(2, h, i, dtype=self.dtype, device=self.device)
        x = torch.zeros(2, h, dtype=self.dtype, device=self.device)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            gate, up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            torch._grouped_mm(gate * up, w2.transpose(1, 2), offs=offs)
        except (RuntimeError, NotImplementedError):
            return False
        finally:
            torch.cuda.set_sync_debug_mode(before)
        return True

    def stacked(self, layer: int, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All-resident weights of a layer, w13 [E, 2I, H] and w2 [E, H, I], for grouped GEMMs over
        `counts` [E] tokens per expert (its active experts are counted as hits on the device)."""
        if self._slots is not None:
            raise ValueError(
                "partial residency has no stack of every expert; hold() the active ones"
            )
        li = self.layer_index(layer)
        if self._device_uses is not None:
            self._device_uses += (counts > 0).sum()
        return self._w13[li], self._w2[li]

    def hold(
        self, layer: int, active: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
        """Partial residency: every active expert resident at once, (slot weights, slot per expert); or None."""
        li = self.layer_index(layer)
        held = self._slots.hold(li, active) if self._slots is not None else None
        if held is not None:
            self._score(li, active)
        return held

    def release(self, layer: int, active: Sequence[int], slot_of: list[int]) -> None:
        """End a hold() once the layer's compute is queued."""
        self._slots.release(self.layer_index(layer), active, slot_of)

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
        return MoeWorkspace(
            *(t[offset : offset + rows] for t in (ws.rows, ws.gate_up, ws.act, ws.out))
        )

    def release_workspace(self) -> None:
        """The layer is done with its workspace rows."""
        if self._workspace is not None:
            self._alloc.release_rows()

    def layer_index(self, layer: int) -> int:
        """Dense index of a model layer among the MoE layers; ValueError for a dense layer."""
        try:
            return self._index[layer]
        except KeyError:
            raise ValueError(
                f"layer {layer} has no routed experts (MoE layers: {list(self.layers)})"
            ) from None

    def record_routing(self, layer: int, ids: torch.Tensor, counts: torch.Tensor) -> None:
        """One layer's routing: expert ids [T, k] and tokens per expert [E] into the statistics (no host sync)."""
        li = self.layer_index(layer)
        self.routing.record(li, counts, ids.numel())
        self.routing.capture(li, ids)

    def record_counts(self, layer: int, counts: torch.Tensor) -> None:
        """Add one step's tokens-per-expert counts [E] to the cumulative statistics (no host sync)."""
        self.routing.counts[self.layer_index(layer)] += counts

    # -- steps and prefetching ---------------------------------------------------------------

    def begin_step(
        self, predicted: list[list[int]] | None = None, capture_rows: torch.Tensor | None = None
    ) -> None:
        """Start a step: each MoE layer's predicted experts (dense index order) and the rows to capture.

        The first MoE layer's prediction is prefetched now; layer i+1's when layer i begins.
        """
        for li in range(len(self.layers)):
            self._predicted[li] = list(predicted[li]) if predicted else []
            if self._slots is not None:
                self._slots.prefetched[li].clear()
        self.routing.capture_rows(capture_rows)
        if self._slots is not None and self._predicted[0]:
            self._slots.prefetch(0, self._predicted[0])

    def before_layer(self, layer: int) -> None:
        """Layer `layer` starts: prefetch the next MoE layer's predicted experts (they overlap its compute)."""
        li = self.layer_index(layer) + 1
        if self._slots is not None and li < len(self.layers) and self._predicted[li]:
            self._slots.prefetch(li, self._predicted[li])

    def end_step(self) -> list[list[list[int]]] | None:
        """Close the step's counters; returns the captured routing [sequence][layer][k] (one device read)."""
        if self._slots is not None:
            self._slots.end_step()
        if self._device_uses is not None:
            # after sampling: the stream has synchronised
            self.counters.hits += int(self._device_uses)
            self._device_uses.zero_()
        self.counters.end_step()
        captured = self.routing.captured()
        self.routing.capture_rows(None)
        return captured

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Copy `experts` of `layer` (most wanted first) into unpinned slots ahead of use; returns copies made."""
        li = self.layer_index(layer)
        return 0 if self._slots is None else self._slots.prefetch(li, experts)

    def experts(
        self, layer: int, active: Sequence[int]
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield (expert, w13[2I, H], w2[H, I]) for each expert in `active`, making it resident first.

        The weights a step receives stay valid until the generator advances past them.
        """
        li = self.layer_index(layer)
        self._score(li, active)
        if self._slots is not None:
            yield from self._slots.use(li, active)
            return
        self.counters.hits += len(active)
        for e in active:
            if self._s13 is not None:
                yield (
                    e,
                    Int8Linear(self._w13[li][e], self._s13[li][e], None),
                    Int8Linear(self._w2[li][e], self._s2[li][e], None),
                )
            else:
                yield e, self._w13[li][e], self._w2[li][e]

    def _score(self, li: int, active: Sequence[int]) -> None:
        """Count how the step's prediction and prefetches for this layer fared."""
        predicted = self._predicted[li]
        if predicted:
            named = set(predicted)
            self.counters.predicted += sum(1 for e in active if e in named)
            self.counters.predicted_active += len(active)
        prefetched = self._slots.prefetched[li] if self._slots is not None else None
        if prefetched:
            self.counters.prefetches_used += sum(1 for e in active if e in prefetched)
            prefetched.clear()

    # -- residency and statistics -------------------------------------------------------------

    def routing_counts(self) -> torch.Tensor:
        """Tokens routed to each expert so far, [num MoE layers, E] (a host copy)."""
        return self.routing.counts.cpu()

    def preload(self, top_k: int) -> list[list[int]]:
        """Make each layer's `top_k` most-routed experts (cumulative counts) resident and pin them."""
        counts = self.routing_counts().tolist()
        return self._pin(
            [sorted(range(self.num_experts), key=lambda e, c=row: (-c[e], e)) for row in counts],
            top_k,
        )

    def pin_hottest(self, top_k: int) -> list[list[int]]:
        """Pin each layer's `top_k` experts with the largest EMA routing share (re-pinning as it drifts)."""
        return self._pin(self.routing.hottest(self.num_experts), top_k)

    def _pin(self, order: list[list[int]], top_k: int) -> list[list[int]]:
        if self._slots is None:
            return [sorted(range(self.num_experts)) for _ in self.layers]
        return self._slots.pin(order, top_k)

    def resident(self) -> list[int]:
        """Experts whose weights sit on the device, per MoE layer."""
        return (
            [self.num_experts] * len(self.layers) if self._slots is None else self._slots.resident()
        )

    def pinned(self) -> list[list[int]]:
        """Pinned (preloaded) experts per MoE layer."""
        return [[] for _ in self.layers] if self._slots is None else self._slots.pinned()

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert as held: w13 and w2 (and an int8 one's scale per row)."""
        h, i = self.hidden_size, self.intermediate_size
        scales = (2 * i + h) * 4 if self.int8 else 0
        return 3 * i * h * self.weight_dtype.itemsize + scales

    @property
    def device_bytes(self) -> int:
        """Device bytes the experts take: every expert when all resident, else the slots."""
        return len(self.layers) * self.slots_per_layer * self.expert_bytes

    @property
    def hits(self) -> int:
        return self.counters.hits

    @property
    def misses(self) -> int:
        return self.counters.misses

    @property
    def bytes_copied(self) -> int:
        return self.counters.bytes_copied

    @property
    def preload_bytes(self) -> int:
        return self.counters.preload_bytes

    def stats(self) -> dict[str, Any]:
        """Residency, hits, misses, prefetch and prediction outcomes, bytes copied (preloads apart), stalls."""
        return {
            "resident": "partial" if self.partial else "all",
            "moe_layers": len(self.layers),
            "num_experts": self.num_experts,
            "slots_per_layer": self.slots_per_layer,
            "resident_per_layer": self.resident(),
            "pinned_per_layer": [len(p) for p in self.pinned()],
            "device_bytes": self.device_bytes,
            "host_pinned": self._slots is not None and self._slots.host_pinned,
            **self.counters.as_dict(),
        }

    def reset_stats(self, routing: bool = False) -> None:
        """Zero the counters (and with `routing`, the EMA too; cumulative counts are kept)."""
        self.counters.reset()
        if self._device_uses is not None:
            self._device_uses.zero_()
        if routing:
            self.routing.reset()


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked experts [E, R, C] as int8 [E, R, C] and a float32 scale per row [E, R] (each
    expert's rows quantized as Int8Linear quantizes a weight)."""
    e, r, c = w.shape
    proj = Int8Linear.quantize(w.reshape(e * r, c))
    return proj.qweight.view(e, r, c), proj.scale.view(e, r)


def _check_shapes(layer: int, w13: torch.Tensor, w2: torch.Tensor, e: int, h: int, i: int) -> None:
    if tuple(w13.shape) != (e, 2 * i, h) or tuple(w2.shape) != (e, h, i):
        raise ValueError(
            f"MoE layer {layer}: expected w13 {(e, 2 * i, h)} and w2 {(e, h, i)} "
            f"(experts stacked, gate rows then up rows), got {tuple(w13.shape)} and {tuple(w2.shape)}"
        )
