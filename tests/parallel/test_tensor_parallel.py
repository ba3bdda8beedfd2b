"""Two gloo ranks on a CPU: greedy tokens equal transformers' (and one rank's), offline and served.

Each test starts real worker processes (`python -m sloserve.parallel.worker`); rank 0 runs here.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from sloserve.config import ParallelConfig
from sloserve.executor.precision import bf16_units
from sloserve.llm import LLM
from sloserve.parallel.runner import TensorParallelRunner
from sloserve.sampling_params import SamplingParams
from sloserve.testing.ports import free_port

from tests.checkpoints import hf_greedy, load_hf_model
from tests.executor.conftest import runner_config
from tests.executor.driver import generate

pytestmark = pytest.mark.timeout(240)

PROMPTS = [
    [256],
    [256, 72, 101, 108, 108, 111],
    [256] + list(range(48, 66)),
    [256] + [(i * 37) % 250 for i in range(69)],
]
NEW_TOKENS = 6


@pytest.mark.parametrize(
    ("arch", "overrides", "runner_kw"),
    [
        ("llama", {}, {}),  # GQA: 4 query heads over 2 KV heads, one KV head per rank
        (
            "llama",
            {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 8},
            {},
        ),  # the KV head replicated
        ("llama", {"attention_bias": True, "mlp_bias": True}, {}),  # row-parallel biases added once
        ("qwen2", {}, {}),
        ("mixtral", {}, {}),
        (
            "mixtral",
            {},
            {"expert_slots_per_layer": 2},
        ),  # experts offloaded: each rank caches its slices
        ("qwen2_moe", {}, {}),
    ],
    ids=[
        "llama-gqa",
        "llama-kv1",
        "llama-bias",
        "qwen2",
        "mixtral",
        "mixtral-offload",
        "qwen2_moe",
    ],
)
def test_two_ranks_match_transformers(make_checkpoint, arch, overrides, runner_kw):
    """Batched, chunked, staggered steps over shuffled pages: the executor equality test, on two ranks."""
    folder = make_checkpoint(arch, **overrides)
    expected = hf_greedy(load_hf_model(folder), PROMPTS, NEW_TOKENS)
    runner = _tp_runner_with(folder, **runner_kw)
    try:
        assert generate(runner, PROMPTS, NEW_TOKENS, chunk=7, stagger=True, seed=3) == expected
        info = runner.info()
        assert info["tensor_parallel_size"] == 2 and info["all_reduce_calls"] > 0
        # two per layer per forward
        assert info["all_reduce_calls"] % (2 * runner.spec.num_layers) == 0
    finally:
        runner.close()
    # "stop" ends every worker cleanly
    assert all(proc.poll() == 0 for proc in runner.workers.values())


def _tp_runner_with(
    folder, expert_slots_per_layer: int | None = None, **model_kw
) -> TensorParallelRunner:
    config = runner_config(folder, **model_kw)
    if expert_slots_per_layer is not None:
        config = dataclasses.replace(
            config,
            cache=dataclasses.replace(config.cache, expert_slots_per_layer=expert_slots_per_layer),
        )
    return TensorParallelRunner(
        dataclasses.replace(config, parallel=ParallelConfig(tensor_parallel_size=2))
    )


def test_llm_two_ranks_equal_one_with_prefix_reuse(tiny_llama):
    """The offline API end to end: shared prefixes hit the prefix cache on the second pass."""
    prefix = [256] + [(i * 11) % 250 for i in range(40)]
    prompts = [prefix + [7, 8], prefix + [9], prefix + [10, 11, 12]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    results = {}
    for size in (1, 2):
        with LLM(
            str(tiny_llama), device="cpu", tensor_parallel_size=size, max_model_len=256
        ) as llm:
            first = llm.generate(prompts, params)
            second = llm.generate(prompts, params)
            assert [o.token_ids for o in first] == [o.token_ids for o in second]
            assert all(o.num_cached_tokens >= 32 for o in second)
            results[size] = [o.token_ids for o in first]
    assert results[2] == results[1]


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_worker_starts(
    tiny_llama, monkeypatch
):
    import sloserve.parallel.runner as tp_runner

    def no_launch(*args, **kw):
        raise AssertionError("a worker was started for a size the model cannot split")

    monkeypatch.setattr(tp_runner, "launch", no_launch)
    with pytest.raises(
        ValueError, match="tensor parallel size 3 does not divide num_attention_heads 4"
    ):
        LLM(str(tiny_llama), device="cpu", tensor_parallel_size=3)


def test_compile_with_tensor_parallelism_is_refused(tiny_llama):
    with pytest.raises(
        RuntimeError, match="rank 0 failed to start: ValueError: the compiled decode step"
    ):
        LLM(str(tiny_llama), device="cpu", tensor_parallel_size=2, enforce_eager=False)


def test_two_nodes_on_loopback(tiny_qwen2):
    """torchrun's conventions: node 1 runs `sloserve serve --node-rank 1`, node 0 the engine."""
    port = free_port()
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sloserve.cli.main",
            "serve",
            "--model",
            str(tiny_qwen2),
            "--device",
            "cpu",
            "--tensor-parallel-size",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        with LLM(str(tiny_qwen2), device="cpu", max_model_len=256) as llm:
            expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
        with LLM(
            str(tiny_qwen2),
            device="cpu",
            max_model_len=256,
            tensor_parallel_size=2,
            nnodes=2,
            master_port=port,
        ) as llm:
            assert llm.engine.runner.workers == {}  # this node runs rank 0 only
            assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
        # rank 0's "stop" ends node 1's ranks, and node 1 with them
        assert node1.wait(timeout=30) == 0
        assert "node 1 of 2 runs tensor-parallel ranks 1-1 of 2" in node1.stderr.read()
    finally:
        if node1.poll() is None:
            node1.kill()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["-tp", "2", "--nnodes", "2", "--node-rank", "1"],
            "--master-port: master port must be given",
        ),
        (
            ["-tp", "3", "--nnodes", "2", "--master-port", "29500"],
            "--tensor-parallel-size: tensor parallel size 3 must be a multiple of nnodes 2",
        ),
        (
            ["-tp", "2", "--nnodes", "2", "--node-rank", "2", "--master-port", "29500"],
            "--node-rank: node rank must be in 0..1, got 2",
        ),
        (["-tp", "0"], "--tensor-parallel-size: tensor parallel size must be >= 1, got 0"),
    ],
)
def test_bad_parallel_flags_are_refused_naming_the_flag(tiny_llama, flags, message):
    from click.testing import CliRunner
    from sloserve.cli.main import cli

    result = CliRunner().invoke(cli, ["serve", "--model", str(tiny_llama), *flags])
    assert result.exit_code != 0
    assert message in result.output


def test_tp_benchmark_smoke(tmp_path, monkeypatch):
    """benchmarks/tp.py end to end at toy sizes: both sizes run and produce the same tokens."""
    import orjson

    from benchmarks import tp

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setitem(
        tp.MODELS,
        "small",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
    )
    out = tmp_path / "tp.json"
    assert (
        tp.main(
            [
                "--models",
                "small",
                "--decode-tokens",
                "4",
                "--prefill-tokens",
                "32",
                "--repeats",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = orjson.loads(out.read_bytes())["models"]["small"]
    assert report["1"]["decode_c1"]["all_reduce_ms_per_forward"] == 0.0
    for phase in ("decode_c1", "decode_c8", "prefill"):
        two = report["2"][phase]
        assert (
            two["tokens_equal_base"]
            and two["forwards"] > 0
            and two["all_reduce_ms_per_forward"] > 0
        )


@pytest.mark.skipif(not bf16_units(), reason="this CPU has no AVX512-BF16 or AMX-BF16 units")
def test_two_ranks_in_bf16_agree_with_float32(make_checkpoint):
    """A bf16 checkpoint at --dtype auto: every rank picks bf16 by the CPU's units alone (no
    probe, so the ranks agree), sums its partials in bf16, and the top-1 tokens agree with
    transformers in float32 as often as one rank's do (tests/executor/test_bf16.py)."""
    folder = make_checkpoint("llama", dtype="bfloat16")
    reference = hf_greedy(load_hf_model(folder), PROMPTS, 24)
    runner = _tp_runner_with(folder)
    try:
        info = runner.info()
        assert info["dtype"] == "bfloat16" and "not probed" in info["dtype_reason"]
        got = generate(runner, PROMPTS, 24, chunk=7, stagger=True, seed=3, forced=reference)
    finally:
        runner.close()
    pairs = [(a, b) for g, w in zip(got, reference, strict=True) for a, b in zip(g, w, strict=True)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.95


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_two_ranks_in_int8_agree_with_one(make_checkpoint, arch):
    """--quantization int8 at TP=2 end to end: each rank quantizes its slices as it loads them.
    The column-parallel qkv and gate_up rows are the same int8 rows and scales as on one rank,
    the embedding and LM head are replicated (the same too); the row-parallel o and down keep a
    scale per row of each rank's half of the inputs, so their rounding differs slightly from one
    rank's whole rows, and so do the per-token activation scales of each half (a routed
    expert's w2 is split the same way). Top-1 agreement with one int8 rank, teacher-forced on its
    tokens, is a floor, not equality (measured 0.969 on the llama, 1.000 on the qwen2_moe,
    over 96 tokens)."""
    from sloserve.executor import ModelRunner

    folder = make_checkpoint(arch)
    one = ModelRunner(runner_config(folder, quantization="int8"))
    reference = generate(one, PROMPTS, 24, chunk=7, stagger=True, seed=3)
    runner = _tp_runner_with(folder, quantization="int8")
    try:
        info = runner.info()
        assert info["tensor_parallel_size"] == 2 and info["quantization"] == "int8"
        got = generate(runner, PROMPTS, 24, chunk=7, stagger=True, seed=3, forced=reference)
    finally:
        runner.close()
    pairs = [(a, b) for g, w in zip(got, reference, strict=True) for a, b in zip(g, w, strict=True)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    print(f"int8 top-1 agreement ({arch}), two ranks with one: {agreement:.4f} of {len(pairs)}")
    assert agreement >= 0.9
