"""Paged attention through flash-attn (`pip install sloserve[gpu]`), when it is importable.

Mixed prefill/decode steps use `flash_attn_varlen_func` with a block table; decode-only steps
use `flash_attn_with_kvcache`. flash-attn's causal mask is aligned bottom-right, which is what a
chunk after cached context needs. Upstream's paged KV requires page_size % 256 == 0, fp16 or
bf16, and a CUDA device; `unavailable_reason` says which of these is missing.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from sloserve.layers.attention.metadata import AttentionMetadata

PAGE_MULTIPLE = 256


def _flash_importable() -> bool:
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


class FlashBackend:
    """flash-attn paged kernels (varlen with block table; with_kvcache for decode-only steps)."""

    name = "flash"
    preferred_block_size = PAGE_MULTIPLE  # the KV page size auto gives it when the config sets none

    def __init__(self) -> None:
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as exc:  # pragma: no cover - depends on the optional extra
            raise RuntimeError(
                "the 'flash' attention backend needs flash-attn >= 2.6 (pip install 'sloserve[gpu]'); "
                "use --attention-backend sdpa or triton instead"
            ) from exc
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    @staticmethod
    def unavailable_reason(
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        block_size: int | None = None,
        head_dim: int | None = None,
    ) -> str | None:
        """Why flash-attn cannot run with these settings, or None when it can."""
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            return "flash-attn needs a CUDA device"
        if not _flash_importable():
            return "flash-attn is not installed (pip install 'sloserve[gpu]')"
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
            return f"flash-attn supports float16 and bfloat16 only, not {dtype}"
        if block_size is not None and block_size % PAGE_MULTIPLE:
            return (
                f"flash-attn's paged KV needs a block size that is a multiple of {PAGE_MULTIPLE}, "
                f"got {block_size}: leave the block size unset (flash then gets {PAGE_MULTIPLE}) or set a "
                f"multiple of {PAGE_MULTIPLE}, or use the sdpa/triton backend"
            )
        if head_dim is not None and (head_dim > 256 or head_dim % 8):
            return f"flash-attn needs head_dim <= 256 and a multiple of 8, got {head_dim}"
        return None

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of q[T, Hq, D] over the paged caches [P, page, Hkv, D] -> [T, Hq, D]."""
        if k_cache.shape[1] % PAGE_MULTIPLE or q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                self.unavailable_reason(q.device, q.dtype, k_cache.shape[1], q.shape[-1])
            )
        if q.shape[0] == 0:
            return torch.empty_like(q)
        if meta.decode_only:
            out = self._with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens, 0, dtype=torch.int32), (1, 0))
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
        )
