"""What the expert cache measures: routing statistics on the device, and counters on the host.

`RoutingStats` keeps, per MoE layer, the tokens routed to each expert (cumulative), an
exponential moving average of each expert's share of the layer's (token, expert) pairs, and the
routing of each sequence's last token in the current step (for the next step's prediction).
Every update is a device operation: nothing here reads the device back except `hottest()` and
`captured()`, which the caller runs once per many steps and once per step respectively.

`ExpertCounters` are plain integers and floats the store bumps as it serves experts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields

import torch

EMA_DECAY = 0.95  # per step: the statistics follow roughly the last 20 steps' routing
RECENT_STEPS = 64  # bytes per step are averaged over this many recent steps


class RoutingStats:
    """Per-layer routing counts, EMA shares and this step's per-sequence routing, all on `device`."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        device: torch.device,
        max_seqs: int = 0,
        decay: float = EMA_DECAY,
    ) -> None:
        self.num_layers, self.num_experts, self.decay = num_layers, num_experts, decay
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.ema = torch.zeros(num_layers, num_experts, dtype=torch.float32, device=device)
        self.max_seqs = max_seqs
        # [L, max_seqs, k] int64, made on the first capture
        self._capture: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None  # [S] int64: each captured sequence's last token row
        self._captured_layers: set[int] = set()

    def record(self, li: int, counts: torch.Tensor, pairs: int) -> None:
        """Add one layer's tokens-per-expert counts [E] of `pairs` (token, expert) pairs (no host sync)."""
        self.counts[li] += counts
        if pairs:
            self.ema[li].mul_(self.decay).add_(counts, alpha=(1.0 - self.decay) / pairs)

    def capture_rows(self, rows: torch.Tensor | None) -> None:
        """The rows whose routing this step keeps (each sequence's last token), or None: keep none."""
        if rows is not None and rows.numel() > self.max_seqs:
            raise ValueError(
                f"cannot capture the routing of {rows.numel()} sequences (room for {self.max_seqs})"
            )
        self._rows = rows if rows is not None and rows.numel() else None
        self._captured_layers.clear()

    def capture(self, li: int, ids: torch.Tensor) -> None:
        """Keep the expert ids [T, k] of this step's captured rows at layer `li` (no host sync)."""
        if self._rows is None:
            return
        if self._capture is None or self._capture.shape[2] != ids.shape[1]:
            self._capture = torch.zeros(
                self.num_layers, self.max_seqs, ids.shape[1], dtype=torch.int64, device=ids.device
            )
        n = self._rows.numel()
        torch.index_select(ids, 0, self._rows, out=self._capture[li, :n])
        self._captured_layers.add(li)

    def captured(self) -> list[list[list[int]]] | None:
        """This step's capture as host lists [sequence][layer][k] (one device read), or None."""
        if (
            self._rows is None
            or self._capture is None
            or len(self._captured_layers) != self.num_layers
        ):
            return None
        n = self._rows.numel()
        per_layer = self._capture[:, :n].tolist()  # [L][S][k]
        return [[per_layer[li][s] for li in range(self.num_layers)] for s in range(n)]

    def hottest(self, n: int) -> list[list[int]]:
        """Each layer's `n` experts with the largest EMA share (ties: the lower id), one device read."""
        ema = self.ema.tolist()
        return [
            sorted(range(self.num_experts), key=lambda e, row=row: (-row[e], e))[:n] for row in ema
        ]

    def reset(self) -> None:
        """Forget the EMA (e.g. after synthetic warm-up steps); cumulative counts stay."""
        self.ema.zero_()


@dataclass(slots=True)
class ExpertCounters:
    """Hits, misses, prefetch and prediction outcomes, bytes copied and time stalled on misses."""

    hits: int = 0
    misses: int = 0
    prefetches: int = 0  # experts copied in ahead of their layer
    prefetches_used: int = 0  # of those, the ones their layer then routed tokens to
    predicted: int = 0  # (layer, expert) uses the prediction named, over steps that had one
    predicted_active: int = 0  # (layer, expert) uses in the layers that had a prediction
    bytes_copied: int = 0  # by misses and prefetches
    prefetch_bytes: int = 0
    preload_bytes: int = 0  # pinning the hottest experts
    miss_stall_s: float = 0.0
    steps: int = 0
    _step_bytes: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))

    def reset(self) -> None:
        """Zero every counter in place (the stores that share this object see it)."""
        fresh = ExpertCounters()
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))

    def end_step(self) -> None:
        total = self.bytes_copied + self.preload_bytes
        self.recent.append(total - self._step_bytes)
        self._step_bytes = total
        self.steps += 1

    def as_dict(self) -> dict:
        uses = self.hits + self.misses
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / uses if uses else 1.0,
            "prefetches": self.prefetches,
            "prefetches_used": self.prefetches_used,
            "prefetch_accuracy": self.prefetches_used / self.prefetches if self.prefetches else 0.0,
            "prediction_recall": self.predicted / self.predicted_active
            if self.predicted_active
            else 0.0,
            "bytes_copied": self.bytes_copied,
            "prefetch_bytes": self.prefetch_bytes,
            "preload_bytes": self.preload_bytes,
            "bytes_per_step": sum(self.recent) / len(self.recent) if self.recent else 0.0,
            "miss_stall_s": self.miss_stall_s,
            "steps": self.steps,
        }
