"""Prompt logprobs needed from position S on: the scheduler reuses cached blocks before row S - 1.

The logprob of the token at position i comes from the logits of row i - 1, so a request whose
prompt logprobs start at S reuses full cached blocks only up to a block boundary <= S - 1, and
reports None before S. These run over the fake runner: what is scheduled, not what is computed.
"""

from __future__ import annotations

import pytest
from sloserve.errors import InvalidRequestError
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence

from tests.engine.helpers import assert_all_free, drain, make_scheduler

PROMPT = [ord(c) for c in "abcdefghabcdefghabcd"]  # 20 tokens: 5 blocks of 4
CANDIDATE = [ord(c) for c in "xyzzy"]


def _chunks(runner, req_id: str) -> list[ScheduledSequence]:
    return [seq for out in runner.steps for seq in out.sequences if seq.req_id == req_id]


def test_validation_names_the_field():
    with pytest.raises(InvalidRequestError, match="prompt_logprobs_start needs prompt_logprobs"):
        SamplingParams(prompt_logprobs_start=3)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs_start must be an integer >= 0"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=-1)
    with pytest.raises(
        InvalidRequestError, match="prompt_logprobs_start is 3 but the prompt has 3"
    ):
        NewRequest("r", [1, 2, 3], SamplingParams(prompt_logprobs=0, prompt_logprobs_start=3))


@pytest.mark.parametrize(
    ("start", "first_row"),
    [(0, 8), (1, 8), (9, 8), (12, 11), (15, 14)],
)
def test_rows_start_at_the_row_before_start(start, first_row):
    """A chunk of positions 8..15 of a 16-token prompt: rows from S - 1 (not before the chunk)
    to 14, the row that scores the last token."""
    context = list(range(16))
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_logprobs_start=start)
    seq = ScheduledSequence("r", context[8:16], 8, [1, 2, 3, 4], False, params, context=context)
    assert seq.prompt_logprob_rows == range(first_row, 15)


def test_a_chunk_before_start_scores_no_row():
    context = list(range(16))
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_logprobs_start=12)
    seq = ScheduledSequence("r", context[0:8], 0, [1, 2], False, params, context=context)
    assert not seq.prompt_logprob_rows


@pytest.mark.parametrize(
    ("start", "reused"), [(20, 16), (17, 16), (16, 12), (5, 4), (4, 0), (0, 0)]
)
def test_reuse_stops_at_the_block_before_the_first_needed_row(start, reused):
    s, runner, _ = make_scheduler()
    s.add_request(NewRequest("warm", PROMPT + CANDIDATE, SamplingParams(max_tokens=1)))
    drain(s, runner)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_logprobs_start=start)
    s.add_request(NewRequest("score", PROMPT + CANDIDATE, params))
    outputs = drain(s, runner)
    assert_all_free(s)
    chunks = _chunks(runner, "score")
    assert chunks[0].start_pos == reused
    assert chunks[0].start_pos <= max(start - 1, 0)
    (only,) = outputs["score"]
    assert only.num_cached_tokens == reused
    rows = [r for seq in chunks for r in seq.prompt_logprob_rows]
    assert rows == list(range(max(start, 1) - 1, len(PROMPT + CANDIDATE) - 1))


def test_candidates_wait_for_the_prompt_a_running_generation_computes():
    """A generation computing the prompt in chunks claims its blocks; candidates queued behind it
    take them from the cache rather than compute the prompt again."""
    s, runner, _ = make_scheduler(chunked_prefill=True, prefill_chunk=4, max_batched_tokens=8)
    s.add_request(NewRequest("gen", PROMPT, SamplingParams(max_tokens=3)))
    candidates = [CANDIDATE, CANDIDATE[:2], [ord("q")] * 7]
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_logprobs_start=len(PROMPT))
    for i, c in enumerate(candidates):
        s.add_request(NewRequest(f"c{i}", PROMPT + c, params))
    outputs = drain(s, runner)
    assert_all_free(s)
    assert outputs["gen"][-1].num_output_tokens == 3
    computed = sum(len(seq.token_ids) for out in runner.steps for seq in out.sequences)
    # the prompt and two decodes once; each candidate, the prompt's partial last block before row S - 1 and itself
    assert computed == len(PROMPT) + 2 + sum(len(c) + 4 for c in candidates)
    for i in range(len(candidates)):
        assert outputs[f"c{i}"][-1].num_cached_tokens == 16
