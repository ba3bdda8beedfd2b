"""Paged attention through PyTorch's fused `scaled_dot_product_attention`.

SDPA takes dense K/V, so each sequence's pages are gathered first (on the split path, a view of
the cache when they lie one after another). Its `is_causal` flag aligns the mask top-left,
which is wrong for a chunk that starts after cached context; the mask here is explicit and
aligned bottom-right: query j of sequence i (at position start_pos[i] + j) sees keys
0 .. start_pos[i] + j.

Two ways to run it: one batched call over every sequence padded to the longest query chunk and
context (the default on GPUs, where it needs no host sync and one launch), or split (the default
on CPU): every decode token (query length 1) in one call, then one unpadded SDPA call per prefill
chunk, where the maths outweighs the Python loop. On a CPU with float32 caches the decode tokens
go to the in-place paged kernel (`paged.py`: pages read where they lie, no gather, no masks);
elsewhere they are gathered in cache layout and padded to the longest decode context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sloserve.layers.attention import kv_int8, paged
from sloserve.layers.attention.base import check_heads
from sloserve.layers.attention.metadata import AttentionMetadata

_HAS_ENABLE_GQA = torch.__version__ >= "2.5"


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> torch.Tensor:
    """SDPA over [..., H, L, D] with GQA (Hq a multiple of Hkv) and a boolean keep-mask or `causal`
    (top-left aligned: for a chunk with no cached context before it).

    On a CPU 3-D inputs go in as 4-D: torch's CPU flash kernel takes only those (3-D inputs fall
    to its math path, 2-6x slower per layer: benchmarks/prefill_attention.py). With `enable_gqa`
    it reads each KV head in place for its query heads: the same bits as K/V repeated per query
    head (torch 2.13, checked by test_backends), without the copies (3% of an 800-token prefill).
    """
    if q.device.type == "cpu" and q.dim() == 3:
        return _sdpa(q[None], k[None], v[None], mask, scale, causal)[0]
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq == hkv:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=causal
        )
    if _HAS_ENABLE_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=causal, enable_gqa=True
        )
    group = hq // hkv
    k = k.repeat_interleave(group, dim=-3)
    v = v.repeat_interleave(group, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal)


def _prefill_chunk(
    meta: AttentionMetadata, i: int, page: int, q: torch.Tensor
) -> tuple[int, int, int, slice | torch.Tensor, torch.Tensor | None]:
    """(first token, end, context length, pages, mask) of prefill sequence i, for every layer of a step.

    pages: a slice when the sequence's pages are consecutive in the pool (a fresh prompt's usually
    are), so its K/V are a view of the cache; else the page ids, gathered per layer. mask: None with
    no cached context (SDPA's own causal mask), else the bottom-right causal mask [n, L] as 0 / -inf
    in q's dtype, built once instead of per layer (SDPA turns a boolean one into that each call).
    """
    lo, hi, seq_len = (
        meta.cu_seqlens_q_list[i],
        meta.cu_seqlens_q_list[i + 1],
        meta.seq_lens_list[i],
    )
    table = meta.block_tables_list[i][: -(-seq_len // page)]
    if table == list(range(table[0], table[0] + len(table))):
        pages: slice | torch.Tensor = slice(table[0], table[-1] + 1)
    else:
        pages = torch.tensor(table, dtype=torch.long, device=q.device)
    n = hi - lo
    if n == seq_len:
        return lo, hi, seq_len, pages, None
    keys = torch.arange(seq_len, device=q.device)
    rows = torch.arange(n, device=q.device) + (seq_len - n)
    mask = torch.zeros((n, seq_len), dtype=q.dtype, device=q.device)
    mask.masked_fill_(keys[None, :] > rows[:, None], float("-inf"))
    return lo, hi, seq_len, pages, mask


class SdpaBackend:
    """PyTorch SDPA over pages gathered per step (decode tokens in place on a CPU); runs on every device and dtype."""

    name = "sdpa"

    def __init__(self, batched: bool | None = None, inplace: bool | None = None) -> None:
        self.batched = batched  # None: batched on CUDA, split on CPU
        self.inplace = inplace  # decode with the in-place paged kernel; None: wherever it can run

    @staticmethod
    def unavailable_reason(
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        block_size: int | None = None,
        head_dim: int | None = None,
    ) -> str | None:
        """Why this backend cannot run with these settings, or None when it can (always can)."""
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
        if q.shape[0] == 0:
            return torch.empty_like(q)
        check_heads(q, k_cache)
        batched = q.is_cuda if self.batched is None else self.batched
        if batched:
            return self._forward_batched(q, k_cache, v_cache, meta, scale)
        return self._forward_split(q, k_cache, v_cache, meta, scale)

    def _forward_split(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        page = k_cache.shape[1]
        out = torch.empty_like(q)
        cu = meta.cu_seqlens_q_list
        inplace = paged.supports(q, k_cache) if self.inplace is None else self.inplace
        if inplace and meta.decode_only:  # the common step: nothing to split
            return paged.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        split = meta.memo.get("sdpa.split")
        if split is None:  # the same for every layer of the step
            decodes = [i for i in range(meta.num_seqs) if cu[i + 1] - cu[i] == 1]
            prefills = [
                _prefill_chunk(meta, i, page, q)
                for i in range(meta.num_seqs)
                if cu[i + 1] - cu[i] > 1
            ]
            if not decodes:
                decode_inputs = None
            elif inplace:
                seqs = torch.tensor(decodes, dtype=torch.long, device=q.device)
                tokens = torch.tensor([cu[i] for i in decodes], dtype=torch.long, device=q.device)
                decode_inputs = (tokens, meta.block_tables[seqs], meta.seq_lens[seqs])
            else:
                decode_inputs = _decode_inputs(decodes, meta, page, q.device)
            split = (prefills, decode_inputs)
            meta.memo["sdpa.split"] = split
        prefills, decode_inputs = split
        if decode_inputs is not None and inplace:
            tokens, tables, lens = decode_inputs
            out[tokens] = paged.paged_decode(q[tokens], k_cache, v_cache, tables, lens, scale)
        elif decode_inputs is not None:
            tokens, pages, outside, outside_rows = decode_inputs
            out[tokens] = _decode(q[tokens], k_cache, v_cache, pages, outside, outside_rows, scale)
        for lo, hi, seq_len, pages, mask in prefills:
            # [Hkv, L, D]
            k = kv_int8.pages(k_cache, pages, q.dtype).flatten(0, 1)[:seq_len].transpose(0, 1)
            v = kv_int8.pages(v_cache, pages, q.dtype).flatten(0, 1)[:seq_len].transpose(0, 1)
            out[lo:hi] = _sdpa(
                q[lo:hi].transpose(0, 1), k, v, mask, scale, causal=mask is None
            ).transpose(0, 1)
        return out

    def _forward_batched(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        _, num_heads, head_dim = q.shape
        num_seqs = meta.num_seqs
        page = k_cache.shape[1]
        max_q = meta.max_seqlen_q
        num_blocks = -(-meta.max_seqlen_k // page)
        device = q.device
        table = meta.block_tables[:, :num_blocks].to(torch.long)  # [S, nb]
        # [S, nb, page, Hkv, D] -> [S, Hkv, Lk, D]
        k = kv_int8.pages(k_cache, table, q.dtype).flatten(1, 2).transpose(1, 2)
        v = kv_int8.pages(v_cache, table, q.dtype).flatten(1, 2).transpose(1, 2)
        seq_of_token, row = meta.token_rows(q)
        q_pad = q.new_zeros(num_seqs, max_q, num_heads, head_dim)
        q_pad[seq_of_token, row] = q
        keys = torch.arange(num_blocks * page, device=device)
        # NOTE: slots past a sequence's length (the tail of its last page, the null page padding
        # the table) hold whatever the pool held, NaN bit patterns included; masked scores still
        # multiply them (0 * NaN = NaN), so they are zeroed, not just masked.
        # [S,1,Lk,1]
        outside = (keys[None, :] >= meta.seq_lens.to(torch.long)[:, None])[:, None, :, None]
        k.masked_fill_(outside, 0.0)  # k, v are fresh gathers: safe to clear in place
        v.masked_fill_(outside, 0.0)
        # [S, maxq]
        rows = meta.start_pos.to(torch.long)[:, None] + torch.arange(max_q, device=device)[None, :]
        # Padded query rows still see key 0 (start_pos + row >= 0), so no row is fully masked.
        mask = keys[None, None, :] <= rows[:, :, None]  # [S, maxq, Lk], bottom-right causal
        out = _sdpa(q_pad.transpose(1, 2), k, v, mask[:, None], scale)  # [S, Hq, maxq, D]
        return out.transpose(1, 2)[seq_of_token, row]


def _decode_inputs(
    decodes: list[int], meta: AttentionMetadata, page: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat token index, page ids [Sd * nb], past-the-end slots [Sd, Lk] and their flat rows, of the decodes."""
    cu = meta.cu_seqlens_q_list
    num_blocks = -(-max(meta.seq_lens_list[i] for i in decodes) // page)
    seqs = torch.tensor(decodes, dtype=torch.long, device=device)
    tokens = torch.tensor([cu[i] for i in decodes], dtype=torch.long, device=device)
    pages = meta.block_tables[seqs, :num_blocks].to(torch.long).reshape(-1)
    keys = torch.arange(num_blocks * page, device=device)
    outside = keys[None, :] >= meta.seq_lens[seqs].to(torch.long)[:, None]  # [Sd, Lk]
    return tokens, pages, outside, outside.reshape(-1).nonzero().squeeze(1)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    outside: torch.Tensor,
    outside_rows: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence, q[Sd, Hq, D], over its pages padded to the longest; each sees its whole context."""
    num_seqs, length = outside.shape
    rows = num_seqs * length
    # [Sd * Lk, Hkv * D]
    k = kv_int8.flat_pages(k_cache, pages, q.dtype).view(rows, -1)
    v = kv_int8.flat_pages(v_cache, pages, q.dtype).view(rows, -1)
    # Padding slots may hold NaN (see _forward_batched): zeroed in the fresh gathers, then masked.
    # Only those rows are written (index_fill_), a fraction of what a full masked_fill_ touches.
    k.index_fill_(0, outside_rows, 0.0)
    v.index_fill_(0, outside_rows, 0.0)
    shape = (num_seqs, length, k_cache.shape[2], q.shape[-1])  # [Sd, Lk, Hkv, D]
    k, v = k.view(shape), v.view(shape)
    mask = ~outside.view(num_seqs, 1, 1, length)  # keys < seq_len
    if q.device.type == "cpu" and q.dtype != torch.float32:
        return _decode_float32(q, k.transpose(1, 2), v.transpose(1, 2), mask, scale)
    # [Sd, Hq, D]
    return _sdpa(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask, scale).squeeze(2)


def _decode_float32(
    q: torch.Tensor,  # [Sd, Hq, D]
    k: torch.Tensor,  # [Sd, Hkv, Lk, D]
    v: torch.Tensor,
    mask: torch.Tensor,  # [Sd, 1, 1, Lk] bool, True: attend
    scale: float,
) -> torch.Tensor:  # [Sd, Hq, D] in q's dtype
    """Decode attention of a bf16 (or float16) cache on a CPU, in float32: scores, softmax and
    sums. Query head h reads KV head h // (Hq / Hkv), as SDPA's `enable_gqa` does.

    NOTE: torch's CPU SDPA on bf16 single-row queries with a mask runs an order of magnitude
    slower than this (docs/design/cpu-decode.md, "bf16 on the CPU").
    """
    num_seqs, num_heads, dim = q.shape
    kv_heads = k.shape[1]
    qg = q.view(num_seqs, kv_heads, num_heads // kv_heads, dim).float()
    scores = torch.matmul(qg, k.float().transpose(-1, -2)).mul_(scale)  # [Sd, Hkv, G, Lk]
    scores.masked_fill_(~mask, float("-inf"))
    out = torch.matmul(scores.softmax(-1), v.float())  # [Sd, Hkv, G, D]
    return out.view(num_seqs, num_heads, dim).to(q.dtype)
