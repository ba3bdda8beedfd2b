"""One decoder-only transformer for all four families, over a flat token batch and paged KV.

Per layer (as transformers computes it)::

    h = h + o_proj(attention(rope(q), rope(k), v))        with x = rms_norm(h) feeding q, k, v
    h = h + mlp(rms_norm(h))                              dense SwiGLU, or routed experts
                                                          (+ sigmoid-gated shared expert: Qwen2-MoE)

Only the rows that are sampled go through the final norm and the LM head.

`decode` is the decode-only step of a dense model on the in-place paged kernel: plain tensors in
(no metadata object, no Python lists), one function that reads the same eager or under
torch.compile (the runner compiles it with the kernel as one opaque custom operator).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from sloserve.layers import triton_fused
from sloserve.layers.attention import AttentionBackend, AttentionMetadata, write_kv
from sloserve.layers.attention.paged import write_and_attend
from sloserve.layers.moe import ExpertStore, moe_forward
from sloserve.layers.norm import rms_norm
from sloserve.layers.rope import RopeRows, rope_tables
from sloserve.models.spec import ModelSpec
from sloserve.models.weights import LayerWeights, ModelWeights

if TYPE_CHECKING:
    from sloserve.lora import LoraBatch


class DecoderModel:
    """Weights + the forward pass; holds no per-request state."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: ModelWeights,
        backend: AttentionBackend,
        experts: ExpertStore | None,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`reduce` completes a tensor-parallel rank's partial sums (an all-reduce after the o and
        down projections, see models/shard.py); None on a single rank. Each projection in
        `weights` runs its own kernel (layers/linear.py)."""
        if spec.moe_layers and experts is None:
            raise ValueError(f"{spec.architecture} has MoE layers: an ExpertStore is required")
        self.spec = spec
        self.weights = weights
        self.backend = backend
        self.experts = experts
        self.dtype = dtype
        self.scale = spec.head_dim**-0.5
        self.cos, self.sin = rope_tables(spec.rope, spec.head_dim, max_positions, device, dtype)
        self._split = [spec.q_size + spec.kv_size, spec.kv_size]
        self.reduce = reduce or _whole
        self.sharded = reduce is not None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv: torch.Tensor,  # [L, 2, P, page, Hkv, D]
        sample_idx: torch.Tensor,  # [S'] int64, rows whose logits are wanted
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # [S', V] float32
        """The logits of the sampled rows; `lora` adds each row group's adapter deltas."""

        def attention(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = kv[i, 0], kv[i, 1]
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            return self.backend.forward(q, k_cache, v_cache, meta, self.scale)

        h = self._layers(input_ids, positions, attention, self._moe, lora)
        h = rms_norm(h.index_select(0, sample_idx), self.weights.norm, self.spec.rms_norm_eps)
        if lora is not None:
            return lora.head(h, sample_idx, self.weights.lm_head).float()
        return self.weights.lm_head(h).float()

    def decode(
        self,
        input_ids: torch.Tensor,  # [B] int64, one token per sequence
        positions: torch.Tensor,  # [B] int64
        slot_mapping: torch.Tensor,  # [B] int64
        block_tables: torch.Tensor,  # [B, W] int32
        seq_lens: torch.Tensor,  # [B] int32, positions + 1
        kv: torch.Tensor,  # [L, 2, P, page, Hkv, D]
        attend: Callable[..., torch.Tensor] = write_and_attend,
    ) -> torch.Tensor:  # [B, V] float32
        """A decode step: every row is sampled; attention reads the pages in place.

        MoE layers route through the expert store as in `forward` (under torch.compile they run
        eagerly between the compiled regions: routing decides shapes and residency on the host).
        """

        def attention(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attend(
                q, k, v, kv[i, 0], kv[i, 1], slot_mapping, block_tables, seq_lens, self.scale
            )

        h = self._layers(input_ids, positions, attention, self._eager_moe)
        return self.weights.lm_head(rms_norm(h, self.weights.norm, self.spec.rms_norm_eps)).float()

    def _layers(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attention: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        moe: Callable[[int, LayerWeights, torch.Tensor], torch.Tensor],
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # [T, H], before the final norm
        """Every layer over the embedded tokens; `attention(i, q, k, v)` writes layer i's K/V
        and attends ([T, Hq, D] out), `moe` runs a routed MLP, `lora` (dense layers) adds the
        adapters' deltas after each base projection."""
        spec, w = self.spec, self.weights
        num_tokens = input_ids.shape[0]
        heads = spec.num_heads + spec.num_kv_heads
        h = w.embedding(input_ids, self.dtype)  # [T, H]
        if lora is not None:
            h = lora.embed(input_ids, h)
        rope = RopeRows.gather(self.cos, self.sin, positions)  # shared by every layer
        for i, layer in enumerate(w.layers):
            x = rms_norm(h, layer.ln1, spec.rms_norm_eps)
            qkv = layer.qkv(x)
            if lora is not None:
                qkv = lora.apply(i, "qkv", x, qkv)
            qk, v = qkv.split(self._split, dim=-1)
            # q and k rotated together
            qk = rope.rotate(qk.view(num_tokens, heads, spec.head_dim))
            q, k = qk[:, : spec.num_heads], qk[:, spec.num_heads :]
            v = v.reshape(num_tokens, spec.num_kv_heads, spec.head_dim)
            attn = attention(i, q, k, v)
            attn = attn.reshape(num_tokens, -1)
            o = layer.o(attn)
            if lora is not None:
                o = lora.apply(i, "o", attn, o)
            h = h + self.reduce(o)
            x = rms_norm(h, layer.ln2, spec.rms_norm_eps)
            if layer.router is not None:
                h = h + self.reduce(moe(i, layer, x))
            else:
                h = h + self.reduce(
                    _mlp(layer, x) if lora is None else _lora_mlp(layer, x, i, lora)
                )
        return h

    def decode_fused(
        self,
        input_ids: torch.Tensor,  # [B] int64, one token per sequence
        positions: torch.Tensor,  # [B] int64
        slot_mapping: torch.Tensor,  # [B] int64
        block_tables: torch.Tensor,  # [B, W] int32
        seq_lens: torch.Tensor,  # [B] int32, positions + 1
        kv: torch.Tensor,  # [L, 2, P, page, Hkv, D]
        # (q, k_cache, v_cache, block_tables, seq_lens, scale): reads only
        attend: Callable[..., torch.Tensor],
    ) -> torch.Tensor:  # [B, V] float32
        """`decode` of a dense model on the fused Triton kernels (layers/triton_fused.py): per layer
        four matmuls, attention and three fused kernels (residual + norm twice, rotary + KV write,
        SwiGLU), the residual added inside the next norm."""
        spec, w, eps = self.spec, self.weights, self.spec.rms_norm_eps
        batch = input_ids.shape[0]
        h = w.embedding(input_ids, self.dtype)  # [B, H], the residual stream
        delta = None  # what the last sublayer adds to h (added inside the next norm)
        for i, layer in enumerate(w.layers):
            x, h = triton_fused.add_rms_norm(
                h if delta is None else delta, None if delta is None else h, layer.ln1, eps
            )
            qkv = layer.qkv(x)
            k_cache, v_cache = kv[i, 0], kv[i, 1]
            q = triton_fused.rope_write(
                qkv, self.cos, self.sin, positions, slot_mapping, k_cache, v_cache, spec.num_heads
            )
            attn = attend(q, k_cache, v_cache, block_tables, seq_lens, self.scale)
            delta = layer.o(attn.reshape(batch, -1))
            x, h = triton_fused.add_rms_norm(delta, h, layer.ln2, eps)
            delta = layer.down(triton_fused.silu_mul(layer.gate_up(x)))
        x, _ = triton_fused.add_rms_norm(delta, h, w.norm, eps)
        return w.lm_head(x).float()

    @torch.compiler.disable
    def _eager_moe(self, i: int, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """`_moe`, never traced: a compiled decode step breaks its graph here."""
        return self._moe(i, layer, x)

    def _moe(self, i: int, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        router_logits = layer.router(x)  # [T, E]
        out = moe_forward(x, router_logits, self.experts, i, self.spec.top_k, self.spec.renormalize)
        if layer.shared_gate is not None:
            out = out + torch.sigmoid(layer.shared_gate(x)) * _mlp(layer, x)
        return out


def _whole(x: torch.Tensor) -> torch.Tensor:
    """One rank holds the whole model: its sums are complete."""
    return x


def _lora_mlp(layer: LayerWeights, x: torch.Tensor, i: int, lora: LoraBatch) -> torch.Tensor:
    """`_mlp` with the adapters' deltas added to gate_up and down of layer i."""
    gate, up = lora.apply(i, "gate_up", x, layer.gate_up(x)).chunk(2, dim=-1)
    act = F.silu(gate) * up
    return lora.apply(i, "down", act, layer.down(act))


def _mlp(layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate and up fused in one matmul."""
    gate, up = layer.gate_up(x).chunk(2, dim=-1)
    return layer.down(F.silu(gate) * up)
