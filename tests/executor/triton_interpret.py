"""Run by test_triton_interpret.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads):
the Triton kernels on a CPU, through Triton's interpreter. Prints one JSON object of results."""

from __future__ import annotations

import functools
import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
from sloserve.layers.attention import AttentionMetadata, ReferenceBackend  # noqa: E402
from sloserve.layers.attention.triton_decode import TritonDecodeBackend  # noqa: E402


def paged(lens: list[int], page: int, heads: int, kv_heads: int, dim: int, seed: int = 0):
    """Caches with each sequence's pages scattered, its tables, and one query per sequence."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in lens]
    order = torch.randperm(sum(need), generator=gen).add(1).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    k = torch.randn(sum(need) + 1, page, kv_heads, dim, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    return q, k, v, tables


def attention(splits: int | None, sm_count: int) -> float:
    """Largest |triton - reference| over decode and mixed batches, forward and the capturable decode."""
    page, heads, kv_heads, dim = 4, 4, 2, 16
    backend = TritonDecodeBackend(block_n=16, num_splits=splits)
    backend._sm_count = sm_count  # no CUDA device to ask
    worst = 0.0
    lens = [1, 3, 4, 5, 17, 70]
    q, k, v, tables = paged(lens, page, heads, kv_heads, dim)
    scale = dim**-0.5
    meta = AttentionMetadata.build([1] * len(lens), [n - 1 for n in lens], tables, page, "cpu")
    ref = ReferenceBackend().forward(q, k, v, meta, scale)
    worst = max(worst, (backend.forward(q, k, v, meta, scale) - ref).abs().max().item())
    # the capturable decode: writes the new K/V itself, reads fixed-width tables
    width = max(len(t) for t in tables) + 2
    table_rows = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table_rows[i, : len(t)] = torch.tensor(t)
    pos = torch.tensor([n - 1 for n in lens])
    slots = table_rows[torch.arange(len(lens)), pos // page].long() * page + pos % page
    new_k, new_v = (
        k.view(-1, kv_heads, dim)[slots].clone(),
        v.view(-1, kv_heads, dim)[slots].clone(),
    )
    k2, v2 = k.clone(), v.clone()
    k2.view(-1, kv_heads, dim)[slots] = 0
    v2.view(-1, kv_heads, dim)[slots] = 0
    got = backend.decode(q, new_k, new_v, k2, v2, slots, table_rows, (pos + 1).int(), scale)
    worst = max(worst, (got - ref).abs().max().item())
    # mixed: prefill chunks beside decodes
    chunks = [(0, 5), (3, 1), (8, 9)]
    lens2 = [s + n for s, n in chunks]
    q2, k3, v3, tables2 = paged(lens2, page, heads, kv_heads, dim, seed=1)
    q2 = torch.randn(sum(n for _, n in chunks), heads, dim)
    meta2 = AttentionMetadata.build(
        [n for _, n in chunks], [s for s, _ in chunks], tables2, page, "cpu"
    )
    ref2 = ReferenceBackend().forward(q2, k3, v3, meta2, scale)
    worst = max(worst, (backend.forward(q2, k3, v3, meta2, scale) - ref2).abs().max().item())
    return worst


def fused() -> dict:
    """Largest difference of each fused kernel from the unfused torch formula, float32 and bfloat16."""
    from sloserve.layers import triton_fused as tf
    from sloserve.layers.norm import rms_norm
    from sloserve.layers.rope import apply_rope

    out = {}
    gen = torch.Generator().manual_seed(0)

    # relative to the reference's largest value
    def err(got: torch.Tensor, want: torch.Tensor) -> float:
        return (
            (got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)
        ).item()

    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        x = torch.randn(5, 48, generator=gen).to(dtype)
        res = torch.randn(5, 48, generator=gen).to(dtype)
        w = (1 + 0.1 * torch.randn(48, generator=gen)).to(dtype)
        normed, summed = tf.add_rms_norm(x, res, w, 1e-6)
        ref_sum = res + x
        out[f"add_rms_norm.sum.{name}"] = err(summed, ref_sum)
        out[f"add_rms_norm.norm.{name}"] = err(normed, rms_norm(ref_sum, w, 1e-6))
        alone, same = tf.add_rms_norm(x, None, w, 1e-6)
        out[f"rms_norm.{name}"] = err(alone, rms_norm(x, w, 1e-6))
        out[f"rms_norm.passes_x.{name}"] = float(same.data_ptr() != x.data_ptr())
        heads, kv_heads, dim, page = 4, 2, 16, 4
        qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
        cos_t = torch.randn(32, dim, generator=gen).to(dtype)
        sin_t = torch.randn(32, dim, generator=gen).to(dtype)
        pos = torch.tensor([0, 7, 30])
        slots = torch.tensor([5, 17, 2])
        k_cache = torch.zeros(6, page, kv_heads, dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        q = tf.rope_write(qkv, cos_t, sin_t, pos, slots, k_cache, v_cache, heads)
        qk = apply_rope(
            qkv[:, : (heads + kv_heads) * dim].reshape(3, heads + kv_heads, dim),
            cos_t[pos],
            sin_t[pos],
        )
        v = qkv[:, (heads + kv_heads) * dim :].reshape(3, kv_heads, dim)
        out[f"rope.q.{name}"] = err(q, qk[:, :heads])
        out[f"rope.k.{name}"] = err(k_cache.view(-1, kv_heads, dim)[slots], qk[:, heads:])
        out[f"rope.v.{name}"] = err(v_cache.view(-1, kv_heads, dim)[slots], v)
        untouched = torch.ones(k_cache.view(-1, kv_heads, dim).shape[0], dtype=torch.bool)
        untouched[slots] = False
        out[f"rope.elsewhere.{name}"] = (
            k_cache.view(-1, kv_heads, dim)[untouched].abs().max().item()
        )
        gate_up = torch.randn(3, 2 * 40, generator=gen).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
        out[f"silu_mul.{name}"] = err(tf.silu_mul(gate_up), ref)
    return out


def model(folder: str, fused_kernels: bool = False) -> dict:
    """A tiny Llama's greedy tokens through GraphDecode with the Triton decode attention, and transformers'."""
    from sloserve.executor import ModelRunner
    from sloserve.executor.graphs import EagerCapture, GraphDecode

    from tests.checkpoints import hf_greedy, load_hf_model
    from tests.executor.conftest import runner_config
    from tests.executor.driver import generate

    runner = ModelRunner(runner_config(folder, backend="sdpa", max_batch=4))
    backend = TritonDecodeBackend(block_n=16)
    backend._sm_count = 8  # no CUDA device to ask: 16 programs fill it, fewer split their keys
    forward = (
        functools.partial(runner.model.decode_fused, attend=backend.attend_decode)
        if fused_kernels
        else functools.partial(runner.model.decode, attend=backend.decode)
    )
    runner.decode_step = GraphDecode(runner.model, runner.kv, 4, forward, EagerCapture())
    runner.warmup()
    prompts = [
        [256, 72, 101, 108, 108, 111],
        [256] + list(range(48, 66)),
        [256] + [(i * 37) % 250 for i in range(37)],
    ]
    return {
        "sloserve": generate(runner, prompts, 5, stagger=True),
        "transformers": hf_greedy(load_hf_model(folder), prompts, 5),
    }


def main() -> None:
    which = sys.argv[1]
    if which == "attention":
        out = {
            f"splits={s},sm={sm}": attention(s, sm)
            for s, sm in ((1, 4), (3, 4), (8, 4), (None, 64))
        }
    elif which == "fused":
        out = fused()
    elif which == "model":
        out = model(sys.argv[2], fused_kernels=sys.argv[3:] == ["fused"])
    else:
        raise SystemExit(f"unknown check {which!r}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
