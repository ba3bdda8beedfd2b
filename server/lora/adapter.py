"""One loaded adapter: per layer and fused projection, the low-rank factors that add its delta."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class LoraDelta:
    """The delta of one fused projection (qkv, o, gate_up or down) of one layer.

    y[:, lo:hi] += (x @ a[r0:r1].T) @ b.T for each (lo, hi, r0, r1, b) in `parts`: `a` stacks the
    shrink factors of every targeted part of the fused projection ([sum of ranks, in]), so the
    shrink is one matmul; each part's expand lands on its own output rows. The scale (alpha / r,
    or alpha / sqrt(r) under rsLoRA) is folded into each `b` at load.
    """

    a: torch.Tensor  # [sum r, in]
    parts: list[tuple[int, int, int, int, torch.Tensor]]  # (lo, hi, r0, r1, b [hi - lo, r1 - r0])

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += this delta of x, in place (x [T, in], y [T, out])."""
        low = x @ self.a.T  # [T, sum r]
        for lo, hi, r0, r1, b in self.parts:
            y[:, lo:hi].addmm_(low[:, r0:r1], b.T)


@dataclass(slots=True)
class LoraAdapter:
    """An adapter as the runner holds it: plain tensors in the model's dtype and device."""

    name: str
    path: str
    rank: int
    # layer -> projection name (qkv, o, gate_up, down) -> its delta
    layers: dict[int, dict[str, LoraDelta]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes its factors take."""
        total = 0
        for deltas in self.layers.values():
            for d in deltas.values():
                total += d.a.nbytes + sum(p[4].nbytes for p in d.parts)
        return total
