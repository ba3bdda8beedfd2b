"""Metadata building, write_kv and the reference paged attention against dense causal attention."""

from __future__ import annotations

import random

import pytest
import torch
from sloserve.layers.attention import AttentionMetadata, get_backend, write_kv

from tests.executor.conftest import CPU_AUTO_BACKEND

PAGE = 4


def _dense(q, k, v, start, scale):
    """Plain causal attention for one sequence: q[n,Hq,D], k/v[L,Hkv,D], query j sees keys <= start+j."""
    n, hq, _ = q.shape
    rep = hq // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    mask = torch.arange(k.shape[0])[None, :] > (torch.arange(n) + start)[:, None]
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def _run(chunks, hq, hkv, dim=8, seed=0):
    """chunks: list of (context_len, new_len). Pages shuffled. Returns (backend out, dense out)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_pages = 1 + sum((c + n + PAGE - 1) // PAGE for c, n in chunks)
    page_ids = list(range(1, num_pages))
    rng.shuffle(page_ids)
    k_cache = torch.zeros(num_pages, PAGE, hkv, dim)
    v_cache = torch.zeros_like(k_cache)
    tables, full_k, full_v = [], [], []
    for ctx, new in chunks:
        need = (ctx + new + PAGE - 1) // PAGE
        tables.append([page_ids.pop() for _ in range(need)])
        full_k.append(torch.randn(ctx + new, hkv, dim, generator=gen))
        full_v.append(torch.randn(ctx + new, hkv, dim, generator=gen))
    # context tokens written earlier, one metadata for them
    meta_ctx = AttentionMetadata.build([c for c, _ in chunks], [0] * len(chunks), tables, PAGE)
    write_kv(
        k_cache,
        v_cache,
        torch.cat([k[:c] for k, (c, _) in zip(full_k, chunks, strict=True)]),
        torch.cat([v[:c] for v, (c, _) in zip(full_v, chunks, strict=True)]),
        meta_ctx.slot_mapping,
    )
    meta = AttentionMetadata.build([n for _, n in chunks], [c for c, _ in chunks], tables, PAGE)
    write_kv(
        k_cache,
        v_cache,
        torch.cat([k[c:] for k, (c, _) in zip(full_k, chunks, strict=True)]),
        torch.cat([v[c:] for v, (c, _) in zip(full_v, chunks, strict=True)]),
        meta.slot_mapping,
    )
    q = torch.randn(meta.num_tokens, hq, dim, generator=gen)
    out = get_backend("reference", "cpu").forward(q, k_cache, v_cache, meta, dim**-0.5)
    expected = torch.cat(
        [
            _dense(q[lo:hi], full_k[i], full_v[i], chunks[i][0], dim**-0.5)
            for i, (lo, hi) in enumerate(
                zip(meta.cu_seqlens_q_list, meta.cu_seqlens_q_list[1:], strict=False)
            )
        ]
    )
    return out, expected


LENGTHS = [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 5]


@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_matches_dense(length, ratio):
    out, expected = _run([(0, length), (2, length)], hq=8, hkv=8 // ratio)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_decode_batch_matches_dense(ratio):
    out, expected = _run([(length, 1) for length in LENGTHS], hq=8, hkv=8 // ratio)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_mixed_prefill_chunks_and_decode():
    out, expected = _run([(0, 9), (7, 1), (5, 6), (12, 1), (0, 1)], hq=4, hkv=2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_metadata_slots_positions_and_padding():
    meta = AttentionMetadata.build([3, 1], [0, 5], [[7, 2], [4, 9]], block_size=4)
    assert meta.cu_seqlens_q_list == [0, 3, 4] and meta.seq_lens_list == [3, 6]
    assert meta.slot_mapping.tolist() == [28, 29, 30, 9 * 4 + 1]
    assert meta.max_seqlen_q == 3 and meta.max_seqlen_k == 6 and not meta.decode_only
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64


def test_metadata_rejects_a_short_block_table():
    with pytest.raises(ValueError, match="needs 2 KV blocks"):
        AttentionMetadata.build([5], [0], [[1]], block_size=4)


def test_unknown_backend_name_lists_choices():
    with pytest.raises(ValueError, match="choose one of: auto, reference"):
        get_backend("fastest", "cpu")


def test_auto_on_cpu_is_sdpa():
    """Pinned: a change of the CPU default must change this test (and the README) on purpose."""
    assert get_backend("auto", "cpu").name == CPU_AUTO_BACKEND == "sdpa"
    assert get_backend("auto", "cpu", dtype=torch.bfloat16, block_size=4, head_dim=8).name == "sdpa"


def test_registry_lists_exactly_the_backends_the_config_accepts():
    from sloserve.config import ModelConfig
    from sloserve.layers.attention import _REGISTRY

    for name in _REGISTRY:
        ModelConfig(path="default", attention_backend=name)  # raises for a name config refuses
    assert set(_REGISTRY) == {"reference", "sdpa", "flash", "triton"}
