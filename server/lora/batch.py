"""The adapters of one step: which rows each applies to, and the grouped deltas it adds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
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
            if delta is not None:
                _on_rows(y, rows, lambda part, r=rows, d=delta: d.add_to(part, x[r]))
        return y

    def embed(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h (the base embedding of ids) with each group's own embedding and delta on its rows."""
        for adapter, rows in self.groups:
            if not adapter.changes_embedding:
                continue

            def update(part: torch.Tensor, rows=rows, adapter=adapter) -> None:
                tokens = ids[rows]
                if adapter.embed_weight is not None:
                    part.copy_(F.embedding(tokens, adapter.embed_weight))
                if adapter.embed is not None:
                    adapter.embed.add_to(part, tokens)

            _on_rows(h, rows, update)
        return h

    def head(
        self,
        h: torch.Tensor,  # [S', H], the sampled rows after the final norm
        sample_idx: torch.Tensor,  # [S'] int64, which step rows they are
        base: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:  # [S', V]
        """The logits of the sampled rows: `base(h)`, then each group's own LM head and delta
        on the sampled rows that are its."""
        logits = base(h)
        for adapter, rows in self.groups:
            if not adapter.changes_head:
                continue
            if isinstance(rows, slice):
                mine = (sample_idx >= rows.start) & (sample_idx < rows.stop)
            else:
                mine = torch.isin(sample_idx, rows)
            at = mine.nonzero().squeeze(1)
            if at.numel() == 0:
                continue
            x = h.index_select(0, at)
            part = logits.index_select(0, at)
            if adapter.head_weight is not None:
                part = F.linear(x, adapter.head_weight).to(part.dtype)
            if adapter.head is not None:
                adapter.head.add_to(part, x)
            logits.index_copy_(0, at, part)
        return logits


def _on_rows(
    y: torch.Tensor, rows: slice | torch.Tensor, update: Callable[[torch.Tensor], None]
) -> None:
    """update(y's rows `rows`) in place: a view where they are side by side, else a gathered copy
    written back."""
    if isinstance(rows, slice):
        update(y[rows])
        return
    part = y.index_select(0, rows)
    update(part)
    y.index_copy_(0, rows, part)
