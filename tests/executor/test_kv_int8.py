"""int8 KV pages (--kv-cache-dtype int8): the row round trip, the in-place kernel against the same
pages dequantized, greedy agreement with float32 pages, page bytes, prefix reuse and swap
preemption, tensor parallelism, and the flag's errors.

The oracle for tokens is teacher-forced top-1 agreement with the same runner on float32 pages:
int8 rounds every K and V value (at most half a step of absmax / 127 of its row), so a near-tie
of these tiny random models can go either way.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from sloserve.config import CacheConfig, ConfigError, ModelConfig, ParallelConfig, SloserveConfig
from sloserve.executor import fused
from sloserve.executor import plan as plan_module
from sloserve.executor.precision import bf16_units
from sloserve.layers.attention import kv_int8, paged
from sloserve.layers.attention.reference import ReferenceBackend
from sloserve.layers.attention.sdpa import SdpaBackend
from sloserve.llm import LLM
from sloserve.models.spec import load_spec
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence

from tests.executor.conftest import runner_config
from tests.executor.driver import generate
from tests.executor.test_backends import make_case

_RNG = random.Random(0)
PROMPTS = [[256] + [_RNG.randrange(256) for _ in range(_RNG.randrange(1, 60))] for _ in range(8)]
NEW_TOKENS = 40  # 320 positions in all
# NOTE: measured 97.8-98.8 % on these hidden-64 models (llama, qwen2, mixtral, qwen2_moe)
AGREEMENT_FLOOR = 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_within_half_a_step_of_each_rows_absmax(dtype):
    torch.manual_seed(0)
    x = (torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]).to(dtype)
    x[7, 1] = 0.0
    rows = kv_int8.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, kv_int8.row_bytes(64))
    back = kv_int8.dequantize(rows, torch.float32)
    absmax = x.float().abs().amax(-1, keepdim=True)
    # half a step of the scale rounded to bf16 (8 significant bits)
    assert ((back - x.float()).abs() <= absmax / 254 * (1 + 2**-7)).all()
    assert (back[7, 1] == 0).all()
    assert kv_int8.dequantize(rows, dtype).dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_written_in_c_are_the_bytes_torch_writes(monkeypatch, dtype):
    torch.manual_seed(2)
    x = (torch.randn(9, 2, 64) * torch.logspace(-4, 4, 9)[:, None, None]).to(dtype)
    x[3] = 0.0
    slots = torch.tensor([5, 0, 17, 3, 11, 2, 30, 8, 1])
    got = torch.zeros(8, 4, 2, kv_int8.row_bytes(64), dtype=torch.int8)
    kv_int8.write_rows(got, x, slots)
    monkeypatch.setattr(kv_int8, "_write_rows", None)
    want = torch.zeros_like(got)
    kv_int8.write_rows(want, x, slots)
    assert torch.equal(got, want)
    assert torch.equal(want.view(-1, 2, 66)[slots], kv_int8.quantize_rows(x))


@pytest.mark.skipif(not paged.AVAILABLE, reason="the paged kernel extension is not built")
def test_a_slot_outside_the_cache_is_refused_before_anything_is_written():
    cache = torch.zeros(2, 4, 2, kv_int8.row_bytes(16), dtype=torch.int8)
    with pytest.raises(ValueError, match=r"slot 8 of token 1 is outside the cache's \[0, 8\)"):
        kv_int8.write_rows(cache, torch.ones(2, 2, 16), torch.tensor([0, 8]))
    assert not cache.any()


@pytest.mark.skipif(not paged.AVAILABLE, reason="the paged kernel extension is not built")
@pytest.mark.parametrize("dim", [16, 64, 128, 12])
def test_the_kernel_on_int8_pages_equals_it_on_the_same_pages_dequantized(dim):
    torch.manual_seed(dim)
    pages, page, kv_heads, heads = 20, 4, 2, 4
    k = kv_int8.quantize_rows(torch.randn(pages, page, kv_heads, dim))
    v = kv_int8.quantize_rows(torch.randn(pages, page, kv_heads, dim))
    q = torch.randn(3, heads, dim)
    tables = torch.tensor([[3, 5, 7, 1], [2, 4, 6, 8], [9, 10, 11, 12]], dtype=torch.int32)
    lens = torch.tensor([13, 5, 16], dtype=torch.int32)
    got = paged.paged_decode(q, k, v, tables, lens, 0.25)
    want = paged.paged_decode(
        q,
        kv_int8.dequantize(k).contiguous(),
        kv_int8.dequantize(v).contiguous(),
        tables,
        lens,
        0.25,
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "backend",
    [
        ReferenceBackend(),
        SdpaBackend(batched=False, inplace=False),
        SdpaBackend(batched=False),
        SdpaBackend(batched=True),
    ],
    ids=["reference", "sdpa-gather", "sdpa-inplace", "sdpa-batched"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_read_int8_pages_as_their_values(backend, dtype):
    """Each CPU backend on int8 pages gives what it gives on those pages dequantized: prefill
    chunks after cached context and decodes in one step, and a decode-only step."""
    chunks = [(0, 9), (6, 5), (12, 1), (3, 1), (30, 1)]
    for case in (chunks, [c for c in chunks if c[1] == 1]):
        q, k, v, meta, scale = make_case(case, 2, seed=len(case), dtype=dtype)
        k8, v8 = kv_int8.quantize_rows(k), kv_int8.quantize_rows(v)
        k_values, v_values = kv_int8.dequantize(k8, dtype), kv_int8.dequantize(v8, dtype)
        got = backend.forward(q, k8, v8, meta, scale)
        want = backend.forward(q, k_values, v_values, meta, scale)
        assert got.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    ("arch", "backend"),
    [("llama", "auto"), ("llama", "reference"), ("qwen2", "auto"), ("mixtral", "auto")],
)
def test_greedy_top1_agrees_with_float32_pages(make_checkpoint, make_runner, arch, backend):
    folder = make_checkpoint(arch)
    base = make_runner(folder, backend=backend, kv_pool_bytes=8 << 20)
    reference = generate(base, PROMPTS, NEW_TOKENS, chunk=7, stagger=True)
    runner = make_runner(folder, backend=backend, kv_pool_bytes=8 << 20, kv_cache_dtype="int8")
    assert runner.kv.dtype == torch.int8
    got = generate(runner, PROMPTS, NEW_TOKENS, chunk=7, stagger=True, forced=reference)
    pairs = [(a, b) for g, w in zip(got, reference, strict=True) for a, b in zip(g, w, strict=True)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= AGREEMENT_FLOOR


@pytest.mark.skipif(not bf16_units(), reason="this CPU has no AVX512-BF16 or AMX-BF16 units")
@pytest.mark.parametrize(
    ("overrides", "bf16_decode"),
    [({}, True), ({}, "tied"), ({"tie_word_embeddings": True}, True)],
    ids=["untied-fused", "untied-torch", "tied-fused"],
)
def test_a_bf16_model_on_int8_pages_agrees_with_its_bf16_pages(
    make_checkpoint, make_runner, monkeypatch, overrides, bf16_decode
):
    """bf16 weights beside int8 pages, on the fused step (the default) and on the torch path (an
    untied model under fused.BF16_DECODE "tied"), against the same model on bf16 pages."""
    monkeypatch.setattr(fused, "BF16_DECODE", bf16_decode)
    folder = make_checkpoint("llama", dtype="bfloat16", **overrides)
    base = make_runner(folder, dtype="bfloat16", kv_pool_bytes=8 << 20)
    reference = generate(base, PROMPTS, NEW_TOKENS, chunk=7, stagger=True)
    runner = make_runner(folder, dtype="bfloat16", kv_pool_bytes=8 << 20, kv_cache_dtype="int8")
    assert runner.dtype == torch.bfloat16 and runner.kv.dtype == torch.int8
    on_kernel = bf16_decode is True or "tie_word_embeddings" in overrides
    if fused.DecodeKernel is not None:
        assert (runner.decode_step.fused is not None) == on_kernel
    got = generate(runner, PROMPTS, NEW_TOKENS, chunk=7, stagger=True, forced=reference)
    pairs = [(a, b) for g, w in zip(got, reference, strict=True) for a, b in zip(g, w, strict=True)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= AGREEMENT_FLOOR


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_weights_on_int8_pages_agree_with_float32(make_checkpoint, make_runner, arch):
    """--quantization int8 beside --kv-cache-dtype int8: every matrix and every page in int8, the
    decode on the fused step; the floor is int8 weights' own (test_int8: 0.95-0.97 measured)
    less what int8 pages cost (~2 points here)."""
    folder = make_checkpoint(arch)
    base = make_runner(folder, kv_pool_bytes=8 << 20)
    reference = generate(base, PROMPTS, NEW_TOKENS, chunk=7, stagger=True)
    runner = make_runner(folder, kv_pool_bytes=8 << 20, kv_cache_dtype="int8", quantization="int8")
    assert runner.kv.dtype == torch.int8
    if fused.DecodeKernel is not None:
        assert runner.decode_step.fused is not None
    got = generate(runner, PROMPTS, NEW_TOKENS, chunk=7, stagger=True, forced=reference)
    pairs = [(a, b) for g, w in zip(got, reference, strict=True) for a, b in zip(g, w, strict=True)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    print(f"{arch}: int8 weights on int8 pages agree {agreement:.3f} with float32")
    assert agreement >= 0.9


def test_int8_pages_count_their_scales_and_hold_more_tokens(make_checkpoint, make_runner):
    folder = make_checkpoint("llama")
    spec = load_spec(folder)
    fp32 = make_runner(folder, kv_pool_bytes=4 << 20)
    int8 = make_runner(folder, kv_pool_bytes=4 << 20, kv_cache_dtype="int8")
    row = spec.head_dim + kv_int8.SCALE_BYTES
    assert int8.page_bytes == spec.num_layers * 2 * spec.num_kv_heads * row * 4
    assert fp32.page_bytes == spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4 * 4
    assert int8.kv_block_bytes == int8.page_bytes
    assert int8.kv.shape[-1] == row and int8.kv.is_contiguous()
    info, base = int8.info(), fp32.info()
    assert (info["kv_cache_dtype"], base["kv_cache_dtype"]) == ("int8", "float32")
    assert info["kv_tokens"] == (int8.num_kv_blocks - 1) * int8.block_size
    # head_dim 16: 18 bytes a row against 64
    assert info["kv_tokens"] >= 3 * base["kv_tokens"]
    # decode steps run the fused C step on the int8 pages
    assert int8.decode_step is not None and int8.decode_step.fused is not None


@pytest.mark.skipif(fused.DecodeKernel is None, reason="the fused decode extension is not built")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_fused_step_on_int8_pages_gives_the_torch_twins_logits_and_rows(
    make_checkpoint, make_runner, arch
):
    """The C step writes each K/V row quantized as write_kv does (to the last step of float32
    rounding of its inputs) and attends over int8 pages as the paged kernel does."""
    runner = make_runner(
        make_checkpoint(arch), kv_pool_bytes=4 << 20, max_batch=8, kv_cache_dtype="int8"
    )
    kernel = runner.decode_step.fused
    assert kernel is not None
    torch.manual_seed(0)
    runner.kv.copy_(kv_int8.quantize_rows(torch.randn(*runner.kv.shape[:-1], runner.spec.head_dim)))
    for lengths in ([1], [3, 4, 5], [8, 9, 33, 40, 1, 4]):
        step = _step(runner, lengths)
        slots = step.slot_mapping
        by_slot = runner.kv.flatten(2, 3)  # [layers, K/V, slots, KV heads, row]
        with torch.inference_mode():
            want = runner.model.decode(
                step.input_ids,
                step.positions,
                slots,
                step.block_tables,
                step.seq_lens,
                runner.kv,
            )
        want_kv = kv_int8.dequantize(by_slot[:, :, slots])
        by_slot[:, :, slots] = 0
        got = kernel(step)
        got_kv = kv_int8.dequantize(by_slot[:, :, slots])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"lengths {lengths}")
        step_size = want_kv.abs().amax(-1, keepdim=True) / 127
        assert ((got_kv - want_kv).abs() <= step_size * 1.01 + 1e-6).all()


def _step(runner, lengths: list[int]):
    """A decode step of one sequence per length, each on pages of its own."""
    seqs, next_page = [], 1
    for i, n in enumerate(lengths):
        pages = -(-n // runner.block_size)
        table = list(range(next_page, next_page + pages))
        seqs.append(ScheduledSequence(f"s{i}", [40 + 7 * i], n - 1, table, True, SamplingParams()))
        next_page += pages
    return runner.inputs.build_decode(seqs, len(seqs))


def test_prefix_reuse_and_swap_preemption_keep_int8_tokens(make_checkpoint):
    """Swapped-out int8 blocks come back with their scales, and cached prefix blocks are reused as
    they are: the tokens equal those of each request run alone on int8 pages."""
    folder = str(make_checkpoint("llama"))
    prefix = [256] + [(i * 11) % 250 for i in range(30)]
    prompts = [prefix + [i, i + 1] for i in range(10)]
    params = [SamplingParams(max_tokens=20 + i, ignore_eos=True) for i in range(10)]
    common = dict(device="cpu", max_model_len=128, block_size=4, kv_cache_dtype="int8")
    with LLM(folder, max_batch=1, prefix_cache=False, chunked_prefill=False, **common) as llm:
        alone = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
        page_bytes = llm.engine.model_info["kv_page_bytes"]
    with LLM(
        folder,
        kv_pool_bytes=41 * page_bytes,
        swap_bytes=64 * page_bytes,
        preemption_mode="swap",
        max_batch=10,
        adaptive_batch=False,
        **common,
    ) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.engine.stats()
    assert stats.preemptions_total > 0 and stats.prefix_hit_tokens_total > 0
    assert stats.swap_blocks_free == stats.swap_blocks_total
    assert [o.token_ids for o in outs] == alone


@pytest.mark.timeout(240)
def test_two_ranks_on_int8_pages_agree_with_one(make_checkpoint):
    from sloserve.executor import ModelRunner
    from sloserve.parallel.runner import TensorParallelRunner

    folder = make_checkpoint("llama")
    config = runner_config(folder, kv_cache_dtype="int8")
    one = generate(ModelRunner(config), PROMPTS[:4], 8, chunk=7)
    runner = TensorParallelRunner(
        dataclasses.replace(config, parallel=ParallelConfig(tensor_parallel_size=2))
    )
    try:
        assert runner.info()["kv_cache_dtype"] == "int8"
        two = generate(runner, PROMPTS[:4], 8, chunk=7, forced=one)
    finally:
        runner.close()
    pairs = [(a, b) for g, w in zip(two, one, strict=True) for a, b in zip(g, w, strict=True)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= AGREEMENT_FLOOR


def test_bad_values_and_a_gpu_are_refused_naming_the_flag(tiny_llama):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be auto or int8, got 'fp8'"):
        CacheConfig(kv_cache_dtype="fp8")
    config = SloserveConfig(
        model=ModelConfig(device="cpu", max_model_len=64),
        cache=CacheConfig(block_size=16, kv_pool_bytes=4 << 20, kv_cache_dtype="int8"),
    )
    spec = load_spec(tiny_llama)
    with pytest.raises(ValueError, match="--kv-cache-dtype int8 runs on a CPU only.*--device cpu"):
        plan_module.plan_memory(config, spec, 64, torch.device("cuda"), torch.float32, 16)


def test_info_says_the_kv_dtype_and_tokens_and_the_flag_lists_its_choices(tiny_llama):
    import json

    from click.testing import CliRunner
    from sloserve.cli.main import cli

    args = ["info", "--model", str(tiny_llama), "--device", "cpu", "--json"]
    bad = CliRunner().invoke(cli, [*args, "--kv-cache-dtype", "fp8"])
    assert bad.exit_code != 0 and "'fp8' is not one of 'auto', 'int8'" in bad.output
    sizes = {}
    for kv in ("auto", "int8"):
        result = CliRunner().invoke(cli, [*args, "--kv-cache-dtype", kv, "--kv-pool-size", "4MiB"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        sizes[data["kv_cache_dtype"]] = data["kv_tokens"]
    # head_dim 16: 18 bytes a row against 64
    assert sizes["int8"] >= 3.5 * sizes["float32"]
