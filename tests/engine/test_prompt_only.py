"""max_tokens 0 with prompt logprobs: the prompt is computed and scored, nothing is sampled.

This is what evaluation harnesses send to score a loglikelihood (echo, logprobs, max_tokens 0).
The request finishes 'length' as soon as its prompt is computed, with every prompt token's
logprob, no output token, no first-token time, and its blocks back in the pool.
"""

from __future__ import annotations

import pytest
import torch
from sloserve import LLM
from sloserve.errors import InvalidRequestError
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams

from tests.checkpoints import load_hf_model
from tests.engine.helpers import abort, assert_all_free, drain, make_scheduler, step

TOL = 1e-4
PROMPT = [ord(c) for c in "the quick brown fox jumps"]


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(
        InvalidRequestError, match="max_tokens must be an integer >= 1.*prompt_logprobs"
    ):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=-1, prompt_logprobs=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).prompt_only


@pytest.mark.parametrize("chunked", [True, False])
def test_a_prompt_only_request_samples_nothing_and_frees_its_blocks(chunked):
    s, runner, _ = make_scheduler(
        chunked_prefill=chunked, prefill_chunk=8, max_batched_tokens=8 if chunked else 64
    )
    s.add_request(NewRequest("score", PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=1)))
    s.add_request(NewRequest("gen", PROMPT[:9], SamplingParams(max_tokens=3)))
    outputs = drain(s, runner)
    assert_all_free(s)
    scored = [seq for out in runner.steps for seq in out.sequences if seq.req_id == "score"]
    assert sum(len(seq.token_ids) for seq in scored) == len(PROMPT)  # the prompt, once
    assert not any(seq.sample for seq in scored)
    (only,) = outputs["score"]
    assert only.finished and only.finish_reason == "length"
    assert (
        only.new_token_ids == [] and only.num_output_tokens == 0 and only.first_token_time is None
    )
    assert only.prompt_logprobs is not None and len(only.prompt_logprobs) == len(PROMPT)
    assert outputs["gen"][-1].num_output_tokens == 3  # its neighbour ran as usual
    assert s.counters.generated_tokens_total == 3 and s.counters.requests_finished_total == 2
    assert s.counters.computed_prompt_tokens_total == len(PROMPT) + 9


def test_an_aborted_prompt_only_request_sends_no_partial_prompt_logprobs():
    s, runner, _ = make_scheduler(chunked_prefill=True, prefill_chunk=4, max_batched_tokens=4)
    s.add_request(NewRequest("score", PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=0)))
    step(s, runner)  # its first chunk
    out = abort(s, "score")
    assert out.finish_reason == "cancelled" and out.prompt_logprobs is None
    assert_all_free(s)


def test_prompt_only_logprobs_equal_transformers(make_checkpoint):
    folder = make_checkpoint("llama")
    prompt = [256] + [(i * 29) % 250 for i in range(30)]
    with torch.no_grad():
        ref = load_hf_model(folder)(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
    with LLM(
        str(folder), device="cpu", max_model_len=64, block_size=4, max_batched_tokens=16
    ) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
        bm = llm.engine.scheduler.block_manager
        assert bm.num_free == bm.num_usable
    assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
    assert out.prompt_logprobs[0] is None
    got = [e.logprob for e in out.prompt_logprobs[1:]]
    assert got == pytest.approx(
        [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))], abs=TOL
    )


def test_prompt_only_requests_beside_generating_ones_on_every_step_path(make_checkpoint):
    """A one-token prompt (nothing to score), and prompt-only requests in steps with decodes and
    runs of decode steps: the generating requests' tokens are those they get alone."""
    folder = make_checkpoint("llama")
    prompts = [[256], [256, 72, 101, 108, 108, 111], [256] + list(range(48, 70)), [256, 1, 2, 3]]
    scored = SamplingParams(max_tokens=0, prompt_logprobs=0)
    made = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(
        str(folder),
        device="cpu",
        max_model_len=64,
        block_size=4,
        max_batched_tokens=16,
        num_scheduler_steps=4,
    ) as llm:
        alone = llm.generate(prompts[2:], made)
        outs = llm.generate(prompts, [scored, scored, made, made])
        bm = llm.engine.scheduler.block_manager
        assert bm.num_free == bm.num_usable
    assert (
        outs[0].prompt_logprobs == [None]
        and outs[0].token_ids == []
        and outs[0].finish_reason == "length"
    )
    assert len(outs[1].prompt_logprobs) == 6 and outs[1].token_ids == []
    assert [o.token_ids for o in outs[2:]] == [o.token_ids for o in alone]
