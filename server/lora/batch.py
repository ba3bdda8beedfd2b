"""The adapters of one step: which rows each applies to, and the grouped deltas it adds."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sloserve.lora.adapter import LoraAdapter


@dataclass(slots=True)
class LoraBatch:
    """Row groups of a flat step, one per distinct adapter (rows without an adapter are in none).

    The base projection runs once over every row; each group then adds its adapter's low-rank
    delta to its own rows only (shrink, then expand), the way MoE groups tokens by expert.
    """

    # (adapter, its rows: a slice where they are side by side, else [n] int64)
    groups: list[tuple[LoraAdapter, slice | torch.Tensor]]

    def apply(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x) with each group's delta added on its rows."""
        for adapter, rows in self.groups:
            delta = adapter.layers.get(layer, {}).get(name)
            if delta is None:
                continue
            if isinstance(rows, slice):
                # views: the delta lands on y in place
                delta.add_to(y[rows], x[rows])
                continue
            part = y.index_select(0, rows)
            delta.add_to(part, x.index_select(0, rows))
            y.index_copy_(0, rows, part)
        return y
