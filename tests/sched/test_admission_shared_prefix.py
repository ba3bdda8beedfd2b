"""Admission prices a burst of requests that share a prompt prefix as the scheduler runs them:
the prefix computed once (sched/queued_prefixes.py)."""

from __future__ import annotations

import pytest
from sloserve.errors import RequestRefusedError
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SLO, SamplingParams
from sloserve.sched.queued_prefixes import QueuedPrefixes

from tests.engine.fakes import FakeRunner
from tests.engine.helpers import assert_all_free, drain, make_scheduler, step

PROMPT = [97 + i % 23 for i in range(400)]  # 100 blocks of 4 tokens
OVERHEAD_S, PER_TOKEN_S = 0.01, 0.001


def _teach_speed(s) -> None:
    """Timed steps of varied size: step = 10 ms + 1 ms per token (400 prompt tokens: 0.41 s)."""
    for tokens in (1, 2, 500, 3, 1000, 1):
        s.admission.speed.observe(tokens, OVERHEAD_S + PER_TOKEN_S * tokens)


def _burst(s, prompts: list[list[int]], ttft_s: float) -> list[str]:
    """Add the prompts back to back; the ids admission refused."""
    refused = []
    for i, prompt in enumerate(prompts):
        try:
            s.add_request(
                NewRequest(f"r{i}", prompt, SamplingParams(max_tokens=4), SLO(ttft_s=ttft_s))
            )
        except RequestRefusedError as exc:
            assert exc.reason == "slo_unattainable"
            refused.append(f"r{i}")
    return refused


def test_the_registry_counts_each_block_once_per_request_and_forgets_cleanly():
    q = QueuedPrefixes()
    q.add("a", [1, 2, 3])
    q.add("b", [1, 2, 9])
    q.add("a", [7])  # already held: ignored
    assert all(h in q for h in (1, 2, 3, 9)) and 7 not in q and len(q) == 2
    q.discard("a")
    assert 1 in q and 2 in q and 9 in q and 3 not in q
    q.discard("a")  # twice: nothing
    q.discard("b")
    assert not any(h in q for h in (1, 2, 3, 9)) and len(q) == 0


@pytest.mark.parametrize("deadline_steps", [False, True])
def test_a_burst_sharing_a_prompt_is_admitted_and_computes_it_once(deadline_steps):
    """Four requests with one 400-token prompt, 1.2 s to the first token: the first computes the
    prompt (~0.41 s), the others wait for its blocks and take them from the cache."""
    s, r, _ = make_scheduler(FakeRunner(num_blocks=1024), deadline_steps=deadline_steps)
    _teach_speed(s)
    assert _burst(s, [PROMPT] * 4, ttft_s=1.2) == []
    assert [s.requests[f"r{i}"].expected_cached_tokens for i in range(4)] == [0, 399, 399, 399]
    outputs = drain(s, r)
    assert all(outputs[f"r{i}"][-1].finish_reason == "length" for i in range(4))
    assert s.counters.prefix_hit_tokens_total == 3 * 399  # as admission expected: computed once
    assert len(s.queued_prefixes) == 0
    assert_all_free(s)


@pytest.mark.parametrize("deadline_steps", [False, True])
def test_the_same_burst_without_a_shared_prompt_is_refused(deadline_steps):
    """The control: four different 400-token prompts cannot all start within 1.2 s."""
    s, r, _ = make_scheduler(FakeRunner(num_blocks=1024), deadline_steps=deadline_steps)
    _teach_speed(s)
    prompts = [[t + 1000 * i for t in PROMPT] for i in range(4)]
    refused = _burst(s, prompts, ttft_s=1.2)
    assert refused and "r0" not in refused
    assert all(s.requests[k].expected_cached_tokens == 0 for k in s.requests)
    drain(s, r)
    assert_all_free(s)


def test_blocks_a_running_request_is_computing_count_as_cached():
    s, r, _ = make_scheduler(FakeRunner(num_blocks=1024), prefill_chunk=64, max_batched_tokens=64)
    _teach_speed(s)
    s.add_request(NewRequest("first", PROMPT, SamplingParams(max_tokens=4)))
    step(s, r)  # its first chunk runs; it claims the rest of its prompt's blocks
    assert len(s.queued_prefixes) == 0  # started: no longer held as queued
    s.add_request(NewRequest("second", PROMPT, SamplingParams(max_tokens=4)))
    assert s.requests["second"].expected_cached_tokens == 399
    drain(s, r)
    assert_all_free(s)


def test_a_queued_request_that_leaves_is_forgotten():
    s, r, _ = make_scheduler(FakeRunner(num_blocks=1024))
    _teach_speed(s)
    s.add_request(NewRequest("a", PROMPT, SamplingParams(max_tokens=4)))
    s.add_request(NewRequest("b", PROMPT, SamplingParams(max_tokens=4)))
    assert len(s.queued_prefixes) == 2
    s.abort("a")
    s.abort("b")
    assert len(s.queued_prefixes) == 0
    s.add_request(NewRequest("c", PROMPT, SamplingParams(max_tokens=4)))
    assert s.requests["c"].expected_cached_tokens == 0  # nobody left to compute it
    drain(s, r)
    assert_all_free(s)


def test_prompt_hashes_continue_the_chain_find_prefix_began():
    s, _, _ = make_scheduler(FakeRunner(num_blocks=1024))
    bm = s.block_manager
    whole = bm.prompt_hashes(PROMPT)
    assert len(whole) == len(PROMPT) // 4 and len(set(whole)) == len(whole)
    assert bm.prompt_hashes(PROMPT, whole[:10]) == whole
