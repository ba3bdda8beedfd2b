"""A Triton paged-attention kernel for GPUs: one program per (query token, KV head).

Each program loads the GROUP query heads that share one KV head (padded to 16 rows for
`tl.dot`), walks that sequence's pages through the block table in BLOCK_N-key tiles with an
online softmax, and writes GROUP output rows. Query token t of sequence i sits at position
p = start_pos[i] + (t - cu_seqlens_q[i]) and sees keys 0..p (causal, bottom-right), so the
same kernel serves decode tokens and prefill chunks in one launch; it is built for decode,
where every token's keys are read once. When tokens x KV heads are too few to fill the GPU
(batch 1, long context), each program takes one slice of the keys and a small torch combine
merges the slices' softmax partials (flash-decoding). Triton is imported only when installed;
the module itself imports on any machine.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from sloserve.layers.attention.base import CapturableDecode, check_heads
from sloserve.layers.attention.metadata import AttentionMetadata

_HAS_TRITON = importlib.util.find_spec("triton") is not None

if _HAS_TRITON:  # pragma: no cover - GPU machines only
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        tables_ptr,
        seq_ptr,
        pos_ptr,
        part_m_ptr,
        part_l_ptr,
        part_acc_ptr,
        scale,
        num_heads,
        num_splits,
        stride_qt,
        stride_qh,
        stride_kp,
        stride_ks,
        stride_kh,
        stride_vp,
        stride_vs,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_tb,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        seq = tl.load(seq_ptr + tok).to(tl.int64)
        n_keys = tl.load(pos_ptr + tok).to(tl.int32) + 1
        # each token splits its own keys evenly (whole tiles), so every split of a long context
        # works whatever the batch's longest one; this program's keys: lo .. n_keys-1
        per_split = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
        lo = split * per_split
        n_keys = tl.minimum(n_keys, lo + per_split)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        g_ok = g < GROUP
        heads = kv_head * GROUP + g
        q = tl.load(
            q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=g_ok[:, None],
            other=0.0,
        )
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(lo, n_keys, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            k_ok = offs < n_keys
            page = tl.load(tables_ptr + seq * stride_tb + offs // PAGE, mask=k_ok, other=0).to(
                tl.int64
            )
            within = (offs % PAGE).to(tl.int64)
            k = tl.load(
                k_ptr
                + page[:, None] * stride_kp
                + within[:, None] * stride_ks
                + kv_head * stride_kh
                + d[None, :],
                mask=k_ok[:, None],
                other=0.0,
            )
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(k_ok[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_ptr
                + page[:, None] * stride_vp
                + within[:, None] * stride_vs
                + kv_head * stride_vh
                + d[None, :],
                mask=k_ok[:, None],
                other=0.0,
            )
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLIT:  # unnormalised partials; an empty split stores m = -inf, l = 0, acc = 0
            row = (tok * num_heads + heads) * num_splits + split
            tl.store(part_m_ptr + row, m_i, mask=g_ok)
            tl.store(part_l_ptr + row, l_i, mask=g_ok)
            tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None])
        else:
            out = acc / l_i[:, None]
            tl.store(
                out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=g_ok[:, None],
            )


class TritonDecodeBackend(CapturableDecode):
    """The Triton paged kernel above; CUDA + triton only, head_dim a power of two in 16..256.

    `decode` is CapturableDecode's: write the step's K/V, then `attend_decode`.
    """

    name = "triton"

    def __init__(
        self, block_n: int | None = None, num_warps: int = 4, num_splits: int | None = None
    ) -> None:
        if not _HAS_TRITON:
            raise RuntimeError(
                "the 'triton' attention backend needs the triton package and a CUDA GPU; "
                "use --attention-backend sdpa instead"
            )
        self.block_n = block_n
        self.num_warps = num_warps
        self.num_splits = num_splits  # None: split long contexts when too few programs fill the GPU
        self._sm_count: int | None = None

    def _splits(self, programs: int, max_keys: int, block_n: int, device: torch.device) -> int:
        """Key splits per (token, KV head): enough programs for ~2 waves over the SMs (flash-decoding)."""
        if self.num_splits is not None:
            return max(1, self.num_splits)
        if self._sm_count is None:
            self._sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        target = 2 * self._sm_count
        if programs >= target:
            return 1
        return max(1, min(-(-target // programs), max_keys // (4 * block_n)))

    @staticmethod
    def unavailable_reason(
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        block_size: int | None = None,
        head_dim: int | None = None,
    ) -> str | None:
        """Why the Triton kernel cannot run with these settings, or None when it can."""
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            return "the Triton paged kernel needs a CUDA device"
        if not _HAS_TRITON:
            return "triton is not installed"
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"the Triton paged kernel supports float16, bfloat16 and float32, not {dtype}"
        if head_dim is not None and (head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1)):
            return (
                f"the Triton paged kernel needs head_dim a power of two in 16..256, got {head_dim}"
            )
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
        num_tokens = q.shape[0]
        _check(q, k_cache, v_cache)
        if num_tokens == 0:
            return torch.empty_like(q)
        seq_of_token, row = meta.token_rows(q)
        positions = meta.start_pos.to(torch.long)[seq_of_token] + row
        return self._attend(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            seq_of_token,
            positions,
            meta.max_seqlen_k,
            scale,
        )

    def attend_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """`decode` without the write (the fused rotary kernel has written the new K/V already)."""
        _check(q, k_cache, v_cache)
        rows = torch.arange(q.shape[0], device=q.device)
        return self._attend(
            q,
            k_cache,
            v_cache,
            block_tables,
            rows,
            seq_lens - 1,
            block_tables.shape[1] * k_cache.shape[1],
            scale,
        )

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        seq_of_token: torch.Tensor,
        positions: torch.Tensor,
        max_keys: int,
        scale: float,
    ) -> torch.Tensor:
        """One launch over (token, KV head, split); splits > 1 are merged by their softmax partials."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
        q = q.contiguous()
        out = torch.empty_like(q)
        group = num_heads // num_kv_heads
        block_n = self.block_n or (64 if head_dim <= 128 else 32)
        splits = self._splits(num_tokens * num_kv_heads, max_keys, block_n, q.device)
        if splits > 1:
            part_m = torch.empty(
                num_tokens, num_heads, splits, dtype=torch.float32, device=q.device
            )
            part_l = torch.empty_like(part_m)
            part_acc = torch.empty(
                num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=q.device
            )
        else:
            part_m = part_l = part_acc = out  # unused
        _paged_attention_kernel[(num_tokens, num_kv_heads, splits)](
            q,
            k_cache,
            v_cache,
            out,
            tables,
            seq_of_token,
            positions,
            part_m,
            part_l,
            part_acc,
            scale,
            num_heads,
            splits,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            out.stride(0),
            out.stride(1),
            tables.stride(0),
            GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim,
            PAGE=page,
            BLOCK_N=block_n,
            IEEE=q.dtype == torch.float32,
            SPLIT=splits > 1,
            num_warps=self.num_warps,
        )
        if splits == 1:
            return out
        # Combine the splits' online-softmax partials: rescale each to the common max (an empty
        # split has m = -inf and weighs 0; split 0 of every token holds at least one key).
        weight = torch.exp(part_m - part_m.amax(dim=-1, keepdim=True))  # [T, Hq, splits]
        total = (part_l * weight).sum(dim=-1, keepdim=True)  # [T, Hq, 1]
        combined = (part_acc * weight.unsqueeze(-1)).sum(dim=-2) / total
        return out.copy_(combined)


def _interpreted() -> bool:
    """Triton's CPU interpreter is on (TRITON_INTERPRET=1: the kernels' tests on a machine without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if not q.is_cuda and not _interpreted():
        raise ValueError(
            "the Triton paged kernel runs on CUDA tensors only; use the sdpa backend on CPU"
        )
    check_heads(q, k_cache)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV caches must be contiguous in head_dim")
