"""Decode attention that reads the paged KV cache in place on the CPU (Cython + OpenMP kernel).

The kernel (`sloserve.hotpath._paged_attention`) walks each sequence's block table and reads
its K/V rows where they lie in the pool: no per-layer gather of whole pages, no padding, no
mask tensors. It runs float32, bf16 and int8 caches on the CPU (a bf16 page widened in registers,
an int8 row's dot products and weights times its scale: kv_int8.py; the queries, scores, softmax
and sums in float32); everything else (and SLOSERVE_NO_EXTENSIONS=1,
or an unbuilt extension) keeps the gather path in `sdpa.py`, its pure-torch twin.
"""

from __future__ import annotations

import torch
from sloserve.hotpath import USING_EXTENSIONS
from sloserve.layers.attention.base import write_kv
from sloserve.layers.attention.kv_int8 import row_bytes

try:
    if not USING_EXTENSIONS:
        raise ImportError("SLOSERVE_NO_EXTENSIONS forces the pure-torch path")
    from sloserve.hotpath._paged_attention import paged_decode as _kernel
except ImportError:  # not built, or forced off: callers fall back to the gather path
    _kernel = None

AVAILABLE = _kernel is not None
# The query dtypes it takes (float32 inside, q's dtype outside) and the cache dtypes it reads.
QUERY_DTYPES = (torch.float32, torch.bfloat16)
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the in-place kernel can run these tensors (built, CPU, a contiguous float32, bf16
    or int8 cache, float32 or bf16 queries)."""
    return (
        AVAILABLE
        and q.device.type == "cpu"
        and q.dtype in QUERY_DTYPES
        and k_cache.dtype in CACHE_DTYPES
        and k_cache.is_contiguous()
    )


def paged_decode(
    q: torch.Tensor,  # [S, Hq, D] float32 or bf16, one query token per sequence
    k_cache: torch.Tensor,  # [P, page, Hkv, D] float32 or bf16 ([..., D + 2] int8), contiguous
    v_cache: torch.Tensor,  # [P, page, Hkv, D]
    block_tables: torch.Tensor,  # [S, W] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
) -> torch.Tensor:  # [S, Hq, D]
    """Each query attends to positions 0 .. seq_len-1 of its sequence, read from the pages in place."""
    if _kernel is None:
        raise RuntimeError(
            "the in-place paged decode kernel is not built (sloserve.hotpath._paged_attention)"
        )
    num_seqs, num_heads, dim = q.shape
    num_pages, page, kv_heads, kdim = k_cache.shape
    int8 = k_cache.dtype == torch.int8
    if (
        kdim != (row_bytes(dim) if int8 else dim)
        or v_cache.shape != k_cache.shape
        or not v_cache.is_contiguous()
        or not k_cache.is_contiguous()
    ):
        raise ValueError(
            f"caches must be contiguous [P, page, Hkv, {row_bytes(dim) if int8 else dim}], got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )
    if (
        q.dtype not in QUERY_DTYPES
        or k_cache.dtype not in CACHE_DTYPES
        or v_cache.dtype != k_cache.dtype
    ):
        raise ValueError(
            "the in-place paged decode kernel runs float32 or bfloat16 queries and float32, "
            f"bfloat16 or int8 caches (K and V alike), got {q.dtype} queries, {k_cache.dtype} K "
            f"and {v_cache.dtype} V"
        )
    out_dtype = q.dtype
    q = q.to(torch.float32).contiguous()
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    tables = tables.contiguous()
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    lens = lens.contiguous()
    if tables.shape[0] != num_seqs or lens.shape[0] != num_seqs:
        raise ValueError(
            f"{num_seqs} queries need {num_seqs} block-table rows and lengths, got "
            f"{tables.shape[0]} and {lens.shape[0]}"
        )
    out = torch.empty_like(q)
    _kernel(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        kv_heads,
        dim,
        page,
        num_pages,
        tables.shape[1],
        float(scale),
        torch.get_num_threads(),
        k_cache.dtype == torch.bfloat16,
        int8,
    )
    return out.to(out_dtype)


def write_and_attend(
    q: torch.Tensor,  # [S, Hq, D]
    k: torch.Tensor,  # [S, Hkv, D], the step's new keys
    v: torch.Tensor,  # [S, Hkv, D]
    k_cache: torch.Tensor,  # [P, page, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [S] int64
    block_tables: torch.Tensor,  # [S, W] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
) -> torch.Tensor:  # [S, Hq, D]
    """Write the new K/V into their slots, then decode-attend in place: one layer of a decode step."""
    write_kv(k_cache, v_cache, k, v, slot_mapping)
    return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)


# The same step as one opaque operator, so torch.compile traces around the Cython kernel (no graph
# break). NOTE: it declares no mutation, as vLLM's attention ops hide their KV cache from the
# compiler: declared, functionalisation would hand it a copy of the cache and write that back
# (a whole-pool copy per layer, and lost writes when re-inplacing declines). Nothing else in the
# graph reads a layer's cache, and the op's output is used, so it is never reordered or dropped.
@torch.library.custom_op("sloserve::paged_write_and_attend", mutates_args=())
def paged_write_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return write_and_attend(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale)


@paged_write_and_attend.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
