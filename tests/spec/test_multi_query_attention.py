"""Multi-query attention: one sequence's consecutive rows (a verify step's k + 1, a chunk's
tokens) attend in one work item that reads each page once; every row gets the bits it gets
alone, and the dense float64 attention within float32 rounding."""

from __future__ import annotations

import math
import random

import pytest
import torch
from sloserve.layers.attention import kv_int8, paged

pytestmark = pytest.mark.skipif(
    not paged.AVAILABLE, reason="the paged kernel extension is not built"
)


def pages(num_pages: int, page: int, kv_heads: int, dim: int, kind: str, gen: torch.Generator):
    """K or V pages of random values as `kind` (float32, bf16, or int8 rows with scales) and the
    values they hold, as float64."""
    values = torch.randn(num_pages, page, kv_heads, dim, generator=gen)
    if kind == "int8":
        stored = kv_int8.quantize_rows(values)
        return stored, kv_int8.dequantize(stored, torch.float32).double()
    stored = values.to(torch.bfloat16 if kind == "bf16" else torch.float32)
    return stored, stored.double()


def case(runs, *, page, group, dim, kind, seed, kv_heads=2):
    """Rows for runs of (first length, rows) of sequences on shuffled pages: q [R, Hq, D], the
    caches, per-row tables and lengths, and each row's values seen (for the oracle)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil((first + n - 1) / page) for first, n in runs]
    num_pages = sum(needed) + 2
    ids = list(range(num_pages))
    random.Random(seed).shuffle(ids)
    k, k_values = pages(num_pages, page, kv_heads, dim, kind, gen)
    v, v_values = pages(num_pages, page, kv_heads, dim, kind, gen)
    width = max(needed)
    tables, lens, at = [], [], 0
    for (first, n), blocks in zip(runs, needed, strict=True):
        row = ids[at : at + blocks] + [0] * (width - blocks)
        at += blocks
        tables += [row] * n
        lens += range(first, first + n)
    q = torch.randn(len(lens), kv_heads * group, dim, generator=gen)
    tables = torch.tensor(tables, dtype=torch.int32)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32), (k_values, v_values)


def oracle(q, tables, lens, values, scale):
    """Dense float64 attention of each row over positions 0 .. len - 1 of its pages."""
    k_values, v_values = values
    page, group = k_values.shape[1], q.shape[1] // k_values.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(q.shape[0]):
        slots = [(int(tables[r, p // page]), p % page) for p in range(int(lens[r]))]
        k = torch.stack([k_values[b, s] for b, s in slots]).repeat_interleave(group, dim=1)
        v = torch.stack([v_values[b, s] for b, s in slots]).repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,lhd->hl", q[r].double(), k) * scale).softmax(-1)
        out[r] = torch.einsum("hl,lhd->hd", weights, v)
    return out


def row_by_row(q, k, v, tables, lens, scale):
    """Each row alone: the one-row work items."""
    return torch.cat(
        [
            paged.paged_decode(q[r : r + 1], k, v, tables[r : r + 1], lens[r : r + 1], scale)
            for r in range(q.shape[0])
        ]
    )


# (first length, rows): inside a page, ending on a page's last slot, crossing one or several
# page boundaries, a verify step at a long context, more rows than one item takes (16)
RUNS = [(3, 2), (12, 5), (14, 9), (1, 17), (300, 5), (47, 40)]


@pytest.mark.parametrize("kind", ["float32", "bf16", "int8"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("page", [16, 5, 1])
def test_a_runs_rows_get_their_bits_alone_and_the_dense_attention(kind, group, page):
    q, k, v, tables, lens, values = case(
        RUNS, page=page, group=group, dim=32, kind=kind, seed=page * 10 + group
    )
    together = paged.paged_decode(q, k, v, tables, lens, 0.3)
    assert torch.equal(together, row_by_row(q, k, v, tables, lens, 0.3))
    err = (together.double() - oracle(q, tables, lens, values, 0.3)).norm() / together.norm()
    assert err <= 1e-5


@pytest.mark.parametrize("dim", [8, 20, 64, 72])
def test_head_dims_on_and_off_the_vector_width(dim):
    q, k, v, tables, lens, values = case(
        [(9, 7), (30, 3)], page=8, group=2, dim=dim, kind="float32", seed=dim
    )
    together = paged.paged_decode(q, k, v, tables, lens, 0.2)
    assert torch.equal(together, row_by_row(q, k, v, tables, lens, 0.2))
    err = (together.double() - oracle(q, tables, lens, values, 0.2)).norm() / together.norm()
    assert err <= 1e-5


def test_runs_are_cut_where_tables_or_lengths_do_not_continue():
    """Rows that look consecutive but read other pages, or skip a length, and single decodes
    between runs: each row still gets its own bits, on one thread and on several."""
    q, k, v, tables, lens, _ = case(
        [(20, 4), (21, 3), (5, 1), (40, 6)], page=4, group=2, dim=16, kind="bf16", seed=7
    )
    lens[9] += 1  # the last run skips a length: it is two runs
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged.paged_decode(q, k, v, tables, lens, 0.5)
        torch.set_num_threads(max(2, threads))
        many = paged.paged_decode(q, k, v, tables, lens, 0.5)
    finally:
        torch.set_num_threads(threads)
    alone = row_by_row(q, k, v, tables, lens, 0.5)
    assert torch.equal(one, alone) and torch.equal(many, alone)


def test_a_page_outside_the_pool_in_a_runs_last_page_is_refused():
    q, k, v, tables, lens, _ = case([(6, 4)], page=4, group=1, dim=16, kind="float32", seed=3)
    tables[:, 2] = k.shape[0]  # only the run's last row reads page 2
    with pytest.raises(ValueError, match="outside"):
        paged.paged_decode(q, k, v, tables, lens, 0.5)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("context", [1, 6, 37])
def test_the_fused_steps_verify_rows_give_the_logits_of_one_row_a_step(
    tiny_llama, kv_dtype, context
):
    """A verify step's k + 1 rows in one kernel call (one work item per KV head) give the logits
    that computing them one row a call gives (block size 4: rows inside and across pages)."""
    from sloserve.executor import ModelRunner, fused
    from sloserve.sampling_params import SamplingParams
    from sloserve.sched.output import ScheduledSequence

    from tests.executor.conftest import runner_config

    if fused.DecodeKernel is None:
        pytest.skip("the fused decode extension is not built")
    pages = {"kv_cache_dtype": kv_dtype} if kv_dtype else {}
    runner = ModelRunner(runner_config(tiny_llama, max_batch=8, kv_pool_bytes=4 << 20, **pages))
    kernel = runner.decode_step.fused
    assert kernel is not None
    torch.manual_seed(context)
    if runner.kv.dtype == torch.int8:
        values = torch.randn(*runner.kv.shape[:-1], runner.kv.shape[-1] - 2)
        runner.kv.copy_(kv_int8.quantize_rows(values))
    else:
        runner.kv.normal_()
    tokens, greedy = [11, 52, 7, 99, 3, 64], SamplingParams(max_tokens=8)
    table = list(range(1, 2 + (context + len(tokens)) // runner.block_size))
    verify = ScheduledSequence(
        "a", tokens, context, table, True, greedy, num_drafts=len(tokens) - 1
    )
    for threads in (1, 2):
        kernel.threads = threads
        together = kernel.rows(runner.inputs.build_rows([verify]))
        alone = [
            kernel.rows(
                runner.inputs.build_rows(
                    [ScheduledSequence("a", [t], context + i, table, True, greedy)]
                )
            )
            for i, t in enumerate(tokens)
        ]
        # the sampled (last) row, then the rows that score each draft
        assert torch.equal(together, torch.cat(alone[-1:] + alone[:-1])), f"{threads} threads"
