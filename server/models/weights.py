"""Fused weight containers handed from the loader to the model (projection objects, no nn.Module)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from sloserve.layers.linear import Linear
from sloserve.layers.quant import Int8Linear

# The dense projections of a layer, the ones a CPU runs on oneDNN (build.prepare_projections).
DENSE_PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer. A MoE layer has a router (and, for Qwen2-MoE, a shared expert in gate_up/down)."""

    ln1: torch.Tensor  # [H]
    ln2: torch.Tensor  # [H]
    qkv: Linear  # [(Hq + 2 Hkv) * D, H]
    o: Linear  # [H, Hq * D]
    gate_up: Linear | None = None  # [2I, H] dense MLP or shared expert: gate rows, then up rows
    down: Linear | None = None  # [H, I]
    router: Linear | None = None  # [E, H]
    shared_gate: Linear | None = None  # [1, H]

    def projections(self) -> Iterator[Linear]:
        """Every projection this layer holds."""
        for name in (*DENSE_PROJECTIONS, "router", "shared_gate"):
            proj = getattr(self, name)
            if proj is not None:
                yield proj


@dataclass(slots=True)
class ModelWeights:
    """The whole model's weights. Under --quantization int8 the embedding is an Int8Linear (its
    int8 rows and per-row scales), and a tied LM head is that same object."""

    embed: torch.Tensor | Int8Linear  # [V, H]
    norm: torch.Tensor  # [H]
    lm_head: Linear  # [V, H] (`embed` itself, or a projection of its weight, when tied)
    layers: list[LayerWeights]
    # layer -> (w13, w2)
    experts: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def tied(self) -> bool:
        """Whether the LM head reads the embedding's own weight (held once)."""
        return self.lm_head is self.embed or self.lm_head.weight is self.embed

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The embedding rows of `ids` in `dtype` (int8 rows scaled, or the plain rows)."""
        if isinstance(self.embed, Int8Linear):
            return self.embed.lookup(ids, dtype)
        return F.embedding(ids, self.embed)

    def replace_dense(self, make: Callable[[Linear], Linear]) -> int:
        """Each layer's dense projection becomes `make(it)` (the old object is dropped); how many."""
        count = 0
        for layer in self.layers:
            for name in DENSE_PROJECTIONS:
                proj = getattr(layer, name)
                if proj is not None:
                    setattr(layer, name, make(proj))
                    count += 1
        return count

    def num_parameters(self) -> int:
        """Distinct parameters (a tied lm_head counted once)."""
        seen: set[int] = {id(self.embed)}
        total = self.norm.numel()
        if isinstance(self.embed, Int8Linear):
            total += self.embed.out_features * self.embed.in_features
        else:
            total += self.embed.numel()
        projections = [] if self.lm_head is self.embed else [self.lm_head]
        for layer in self.layers:
            total += layer.ln1.numel() + layer.ln2.numel()
            projections.extend(layer.projections())
        for proj in projections:
            if proj.weight is None or id(proj.weight) not in seen:
                total += proj.out_features * proj.in_features
            if proj.weight is not None:
                seen.add(id(proj.weight))
            if proj.bias is not None:
                total += proj.bias.numel()
        for w13, w2 in self.experts.values():
            total += w13.numel() + w2.numel()
        return total

    def nbytes(self) -> int:
        """Bytes these weights hold, each tensor once (a tied lm_head, an expert on the host included)."""
        seen: set[int] = set()
        total = 0

        def add(t: torch.Tensor | None) -> None:
            nonlocal total
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()

        add(self.norm)
        for layer in self.layers:
            add(layer.ln1)
            add(layer.ln2)
        projections = [p for layer in self.layers for p in layer.projections()]
        if isinstance(self.embed, Int8Linear):
            projections.append(self.embed)
        else:
            add(self.embed)
        if self.lm_head is not self.embed:
            projections.append(self.lm_head)
        for proj in projections:
            if proj.weight is None:
                total += proj.nbytes()
            else:
                add(proj.weight)
                add(proj.bias)
        for w13, w2 in self.experts.values():
            add(w13)
            add(w2)
        return total
