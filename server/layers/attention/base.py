"""The one interface every attention backend implements, and the K/V write they all share."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from sloserve.layers.attention.kv_int8 import is_int8, write_rows
from sloserve.layers.attention.metadata import AttentionMetadata


class BackendUnavailableError(RuntimeError):
    """A backend cannot run here (missing package, wrong device, unsupported page size)."""


@runtime_checkable
class AttentionBackend(Protocol):
    """Paged attention over caches shaped [pages, page_size, kv_heads, head_dim] (an int8 cache:
    [..., head_dim + 2], each row's scale after its values: kv_int8.py).

    A backend class has a ``name``, a constructor callable without arguments (raising
    ImportError or RuntimeError when its package is missing), and a static
    ``unavailable_reason(device, dtype=None, block_size=None, head_dim=None) -> str | None``
    saying why it cannot run with those settings (None when it can). A class that needs a
    particular KV page size names it in ``preferred_block_size``; `select_backend` gives it that
    size when the config sets none.
    """

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [P, page, Hkv, D]
        v_cache: torch.Tensor,  # [P, page, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Attend each query to its sequence's cached keys (new K/V already written)."""
        ...


@runtime_checkable
class CapturableDecode(Protocol):
    """A backend whose decode step can be captured in a CUDA graph: no host sync, and every shape
    (the split count included) follows from the batch and the block-table width alone."""

    def decode(
        self,
        q: torch.Tensor,  # [B, Hq, D], one query per sequence
        k: torch.Tensor,  # [B, Hkv, D], the step's new keys (written first)
        v: torch.Tensor,  # [B, Hkv, D]
        k_cache: torch.Tensor,  # [P, page, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [B] int64
        block_tables: torch.Tensor,  # [B, W] int32
        seq_lens: torch.Tensor,  # [B] int32
        scale: float,
    ) -> torch.Tensor:  # [B, Hq, D]
        """Write the new K/V into their slots, then attend each query to its sequence's keys."""
        write_kv(k_cache, v_cache, k, v, slot_mapping)
        return self.attend_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)

    def attend_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """`decode` when the new K/V are already in the cache (written by a fused kernel)."""
        ...


def check_heads(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """ValueError unless the query heads ([T, Hq, D]) are a multiple of the cache's KV heads."""
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k_cache.shape[2]})"
        )


def write_kv(
    k_cache: torch.Tensor,  # [P, page, Hkv, D]
    v_cache: torch.Tensor,  # [P, page, Hkv, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Scatter the new tokens' K/V into their cache slots (slot = page * page_size + offset); an
    int8 cache takes each row quantized with its scale (kv_int8.py)."""
    if is_int8(k_cache):
        write_rows(k_cache, k, slot_mapping)
        write_rows(v_cache, v, slot_mapping)
        return
    heads, row = k_cache.shape[-2:]
    k_cache.view(-1, heads, row).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, heads, row).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
