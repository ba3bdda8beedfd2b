"""Fused weight containers handed from the loader to the model (plain tensors, no nn.Module)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer. A MoE layer has router_w (and, for Qwen2-MoE, a shared expert in gate_up_w/down_w)."""

    ln1: torch.Tensor  # [H]
    ln2: torch.Tensor  # [H]
    qkv_w: torch.Tensor  # [(Hq + 2 Hkv) * D, H]
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor  # [H, Hq * D]
    o_b: torch.Tensor | None
    gate_up_w: torch.Tensor | None = None  # [2I, H] dense MLP or shared expert
    gate_up_b: torch.Tensor | None = None
    down_w: torch.Tensor | None = None  # [H, I]
    down_b: torch.Tensor | None = None
    router_w: torch.Tensor | None = None  # [E, H]
    shared_gate_w: torch.Tensor | None = None  # [1, H]


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (may be `embed` itself when tied)
    layers: list[LayerWeights]
    experts: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )  # layer -> (w13, w2)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied lm_head counted once)."""
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.norm, self.lm_head]
        for layer in self.layers:
            tensors.extend(getattr(layer, f) for f in LayerWeights.__slots__)
        for w13, w2 in self.experts.values():
            tensors.extend((w13, w2))
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel()
        return total
