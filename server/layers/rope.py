"""Rotary position embeddings (GPT-NeoX half-rotation) with default, linear and llama3 scaling.

cos/sin tables are built once for every position up to the context limit; a step gathers the
rows of its positions once and every layer reuses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from sloserve.hotpath import USING_EXTENSIONS

try:
    if not USING_EXTENSIONS:
        raise ImportError("SLOSERVE_NO_EXTENSIONS forces the torch ops")
    from sloserve.hotpath._cpu_ops import rope as _kernel
except ImportError:  # not built, or forced off: the torch ops in apply_rope
    _kernel = None

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True, frozen=True)
class RopeSpec:
    """RoPE settings read from config.json: base theta and optional scaling."""

    theta: float
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def inv_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [D/2] in float32, as transformers computes them for each rope type."""
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.type == "default":
        return inv_freq
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope type {rope.type!r} is not supported (default, linear, llama3)")


def rope_tables(
    rope: RopeSpec, head_dim: int, max_positions: int, device, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, D] (each frequency twice, as in transformers)."""
    inv_freq = inv_frequencies(rope, head_dim)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x[T, H, D] rotated by cos/sin [T, D]: x * cos + rotate_half(x) * sin.

    float32 on a CPU takes the one-call kernel (`sloserve.hotpath._cpu_ops`, the same bits);
    everything else, and anything torch.compile traces, the torch ops below.
    """
    if _kernel is not None and _fits(x, cos, sin):
        tokens, heads, dim = x.shape
        out = torch.empty((tokens, heads, dim), dtype=x.dtype)
        _kernel(
            x.data_ptr(),
            x.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            out.data_ptr(),
            tokens,
            heads,
            dim,
        )
        return out
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclass(slots=True, frozen=True)
class RopeRows:
    """One step's cos/sin rows [T, D], gathered once and applied by every layer (`rotate`).

    Where the C kernel cannot take them (not float32 on a CPU), `signed_sin` holds sin [T, 1, D]
    with its first half negated, so a layer rotates in four torch ops instead of about ten:
    rotate_half(x) * sin == x.roll(D/2) * signed_sin, bit for bit (negating a product only flips
    its sign: rounding to nearest is symmetric).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    signed_sin: torch.Tensor | None = None

    @classmethod
    def gather(cls, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> RopeRows:
        """The rows of `positions` from the [max_positions, D] tables."""
        cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
        if _kernel is not None and cos.dtype == torch.float32 and cos.device.type == "cpu":
            return cls(cos, sin)
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cls(cos.unsqueeze(1), sin, signed.unsqueeze(1))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x[T, H, D] rotated: `apply_rope(x, cos, sin)`'s bits."""
        if self.signed_sin is None:
            return apply_rope(x, self.cos, self.sin)
        return x * self.cos + x.roll(x.shape[-1] // 2, -1) * self.signed_sin


def _fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel can run these tensors: heads contiguous within each token's row."""
    if x.device.type != "cpu" or x.dim() != 3 or torch.compiler.is_compiling():
        return False
    tokens, heads, dim = x.shape
    return (
        x.dtype == cos.dtype == sin.dtype == torch.float32
        and dim % 2 == 0
        and x.stride(2) == 1
        and x.stride(1) == dim
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == sin.shape == (tokens, dim)
    )
