"""Copies of whole KV blocks between the device pool and the host swap pool (preemption by swap)."""

from __future__ import annotations

import torch


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """dst[:, :, d] = src[:, :, s] for each (s, d): all layers, K and V, of one block at a time.

    Caches are [L, 2, pages, page, Hkv, D]; copies are per block (never per token) and
    asynchronous towards pinned host memory on CUDA (the stream orders later reads).
    """
    for s, d in pairs:
        dst[:, :, d].copy_(src[:, :, s], non_blocking=True)
