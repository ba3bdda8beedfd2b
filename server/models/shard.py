"""Which part of each weight one tensor-parallel rank holds (Megatron-style), and its local shapes.

With `size` ranks, rank r holds:

- attention: query heads [r*Hq/size, (r+1)*Hq/size) and the KV heads they read. With at least
  as many KV heads as ranks, the KV heads split evenly too; with fewer, each rank holds the one
  KV head its query heads share (replicated across the size/Hkv ranks of that group);
- qkv and gate_up (and each expert's w1/w3) column-parallel: their output rows are split;
- o and down (and each expert's w2) row-parallel: their input columns are split, so each rank
  computes a partial sum that an all-reduce completes; their biases live on rank 0 only, so the
  sum adds them once;
- embedding, final norm, LM head, router and the shared-expert gate replicated.

Every rank thus computes the same hidden state after each all-reduce, routes tokens to the same
experts and produces the same logits; only rank 0 samples.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sloserve.models.spec import ModelSpec


@dataclass(slots=True, frozen=True)
class Shard:
    """Rank `rank` of `size` tensor-parallel ranks (the default: the whole model on one rank)."""

    rank: int = 0
    size: int = 1

    def split(self, n: int) -> slice:
        """This rank's even part of n items."""
        part = n // self.size
        return slice(self.rank * part, (self.rank + 1) * part)

    def q_heads(self, spec: ModelSpec) -> slice:
        return self.split(spec.num_heads)

    def kv_heads(self, spec: ModelSpec) -> slice:
        """The KV heads this rank's query heads read (one replicated head when Hkv < size)."""
        if spec.num_kv_heads >= self.size:
            return self.split(spec.num_kv_heads)
        head = self.rank * spec.num_kv_heads // self.size
        return slice(head, head + 1)

    @property
    def owns_bias(self) -> bool:
        """Row-parallel biases are added by rank 0 only (the all-reduce would add them `size` times)."""
        return self.rank == 0


def check_divisible(spec: ModelSpec, size: int) -> None:
    """ValueError naming the dimension when `size` ranks cannot split `spec` evenly."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {size}")
    checks = [
        ("num_attention_heads", spec.num_heads),
        ("intermediate_size", spec.intermediate_size),
    ]
    if spec.moe_layers:
        checks.append(("moe_intermediate_size", spec.moe_intermediate_size))
        if spec.shared_expert_intermediate_size:
            checks.append(("shared_expert_intermediate_size", spec.shared_expert_intermediate_size))
    for name, value in checks:
        if value % size:
            raise ValueError(
                f"tensor parallel size {size} does not divide {name} {value} of "
                f"{spec.architecture}; choose a size that divides it"
            )
    kv = spec.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ValueError(
            f"tensor parallel size {size} and num_key_value_heads {kv} of {spec.architecture} "
            "do not split evenly: one must divide the other"
        )


def local_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """The shapes one of `size` ranks computes with (checked with check_divisible first)."""
    check_divisible(spec, size)
    if size == 1:
        return spec
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // size,
        num_kv_heads=max(1, spec.num_kv_heads // size),
        intermediate_size=spec.intermediate_size // size,
        moe_intermediate_size=spec.moe_intermediate_size // size,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size // size,
    )
