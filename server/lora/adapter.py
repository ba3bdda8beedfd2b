"""One loaded adapter: per layer and fused projection, the low-rank factors that add its delta,
and what it changes of the embedding and the LM head."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class LoraDelta:
    """The delta of one fused projection (qkv, o, gate_up or down) of one layer, or of the LM head.

    y[:, lo:hi] += (x @ a[r0:r1].T) @ b.T for each (lo, hi, r0, r1, b) in `parts`: `a` stacks the
    shrink factors of every targeted part of the fused projection ([sum of ranks, in]), so the
    shrink is one matmul; each part's expand lands on its own output rows. The scale (alpha / r,
    or alpha / sqrt(r) under rsLoRA) is folded into each `b` at load.
    """

    a: torch.Tensor  # [sum r, in]
    parts: list[tuple[int, int, int, int, torch.Tensor]]  # (lo, hi, r0, r1, b [hi - lo, r1 - r0])

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + sum(p[4].nbytes for p in self.parts)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += this delta of x, in place (x [T, in], y [T, out])."""
        low = x @ self.a.T  # [T, sum r]
        for lo, hi, r0, r1, b in self.parts:
            y[:, lo:hi].addmm_(low[:, r0:r1], b.T)


@dataclass(slots=True)
class EmbeddingDelta:
    """LoRA on the embedding (PEFT's lora_embedding_A/B): row t gains rows[t] @ expand.

    PEFT computes embedding(ids, A.T) @ B.T * scale; `rows` is A.T ([V, r], one row a token) and
    `expand` is (B * scale).T ([r, H]), so a step reads only its tokens' rows.
    """

    rows: torch.Tensor  # [V, r]
    expand: torch.Tensor  # [r, H]

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.expand.nbytes

    def add_to(self, h: torch.Tensor, ids: torch.Tensor) -> None:
        """h += this delta of the tokens `ids`, in place (h [T, H], ids [T])."""
        h.addmm_(self.rows.index_select(0, ids), self.expand)


@dataclass(slots=True)
class LoraAdapter:
    """An adapter as the runner holds it: plain tensors in the model's dtype and device.

    `embed_weight` / `head_weight` replace the base model's matrix for this adapter's rows
    (PEFT's modules_to_save, or a base layer saved with the adapter that differs from the
    model's); `embed` / `head` add LoRA deltas on top of whichever matrix applies.
    """

    name: str
    path: str
    rank: int
    # layer -> projection name (qkv, o, gate_up, down) -> its delta
    layers: dict[int, dict[str, LoraDelta]] = field(default_factory=dict)
    embed: EmbeddingDelta | None = None
    head: LoraDelta | None = None
    embed_weight: torch.Tensor | None = None  # [V, H]
    head_weight: torch.Tensor | None = None  # [V, H]

    @property
    def nbytes(self) -> int:
        """Bytes its tensors take."""
        total = sum(d.nbytes for deltas in self.layers.values() for d in deltas.values())
        for part in (self.embed, self.head):
            total += 0 if part is None else part.nbytes
        for weight in (self.embed_weight, self.head_weight):
            total += 0 if weight is None else weight.nbytes
        return total

    @property
    def changes_embedding(self) -> bool:
        return self.embed is not None or self.embed_weight is not None

    @property
    def changes_head(self) -> bool:
        return self.head is not None or self.head_weight is not None
