"""Pure-torch paged attention: the CPU oracle every other backend is checked against."""

from __future__ import annotations

import torch
from sloserve.layers.attention import kv_int8
from sloserve.layers.attention.metadata import AttentionMetadata


class ReferenceBackend:
    """Gather each sequence's pages (an int8 cache's dequantized into q's dtype), mask causally
    (bottom-right), softmax in float32."""

    name = "reference"

    @staticmethod
    def unavailable_reason(device, dtype=None, block_size=None, head_dim=None) -> str | None:
        """Runs everywhere."""
        return None

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.num_tokens == 0:
            return torch.empty_like(q)
        if meta.decode_only:
            return _decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        cu, page = meta.cu_seqlens_q_list, k_cache.shape[1]
        for i, (start, seq_len) in enumerate(
            zip(meta.start_pos_list, meta.seq_lens_list, strict=True)
        ):
            lo, hi = cu[i], cu[i + 1]
            pages = meta.block_tables_list[i][: (seq_len + page - 1) // page]
            k_pages = kv_int8.pages(k_cache, pages, q.dtype)
            v_pages = kv_int8.pages(v_cache, pages, q.dtype)
            out[lo:hi] = _attend(q[lo:hi], k_pages, v_pages, start, seq_len, scale)
        return out


def _attend(q, k_pages, v_pages, start: int, seq_len: int, scale: float) -> torch.Tensor:
    """One sequence: q[n, Hq, D] against its keys [seq_len, Hkv, D]; query j sees keys <= start+j."""
    n, hq, dim = q.shape
    hkv = k_pages.shape[-2]
    k = k_pages.reshape(-1, hkv, dim)[:seq_len].transpose(0, 1)  # [Hkv, L, D]
    v = v_pages.reshape(-1, hkv, dim)[:seq_len].transpose(0, 1)  # [Hkv, L, D]
    qg = q.view(n, hkv, hq // hkv, dim).permute(1, 2, 0, 3).reshape(hkv, -1, dim)  # [Hkv, g*n, D]
    scores = torch.matmul(qg, k.transpose(1, 2)).float() * scale  # [Hkv, g*n, L]
    rows = torch.arange(n, device=q.device).repeat(hq // hkv) + start  # query position per row
    keys = torch.arange(seq_len, device=q.device)
    scores.masked_fill_(keys[None, :] > rows[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [Hkv, g*n, D]
    return out.view(hkv, hq // hkv, n, dim).permute(2, 0, 1, 3).reshape(n, hq, dim)


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """All sequences decode one token: one gather per cache and two batched matmuls.

    The gathered pages stay in cache layout, rows ordered (position, kv head). Each query head
    scores every row, and rows of the other kv heads are masked out with the padding, so one
    softmax over (position, kv head) is the per-head softmax and no transpose copy is needed.
    That spends Hkv times the (small) attention FLOPs, so wide-GQA models take the per-head path.
    """
    num_seqs, hq, dim = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    width = (meta.max_seqlen_k + page - 1) // page
    length = width * page
    pages = meta.block_tables[:, :width].reshape(-1)
    k = kv_int8.flat_pages(k_cache, pages, q.dtype)  # [S * width, page * Hkv * D]
    v = kv_int8.flat_pages(v_cache, pages, q.dtype)
    # Slots past a sequence's length (its last page's tail, the null page padding the table) hold
    # whatever the pool held, NaN included; a masked score still multiplies them (0 * NaN = NaN),
    # so they are zeroed in the fresh gathers, not just masked.
    beyond = meta.memo.get("reference.decode_beyond")
    if beyond is None:  # the same for every layer of the step
        positions = torch.arange(length, device=q.device)
        beyond = positions[None, :] >= meta.seq_lens[:, None]  # [S, L]
        meta.memo["reference.decode_beyond"] = beyond
    k.view(num_seqs, length, -1).masked_fill_(beyond[:, :, None], 0.0)
    v.view(num_seqs, length, -1).masked_fill_(beyond[:, :, None], 0.0)
    invalid = meta.memo.get("reference.decode_mask")
    if hkv > _MAX_FOLDED_KV_HEADS:
        if invalid is None:
            invalid = beyond[:, None, None, :]  # [S, 1, 1, L]
            meta.memo["reference.decode_mask"] = invalid
        k = k.view(num_seqs, length, hkv, dim).transpose(1, 2)  # [S, Hkv, L, D]
        v = v.view(num_seqs, length, hkv, dim).transpose(1, 2)
        scores = (
            torch.matmul(q.reshape(num_seqs, hkv, hq // hkv, dim), k.transpose(-1, -2)).float()
            * scale
        )
        scores.masked_fill_(invalid, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v).reshape(num_seqs, hq, dim)
    if invalid is None:
        heads = torch.arange(hkv, device=q.device)
        other_head = heads[:, None] != heads[None, :]  # [Hkv (query's), Hkv (row's)]
        # [S, Hkv, 1, L, Hkv]
        invalid = beyond[:, None, None, :, None] | other_head[None, :, None, None, :]
        meta.memo["reference.decode_mask"] = invalid
    # [S, Hq, L*Hkv]
    scores = torch.bmm(q, k.view(num_seqs, length * hkv, dim).transpose(1, 2)).float() * scale
    scores.view(num_seqs, hkv, hq // hkv, length, hkv).masked_fill_(invalid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.bmm(probs, v.view(num_seqs, length * hkv, dim))  # [S, Hq, D]


_MAX_FOLDED_KV_HEADS = 4
