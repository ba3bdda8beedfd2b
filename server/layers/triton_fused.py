"""Fused Triton kernels of the GPU decode step: residual add + RMSNorm, rotary + KV write, SwiGLU.

Each replaces several eager kernels (each a launch and a round trip through HBM) with one, and
rounds where torch's eager ops round, so it computes what the unfused formula computes:

    add_rms_norm   h = x + residual (rounded to the model dtype, as torch's add)
                   out = weight * (float(h) * rsqrt(mean(float(h)^2) + eps)).to(dtype)
    rope_write     q, k rotated (x * cos + rotate_half(x) * sin, each product rounded), k and v
                   written to their KV slots; returns q
    silu_mul       silu(gate).to(dtype) * up, gate and up the halves of one projection's output

Tests run them through Triton's interpreter on a CPU against those formulas. Triton is imported
only when installed; the module itself imports on any machine.
"""

from __future__ import annotations

import importlib.util

import torch

AVAILABLE = importlib.util.find_spec("triton") is not None

if AVAILABLE:  # pragma: no cover - exercised on GPUs and through the interpreter
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        res_out_ptr,
        n,
        eps,
        BLOCK: tl.constexpr,
        HAS_RES: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(x_ptr + row * n + offs, mask=ok, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * n + offs, mask=ok, other=0.0)
            h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(res_out_ptr + row * n + offs, h, mask=ok)
        else:
            h = x
        hf = h.to(tl.float32)
        variance = tl.sum(hf * hf, axis=0) / n
        normed = (hf * tl.math.rsqrt(variance + eps)).to(x.dtype)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0)
        tl.store(
            out_ptr + row * n + offs,
            (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype),
            mask=ok,
        )

    @triton.jit
    def _rope_write_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        slot_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        stride_t,
        num_q_heads,
        num_kv_heads,
        HEAD_DIM: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        d = tl.arange(0, HEAD_DIM)
        half: tl.constexpr = HEAD_DIM // 2
        src = qkv_ptr + tok * stride_t + head * HEAD_DIM
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if head < num_q_heads + num_kv_heads:
            pos = tl.load(pos_ptr + tok).to(tl.int64)
            x = tl.load(src + d)
            other = tl.load(src + (d + half) % HEAD_DIM).to(tl.float32)
            rotated = tl.where(d < half, -other, other)
            c = tl.load(cos_ptr + pos * HEAD_DIM + d).to(tl.float32)
            s = tl.load(sin_ptr + pos * HEAD_DIM + d).to(tl.float32)
            a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
            b = (rotated * s).to(x.dtype).to(tl.float32)
            out = (a + b).to(x.dtype)
            if head < num_q_heads:
                tl.store(q_ptr + (tok * num_q_heads + head) * HEAD_DIM + d, out)
            else:
                kv_head = head - num_q_heads
                tl.store(
                    k_ptr + (slot * num_kv_heads + kv_head) * HEAD_DIM + d,
                    out.to(k_ptr.dtype.element_ty),
                )
        else:
            kv_head = head - num_q_heads - num_kv_heads
            v = tl.load(src + d)
            tl.store(
                v_ptr + (slot * num_kv_heads + kv_head) * HEAD_DIM + d, v.to(v_ptr.dtype.element_ty)
            )

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=ok, other=0.0)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=ok, other=0.0)
        gf = g.to(tl.float32)
        silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(
            out_ptr + row * inter + cols,
            (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype),
            mask=ok,
        )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) for x, residual [T, H]; residual None: no add."""
    rows, n = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    _add_rms_norm_kernel[(rows,)](
        x,
        residual.contiguous() if residual is not None else x,
        weight,
        out,
        summed,
        n,
        eps,
        BLOCK=triton.next_power_of_2(n),
        HAS_RES=residual is not None,
    )
    return out, summed


def rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """q [T, Hq, D] rotated; k rotated and v written into their slots of the caches [P, page, Hkv, D].

    qkv [T, (Hq + 2 Hkv) D] is the fused projection's output; cos/sin the full tables [positions, D]."""
    tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if qkv.stride(1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_write needs rows of qkv and the caches contiguous")
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    _rope_write_kernel[(tokens, num_heads + 2 * num_kv_heads)](
        qkv,
        cos,
        sin,
        positions,
        slot_mapping,
        q,
        k_cache,
        v_cache,
        qkv.stride(0),
        num_heads,
        num_kv_heads,
        HEAD_DIM=head_dim,
    )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] -> [T, I]."""
    rows, width = gate_up.shape
    inter = width // 2
    gate_up = gate_up.contiguous()
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out
