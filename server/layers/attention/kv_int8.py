"""int8 KV pages (--kv-cache-dtype int8): each (token, KV head) row is stored as its head_dim
int8 values followed by the 2 bytes of its bf16 scale.

A cache of this kind is an int8 tensor [..., Hkv, head_dim + SCALE_BYTES]. The scale is
symmetric, absmax / 127 of the row rounded to bf16, computed when the token is written (the
values divided by the rounded scale, clamped to +-127); a row of zeros has scale 0.

NOTE: the scale lives inside its row, not in a second carve: one tensor per pool, so a block
copied for swap, reused for a prefix or carved per tensor-parallel rank carries its scales with
it, every reader that takes the pool takes the scales, and a page stays one contiguous run of
bytes (one stream for the kernels' prefetch).

bf16 scales, not float32: on the built-in model's K/V rows (benchmarks/kv_dtype.py) the
mean relative error of a row was 0.574 % with a bf16 scale against 0.569 % with a float32 one,
and the 2 bytes saved are 3 % more tokens at head_dim 64 (docs/design/cpu-decode.md, "int8 KV
pages").
"""

from __future__ import annotations

import torch
from sloserve.hotpath import USING_EXTENSIONS

try:
    if not USING_EXTENSIONS:
        raise ImportError("SLOSERVE_NO_EXTENSIONS forces the pure-torch path")
    from sloserve.hotpath._paged_attention import write_int8_rows as _write_rows
except ImportError:  # not built, or forced off: write_rows quantizes in torch
    _write_rows = None

SCALE_BYTES = 2


def row_bytes(head_dim: int) -> int:
    """Bytes of one (token, KV head) row of an int8 page: the values, then the scale."""
    return head_dim + SCALE_BYTES


def is_int8(cache: torch.Tensor) -> bool:
    """Whether `cache` holds int8 rows with their scales."""
    return cache.dtype == torch.int8


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + SCALE_BYTES] int8: round(x / scale) and the bf16 scale's bytes."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.bfloat16)
    wide = scale.float()
    values = torch.round(x / torch.where(wide > 0, wide, 1.0)).clamp_(-127, 127)
    return torch.cat([values.to(torch.int8), scale.view(torch.int8)], dim=-1)


def write_rows(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    """cache[slot] = quantize_rows(x[t]) for each token t: x [T, Hkv, D], cache [..., Hkv, D + 2].

    NOTE: on a CPU one C call (the same bytes as quantize_rows): the torch ops per K and V per layer
    cost more than the whole attention of a small model's decode step.
    """
    heads, row = cache.shape[-2:]
    if _write_rows is not None and cache.device.type == "cpu" and cache.is_contiguous():
        x = x.to(torch.float32).contiguous()
        slots = slots.to(torch.int64).contiguous()
        _write_rows(
            x.data_ptr(),
            cache.data_ptr(),
            slots.data_ptr(),
            x.shape[0],
            heads,
            row - SCALE_BYTES,
            cache.numel() // (heads * row),
        )
        return
    cache.view(-1, heads, row).index_copy_(0, slots, quantize_rows(x))


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + SCALE_BYTES] int8 -> [..., D] in `dtype` (the product taken in float32)."""
    dim = rows.shape[-1] - SCALE_BYTES
    values, scale = rows.split([dim, SCALE_BYTES], dim=-1)
    return (values.float() * scale.contiguous().view(torch.bfloat16).float()).to(dtype)


def pages(cache: torch.Tensor, index: slice | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[index] as values: a float cache's pages as they are (a view for a slice), an int8
    cache's dequantized into `dtype`."""
    return dequantize(cache[index], dtype) if is_int8(cache) else cache[index]


def flat_pages(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whole pages [len(index), page * Hkv * D] of a cache, an int8 one's dequantized into `dtype`."""
    rows = cache.view(cache.shape[0], -1).index_select(0, index)
    if not is_int8(cache):
        return rows
    return dequantize(rows.view(-1, cache.shape[-1]), dtype).view(len(index), -1)
