"""Greedy tokens equal transformers' `generate`, token for token, for all four families.

Every run batches prompts of different lengths, prefills in chunks, staggers arrivals (so steps
mix prefill chunks with decode tokens), spans many KV pages, and takes pages from a shuffled list.
Each test runs on every CPU backend, `auto` (what users get) included, and checks which backend ran.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.checkpoints import hf_greedy, load_hf_model
from tests.executor.conftest import CPU_AUTO_BACKEND, CPU_BACKENDS
from tests.executor.driver import generate

PROMPTS = [
    [256],
    [256, 72, 101, 108, 108, 111],
    [256] + list(range(48, 66)),
    [256] + [(i * 37) % 250 for i in range(69)],
]
NEW_TOKENS = 6


@functools.cache
def _expected(folder: Path) -> list[list[int]]:
    """transformers' greedy tokens for PROMPTS, computed once per checkpoint for all backends."""
    return hf_greedy(load_hf_model(folder), PROMPTS, NEW_TOKENS)


def _check(
    make_checkpoint,
    make_runner,
    arch: str,
    backend: str,
    *,
    chunk: int | None = 7,
    block_size: int = 4,
    runner_kw: dict | None = None,
    **overrides,
):
    folder = make_checkpoint(arch, **overrides)
    runner = make_runner(folder, block_size=block_size, backend=backend, **(runner_kw or {}))
    if runner.device.type == "cpu":  # the backend that ran is the one named, or auto's CPU choice
        assert runner.backend.name == (CPU_AUTO_BACKEND if backend == "auto" else backend)
    got = generate(runner, PROMPTS, NEW_TOKENS, chunk=chunk, stagger=True, seed=len(arch))
    assert got == _expected(folder)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral", "qwen2_moe"])
def test_greedy_matches_transformers(make_checkpoint, make_runner, arch, backend):
    _check(make_checkpoint, make_runner, arch, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_whole_prompt_prefill_with_larger_pages(make_checkpoint, make_runner, backend):
    _check(make_checkpoint, make_runner, "llama", backend, chunk=None, block_size=16)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True},
        {"attention_bias": True, "mlp_bias": True},
        {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            }
        },
        {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 8},
    ],
    ids=["tied", "biases", "rope-linear", "rope-llama3", "gqa8"],
)
def test_llama_variants(make_checkpoint, make_runner, overrides, backend):
    _check(make_checkpoint, make_runner, "llama", backend, **overrides)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("qwen2_moe", {"norm_topk_prob": True, "mlp_only_layers": [1]}),
        ("qwen2_moe", {"decoder_sparse_step": 2, "shared_expert_intermediate_size": 0}),
        ("mixtral", {"num_experts_per_tok": 1}),
    ],
    ids=["qwen2moe-norm-dense-layer", "qwen2moe-sparse-step-no-shared", "mixtral-top1"],
)
def test_moe_variants(make_checkpoint, make_runner, arch, overrides, backend):
    _check(make_checkpoint, make_runner, arch, backend, **overrides)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "triton"])
def test_greedy_matches_transformers_on_gpu(make_checkpoint, make_runner, arch, backend):
    """float32 with 16-token pages: flash-attn cannot run (bf16/fp16 only), so auto must pick triton."""
    folder = make_checkpoint(arch)
    runner = make_runner(folder, block_size=16, device="cuda", dtype="float32", backend=backend)
    if backend == "auto":
        from sloserve.layers.attention.triton_decode import TritonDecodeBackend

        why = TritonDecodeBackend.unavailable_reason(
            "cuda", torch.float32, 16, runner.spec.head_dim
        )
        assert runner.backend.name == "triton", f"auto ran {runner.backend.name}, not triton: {why}"
    else:
        assert runner.backend.name == backend
    got = generate(runner, PROMPTS, NEW_TOKENS, chunk=7, stagger=True, seed=len(arch))
    assert got == _expected(folder)


@pytest.mark.parametrize("cpu_gemm", ["blas", "onednn"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_whole_prompt_prefill_on_each_cpu_gemm(make_checkpoint, make_runner, arch, cpu_gemm):
    """Whole prompts (products of 16 rows and more take oneDNN's packed path, layers/linear.py)."""
    _check(
        make_checkpoint,
        make_runner,
        arch,
        "auto",
        chunk=None,
        block_size=16,
        runner_kw={"cpu_gemm": cpu_gemm},
    )
