"""The captured decode step on a GPU: tokens, graph against eager, one host sync, no allocation."""

from __future__ import annotations

import pytest
import torch
from sloserve.executor.graphs import GraphDecode
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

from tests.checkpoints import hf_greedy, load_hf_model
from tests.executor.driver import generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [
    [256, 72, 101, 108, 108, 111],
    [256] + list(range(48, 66)),
    [256] + [(i * 37) % 250 for i in range(37)],
]
GREEDY = SamplingParams(max_tokens=10**6, ignore_eos=True)


def cuda_runner(make_runner, folder, enforce_eager=None, dtype="float32"):
    runner = make_runner(
        folder,
        block_size=16,
        device="cuda",
        dtype=dtype,
        backend="triton",
        max_batch=8,
        kv_pool_bytes=16 * 2**20,
        enforce_eager=enforce_eager,
    )
    runner.warmup()
    return runner


def test_graphs_are_captured_and_tokens_equal_transformers(tiny_llama, make_runner):
    runner = cuda_runner(make_runner, tiny_llama)
    assert (
        isinstance(runner.decode_step, GraphDecode) and runner.info()["decode_step"] == "cuda-graph"
    )
    assert runner.decode_step.capture_bytes >= 0 and runner.decode_step.capture_time_s > 0
    assert generate(runner, PROMPTS, 6, stagger=True) == hf_greedy(
        load_hf_model(tiny_llama), PROMPTS, 6
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_is_bit_identical_to_eager(tiny_llama, make_runner, dtype):
    graphs = cuda_runner(make_runner, tiny_llama, dtype=dtype)
    eager = cuda_runner(make_runner, tiny_llama, enforce_eager=True, dtype=dtype)
    assert eager.info()["decode_step"] == "eager"
    logits = []
    for runner in (graphs, eager):
        generate(runner, PROMPTS, 3, stagger=True)  # same pages (same seed), same history
        seqs = [
            ScheduledSequence(f"x{i}", [7 + i], 40, list(range(1 + 4 * i, 5 + 4 * i)), True, GREEDY)
            for i in range(3)
        ]
        step = runner.prepare(SchedulerOutput(seqs))
        logits.append(runner.forward(step)[:3].clone())
    assert torch.equal(logits[0], logits[1])


SAMPLED = [
    GREEDY,
    SamplingParams(max_tokens=10**6, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9),
    SamplingParams(max_tokens=10**6, ignore_eos=True, temperature=1.2, seed=7),
]


def _decode_steps(runner, steps: int, sync_mode: str, params=(GREEDY,) * 3) -> list[int]:
    """Decode `steps` tokens of 3 sequences; everything but the sampled ids' copy under sync_mode."""
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(3)]
    last = [
        token
        for (token,) in runner.execute(
            SchedulerOutput(
                [
                    ScheduledSequence(f"s{i}", PROMPTS[i], 0, tables[i], True, GREEDY)
                    for i in range(3)
                ]
            )
        ).tokens
    ]
    pos = [len(p) for p in PROMPTS]
    for _ in range(steps):
        seqs = [
            ScheduledSequence(f"s{i}", [last[i]], pos[i], tables[i], True, params[i])
            for i in range(3)
        ]
        torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            step = runner.prepare(SchedulerOutput(seqs))
            logits = runner.forward(step)[: step.num_seqs]
            ids = runner.sampler.sample_on_device(
                logits, [s.sampling for s in seqs], [s.req_id for s in seqs]
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
        last = ids.tolist()  # the step's one device-to-host copy
        pos = [p + 1 for p in pos]
    return last


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_a_decode_step_makes_no_host_sync_but_its_one_copy(tiny_llama, make_runner, sampling):
    """Inputs, the replayed step and sampling (greedy; temperature with top-k/top-p; seeded) under
    torch.cuda.set_sync_debug_mode("error"): only the sampled ids' read-back may wait."""
    runner = cuda_runner(make_runner, tiny_llama)
    params = (GREEDY,) * 3 if sampling == "greedy" else SAMPLED
    _decode_steps(runner, 2, "default", params)
    _decode_steps(runner, 8, "error", params)  # raises at the first synchronizing call


def test_steady_decode_allocates_no_device_memory(tiny_llama, make_runner):
    runner = cuda_runner(make_runner, tiny_llama)
    _decode_steps(runner, 4, "default")
    before = torch.cuda.memory_stats()["num_device_alloc"]
    _decode_steps(runner, 16, "default")
    assert torch.cuda.memory_stats()["num_device_alloc"] == before
