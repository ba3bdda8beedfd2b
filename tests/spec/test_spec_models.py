"""Speculation on real (tiny) checkpoints: greedy tokens with drafts equal those without, on
every CPU decode path a verify step can take, with drafts that the model accepts."""

from __future__ import annotations

import pytest
from sloserve import LLM
from sloserve.sampling_params import SamplingParams


def _prompts() -> list[list[int]]:
    """Repetitive prompts (rows of a grid, a refrain) that prompt lookup can copy from."""
    rows = [[10 + (r * 3 + c) % 7 for c in range(6)] + [5] for r in range(4)]
    grid = [t for row in rows for t in row]
    return [grid * 2, [40, 41, 42, 43] * 6, grid + [40, 41] * 5, list(range(30, 60))]


def _generate(path: str, predictions=None, max_batch: int = 8, flat: bool = False, **options):
    """Greedy tokens of _prompts() and the scheduler's counters; `flat`: mixed and verify steps
    on the torch path, never the fused kernel's rows."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    options.setdefault("num_scheduler_steps", 1)
    with LLM(
        path,
        device="cpu",
        max_model_len=256,
        block_size=4,
        max_batch=max_batch,
        **options,
    ) as llm:
        if flat:
            inputs = llm.engine.runner.inputs
            inputs.build_rows = inputs.build
        prompts = _prompts()
        out = llm.generate(prompts, params, predictions=predictions)
        counters = llm._core.scheduler.counters
        return [o.token_ids for o in out], counters


@pytest.fixture(scope="module", params=["llama", "qwen2", "mixtral", "qwen2_moe"])
def checkpoint(request, make_checkpoint):
    return str(make_checkpoint(request.param))


@pytest.mark.parametrize("flat", [False, True], ids=["kernel-rows", "torch"])
@pytest.mark.parametrize("max_batch", [1, 8])
def test_ngram_speculation_gives_the_tokens_of_decoding_without_it(checkpoint, max_batch, flat):
    """max_batch 1: a verify step alone; 8: verify steps batched with each other and with prefill
    chunks; on the fused kernel's rows (a dense model's small steps) or the torch path."""
    off, _ = _generate(checkpoint, max_batch=max_batch)
    on, counters = _generate(
        checkpoint, max_batch=max_batch, flat=flat, speculation="ngram", num_speculative_tokens=5
    )
    assert on == off
    assert counters.spec_drafts_total > 0
    assert counters.spec_accepted_tokens_total > 0, "no draft accepted: the workload tests nothing"


def test_a_prediction_of_the_answer_is_accepted_and_a_wrong_one_changes_nothing(checkpoint):
    answers, _ = _generate(checkpoint)
    got, counters = _generate(checkpoint, predictions=answers, num_speculative_tokens=8)
    assert got == answers
    # each of the 4 requests: 23 tokens after the first, 9 a step -> 3 verify steps
    assert counters.spec_drafts_total == 4 * 3
    assert counters.spec_accepted_tokens_total == 4 * (23 - 3)
    wrong = [[(t + 1) % 64 if i % 5 == 2 else t for i, t in enumerate(a)] for a in answers]
    got, counters = _generate(checkpoint, predictions=wrong, num_speculative_tokens=8)
    assert got == answers
    assert 0 < counters.spec_accepted_tokens_total < counters.spec_drafted_tokens_total


def test_two_tensor_parallel_ranks_verify_as_one(make_checkpoint):
    """TP=2 (gloo): every rank runs the verify step; the tokens are one rank's without drafts."""
    path = str(make_checkpoint("llama"))
    off, _ = _generate(path)
    on, counters = _generate(
        path, speculation="ngram", num_speculative_tokens=4, tensor_parallel_size=2
    )
    assert on == off
    assert counters.spec_accepted_tokens_total > 0


@pytest.mark.parametrize("max_batch", [1, 8])
def test_auto_speculation_gives_the_tokens_of_decoding_without_it(checkpoint, max_batch):
    """auto: drafts where its cost model lets them, runs of decode steps where it does not (the
    engine's step timings feed it); the tokens are those without drafts either way."""
    off, _ = _generate(checkpoint, max_batch=max_batch)
    on, counters = _generate(
        checkpoint,
        max_batch=max_batch,
        speculation="auto",
        num_speculative_tokens=5,
        num_scheduler_steps=4,
    )
    assert on == off
    assert counters.spec_drafts_total > 0, "the planner never probed with drafts"
