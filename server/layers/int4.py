"""int4 weight-only projections (W4A16): the weight held once, in the layout torch's int4 kernel reads.

`Int4Linear` keeps the weight as torch's `_convert_weight_to_int4pack_for_cpu` lays it out
([out, in / 2] bytes, two 4-bit values a byte, rows blocked by 64) and, for each group of
`group_size` inputs of each output row, a scale and a zero: w = (v - 8) * scale + zero, v in 0..15.
A checkpoint's signed value q with zero point zp, w = (q - zp) * scale, is stored as v = q + 8
with zero = -zp * scale. Per-channel weights (one scale a row) take the largest group size the
kernel runs that divides the row, the scale repeated.

Products by row count, chosen by measurement (`benchmarks/cpu_int4.py`,
docs/design/quantized-checkpoints.md):

- fewer than DEQUANT_ROWS rows: torch's `_weight_int4pack_mm_for_cpu` (AVX-512 where present),
  reading a quarter of bf16's bytes;
- DEQUANT_ROWS rows and more: each tile of TILE_OUT output rows dequantized into the activation's
  dtype and multiplied on torch's `linear`, tile by tile: the int4 kernel's cost grows with the
  rows, a tile's dequantizing does not. No dequantized copy outlives the product.

Decode steps of up to 64 sequences run the fused C step instead, which reads `packed` and
`scales_zeros` in place (hotpath/_decode_step_int4.h; executor/fused.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

# Group sizes (inputs sharing a scale and zero) torch's int4 kernel runs.
GROUP_SIZES = (32, 64, 128, 256)
# Products of this many rows and more dequantize a tile at a time (see the module docstring).
DEQUANT_ROWS = 256
# Output rows dequantized at a time: a multiple of the layout's blocks of 64 rows.
TILE_OUT = 512
# Row blocks of torch's CPU int4 layout (rows past the last whole block pair up instead).
_BLOCK = 64
# Rows converted to the layout at a time at load (a multiple of _BLOCK).
CONVERT_ROWS = 1024


def channel_group_size(in_features: int) -> int:
    """The group size a per-channel weight runs as: the largest in GROUP_SIZES dividing the row."""
    for size in reversed(GROUP_SIZES):
        if in_features % size == 0:
            return size
    raise ValueError(
        f"an int4 row of {in_features} inputs is not a multiple of {GROUP_SIZES[0]}, "
        "which torch's int4 kernel needs"
    )


class Int4Linear:
    """int4 weight [out, in] in torch's packed layout, scales and zeros per group of inputs."""

    __slots__ = ("packed", "scales_zeros", "group_size", "bias", "out_features", "in_features")

    def __init__(
        self,
        values: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """`values` [out, in] in 0..15 (any integer dtype); `scale` and `zero` [out, groups] with
        w = (values - 8) * scale + zero; scales and zeros kept in `dtype` (the activations')."""
        out_f, in_f = values.shape
        groups = scale.shape[1]
        if groups == 1:
            size = channel_group_size(in_f)
            scale, zero = (t.repeat_interleave(in_f // size, dim=1) for t in (scale, zero))
        elif in_f % groups or in_f // groups not in GROUP_SIZES:
            raise ValueError(
                f"int4 groups of {in_f / groups:g} inputs: torch's int4 kernel runs "
                f"{', '.join(map(str, GROUP_SIZES))}"
            )
        if out_f % 16:
            raise ValueError(f"int4 weights need a multiple of 16 output rows, got {out_f}")
        self.out_features, self.in_features = out_f, in_f
        self.group_size = in_f // scale.shape[1]
        self.packed = _convert(values)
        # [groups, out, 2]: the kernel's scales_and_zeros
        self.scales_zeros = torch.stack([scale.float().t(), zero.float().t()], dim=-1).to(dtype)
        self.bias = bias

    @classmethod
    def from_signed(
        cls,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor | None,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Int4Linear:
        """From signed values q in -8..7 [out, in] with w = (q - zero_point) * scale, zero points
        [out, groups] (None: symmetric)."""
        scale = scale.float()
        zero = torch.zeros_like(scale) if zero_point is None else -zero_point.float() * scale
        return cls((q + 8).to(torch.uint8), scale, zero, bias, dtype)

    @property
    def weight(self) -> None:
        return None

    def nbytes(self) -> int:
        tensors = (self.packed, self.scales_zeros, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def dequantized(
        self, rows: slice = slice(None), dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The weight rows `rows` in `dtype` (a tile for a product, or a reference; never kept)."""
        start, stop, _ = rows.indices(self.out_features)
        values = unpack_rows(self.packed, self.out_features, self.in_features, start, stop)
        sz = self.scales_zeros[:, start:stop].to(dtype)
        groups = values.reshape(stop - start, -1, self.group_size).to(dtype)
        scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]
        return ((groups - 8) * scale + zero).reshape(stop - start, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:  # no row to compute (a step that samples nothing)
            return x.new_empty((*lead, self.out_features))
        if x2.shape[0] < DEQUANT_ROWS or not layout_known():
            sz = self.scales_zeros.to(x.dtype)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.contiguous(), self.packed, self.group_size, sz
            )
            if self.bias is not None:
                y = y + self.bias
        else:
            y = tiled_product(x2, self.dequantized, self.bias, self.out_features)
        return y.reshape(*lead, self.out_features)


def tiled_product(
    x: torch.Tensor,
    dequantized: Callable[[slice, torch.dtype], torch.Tensor],
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """x [rows, in] times a packed weight dequantized TILE_OUT output rows at a time (`dequantized`
    (rows, dtype) gives them in x's dtype), so no whole dequantized copy is ever held."""
    parts = [
        F.linear(
            x,
            dequantized(slice(i, i + TILE_OUT), x.dtype),
            None if bias is None else bias[i : i + TILE_OUT],
        )
        for i in range(0, out_features, TILE_OUT)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _convert(values: torch.Tensor) -> torch.Tensor:
    """torch's int4 layout of `values` [out, in] (0..15), converted CONVERT_ROWS rows at a time.

    Blocks of 64 rows lie one after another in the layout, so chunks whose rows are a multiple of
    64 convert on their own and join end to end: the int32 copy torch's conversion takes stays a
    chunk's, not the weight's (a 7B gate_up would need 360 MB for it).
    """
    out_f, in_f = values.shape
    packed = torch.empty((out_f, in_f // 2), dtype=torch.uint8)
    flat = packed.reshape(-1)
    for start in range(0, out_f, CONVERT_ROWS):
        chunk = values[start : start + CONVERT_ROWS].to(torch.int32)
        part = torch.ops.aten._convert_weight_to_int4pack_for_cpu(chunk, 1)
        flat[start * in_f // 2 : start * in_f // 2 + part.numel()] = part.reshape(-1)
    return packed


def unpack_rows(packed: torch.Tensor, out_f: int, in_f: int, start: int, stop: int) -> torch.Tensor:
    """Values 0..15 (uint8) of rows [start, stop) of a weight in torch's CPU int4 layout.

    The layout: each block of 64 rows is [in, 32] bytes, byte j of input k holding row j (low
    4 bits) and row j + 32 (high 4 bits); rows past the last whole block are [in, rest / 2]
    bytes, byte j holding rows 2j and 2j + 1. `start` must be a block boundary.
    """
    assert start % _BLOCK == 0, "tiles start on a block of 64 rows"
    flat = packed.reshape(-1)
    whole = out_f // _BLOCK * _BLOCK
    parts = []
    body_stop = min(stop, whole)
    if start < body_stop:
        body = flat[start * in_f // 2 : body_stop * in_f // 2].reshape(-1, in_f, _BLOCK // 2)
        both = torch.cat([body & 15, body >> 4], dim=2)  # [blocks, in, 64]
        parts.append(both.transpose(1, 2).reshape(body_stop - start, in_f))
    if stop > whole:
        tail = flat[whole * in_f // 2 :].reshape(in_f, (out_f - whole) // 2)
        rows = torch.stack([tail & 15, tail >> 4], dim=2).reshape(in_f, out_f - whole).t()
        parts.append(rows[max(start, whole) - whole : stop - whole])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@functools.cache
def layout_known() -> bool:
    """Whether this torch lays int4 weights out as `unpack_rows` reads them (else every product
    runs torch's int4 kernel)."""
    # NOTE: the layout is torch's private choice; a later torch that changes it loses the tiled
    # path for large products, never correctness
    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (80, 64), generator=g, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    return packed.numel() * 2 == values.numel() and torch.equal(
        unpack_rows(packed, 80, 64, 0, 80).to(torch.int32), values
    )
