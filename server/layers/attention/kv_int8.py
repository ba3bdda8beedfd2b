"""int8 KV pages (--kv-cache-dtype int8): each (token, KV head) row is stored as its head_dim
int8 values followed by the 4 bytes of its float32 scale.

A cache of this kind is an int8 tensor [..., Hkv, head_dim + SCALE_BYTES]. The scale is
symmetric, absmax / 127 of the row, computed when the token is written; a row of zeros has
scale 0. Keeping the scale inside the row (not in a second carve) keeps one tensor per pool: a
block copied for swap, reused for a prefix or carved per tensor-parallel rank carries its scales
with it, and a page is still one contiguous run of bytes.

NOTE: float32 scales, not bf16: a bf16 scale (8 significant bits) adds up to 0.4 % error to
every value of a row, as much as the int8 rounding itself; the 2 bytes it would save are 1.5 % of
a 128-wide row (docs/design/cpu-decode.md, "int8 KV pages").
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def row_bytes(head_dim: int) -> int:
    """Bytes of one (token, KV head) row of an int8 page: the values, then the scale."""
    return head_dim + SCALE_BYTES


def is_int8(cache: torch.Tensor) -> bool:
    """Whether `cache` holds int8 rows with their scales."""
    return cache.dtype == torch.int8


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + SCALE_BYTES] int8: round(x / scale) and the float32 scale's bytes."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    values = torch.round(x / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127)
    return torch.cat([values.to(torch.int8), scale.view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + SCALE_BYTES] int8 -> [..., D] in `dtype` (the product taken in float32)."""
    dim = rows.shape[-1] - SCALE_BYTES
    values, scale = rows.split([dim, SCALE_BYTES], dim=-1)
    return (values.float() * scale.contiguous().view(torch.float32)).to(dtype)


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


def head_dim(cache: torch.Tensor) -> int:
    """The head dimension a cache holds ([..., D], or an int8 cache's [..., D + SCALE_BYTES])."""
    return cache.shape[-1] - (SCALE_BYTES if is_int8(cache) else 0)
