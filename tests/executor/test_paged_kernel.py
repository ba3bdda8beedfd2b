"""The in-place paged decode kernel (Cython + OpenMP): oracle, edges, bad input, batch invariance.

test_backends.py runs it as `sdpa-split-inplace` beside every other backend (edge lengths, GQA
ratios, mixed batches, garbage in unused slots); this file checks what is particular to it.
"""

from __future__ import annotations

import pytest
import torch
from sloserve import hotpath
from sloserve.layers.attention import paged
from sloserve.layers.attention.sdpa import SdpaBackend

from tests.executor.test_backends import LENGTHS, PAGE, RATIOS, make_case, oracle, rel_err

pytestmark = pytest.mark.skipif(
    not paged.AVAILABLE, reason="the paged kernel extension is not built"
)


def test_compiled_kernel_ships_with_the_extensions():
    """Built extensions mean the kernel is in use (a missing .so would silently fall back to the gather)."""
    assert paged.AVAILABLE == hotpath.USING_EXTENSIONS


@pytest.mark.parametrize("ratio", RATIOS)
def test_decode_batch_at_every_edge_length_matches_oracle(ratio):
    chunks = [(n - 1, 1) for n in LENGTHS] + [(0, 1), (PAGE - 1, 1)]
    q, k, v, meta, scale = make_case(chunks, ratio, seed=ratio)
    out = paged.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, scale)
    ref = oracle(q, k, v, meta, scale)
    for i in range(len(chunks)):
        assert rel_err(out[i : i + 1], ref[i : i + 1]) <= 1e-5


def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch():
    chunks = [(n - 1, 1) for n in LENGTHS]
    q, k, v, meta, scale = make_case(chunks, 4, seed=5)
    batched = paged.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, scale)
    for i in range(len(chunks)):
        alone = paged.paged_decode(
            q[i : i + 1], k, v, meta.block_tables[i : i + 1], meta.seq_lens[i : i + 1], scale
        )
        assert torch.equal(alone, batched[i : i + 1])


def test_thread_count_does_not_change_the_result():
    q, k, v, meta, scale = make_case([(n - 1, 1) for n in LENGTHS] * 3, 8, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, scale)
        torch.set_num_threads(max(2, threads))
        many = paged.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_matches_the_gather_path_on_a_decode_step():
    q, k, v, meta, scale = make_case([(n - 1, 1) for n in LENGTHS], 4, seed=9)
    inplace = SdpaBackend(batched=False, inplace=True).forward(q, k, v, meta, scale)
    gather = SdpaBackend(batched=False, inplace=False).forward(q, k, v, meta, scale)
    torch.testing.assert_close(inplace, gather, rtol=1e-5, atol=1e-6)


def test_rejects_pages_outside_the_pool_and_lengths_past_the_table():
    q, k, v, meta, scale = make_case([(PAGE + 2, 1)], 1, seed=1)
    tables = meta.block_tables.clone()
    tables[0, 1] = k.shape[0]
    with pytest.raises(ValueError, match="outside"):
        paged.paged_decode(q, k, v, tables, meta.seq_lens, scale)
    too_long = torch.tensor([tables.shape[1] * PAGE + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="length"):
        paged.paged_decode(q, k, v, meta.block_tables, too_long, scale)
    with pytest.raises(ValueError, match="float32"):
        paged.paged_decode(
            q.double(), k.double(), v.double(), meta.block_tables, meta.seq_lens, scale
        )


def test_sdpa_uses_the_kernel_only_where_it_can_run():
    q, k, v, _meta, _scale = make_case([(3, 1)], 1, seed=1)
    assert paged.supports(q, k)
    assert paged.supports(q.to(torch.bfloat16), k.to(torch.bfloat16))
    assert not paged.supports(q.to(torch.float16), k.to(torch.float16))


@pytest.mark.parametrize("head_dim", [12, 64])
def test_bf16_pages_give_the_float32_kernels_bits_on_the_widened_pages(head_dim):
    """A bf16 page is widened exactly in registers and everything else is the float32 kernel's
    arithmetic: the same bits as the float32 kernel on the pages widened, rounded to q's dtype."""
    gen = torch.Generator().manual_seed(head_dim)
    lens = torch.tensor([1, PAGE + 3, 3 * PAGE], dtype=torch.int32)
    tables = torch.tensor([[5, 0, 0], [3, 1, 0], [4, 2, 6]], dtype=torch.int32)
    k = torch.randn(7, PAGE, 2, head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(7, PAGE, 2, head_dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(3, 4, head_dim, generator=gen)
    want = paged.paged_decode(q, k.float(), v.float(), tables, lens, head_dim**-0.5)
    assert torch.equal(paged.paged_decode(q, k, v, tables, lens, head_dim**-0.5), want)
    low = q.to(torch.bfloat16)
    got = paged.paged_decode(low, k, v, tables, lens, head_dim**-0.5)
    want = paged.paged_decode(low.float(), k.float(), v.float(), tables, lens, head_dim**-0.5)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))


# below, between and above the kernel's 8 vector lanes
@pytest.mark.parametrize("head_dim", [4, 12, 128])
def test_head_dims_that_are_not_a_multiple_of_the_vector_width(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    pages = [[3, 1], [2], [4, 5, 6]]
    lens = torch.tensor([PAGE + 3, 1, 3 * PAGE], dtype=torch.int32)
    tables = torch.tensor([p + [0] * (3 - len(p)) for p in pages], dtype=torch.int32)
    k = torch.randn(7, PAGE, 2, head_dim, generator=gen)
    v = torch.randn(7, PAGE, 2, head_dim, generator=gen)
    q = torch.randn(3, 4, head_dim, generator=gen)
    out = paged.paged_decode(q, k, v, tables, lens, head_dim**-0.5)
    for i, table in enumerate(pages):
        keys = k[table].flatten(0, 1)[: lens[i]].double().repeat_interleave(2, dim=1)  # [L, Hq, D]
        vals = v[table].flatten(0, 1)[: lens[i]].double().repeat_interleave(2, dim=1)
        probs = (torch.einsum("hd,lhd->hl", q[i].double(), keys) * head_dim**-0.5).softmax(-1)
        torch.testing.assert_close(
            out[i].double(), torch.einsum("hl,lhd->hd", probs, vals), rtol=1e-5, atol=1e-6
        )


def test_sharp_softmax_stays_finite_and_exact():
    """Scores hundreds apart: the kernel's exp underflows to 0 exactly where float64 is ~0."""
    q, k, v, meta, scale = make_case([(n - 1, 1) for n in LENGTHS], 4, seed=4)
    out = paged.paged_decode(q * 300.0, k, v, meta.block_tables, meta.seq_lens, scale)
    assert torch.isfinite(out).all()
    assert rel_err(out, oracle(q * 300.0, k, v, meta, scale)) <= 1e-5
