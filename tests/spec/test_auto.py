"""`--speculation auto`: the draft cap follows the fitted row cost, the batch and the acceptance,
and the tokens stay those of decoding one at a time."""

from __future__ import annotations

import pytest
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams
from sloserve.spec.auto import PRIOR_ACCEPTANCE, DraftPlanner, expected_tokens

from tests.engine.fakes import FakeRunner, reference_tokens
from tests.engine.helpers import (
    assert_all_free,
    drain,
    make_scheduler,
    random_prompts,
    step,
    tokens_of,
)


def fitted(base_s: float, per_row_s: float, host_s: float, most: int = 8) -> DraftPlanner:
    """A planner that has seen steps of 1 to 20 rows cost base + per_row * rows, and `host_s` of
    host time per schedule."""
    planner = DraftPlanner(most)
    for rows in [1, 5, 20, 2, 9, 1, 16, 3] * 4:
        compute = base_s + per_row_s * rows
        planner.observe_step(rows, 1, compute, compute + host_s)
    return planner


def test_expected_tokens_is_the_mean_run_a_verify_step_keeps():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == 5.0


def test_the_cap_is_the_most_drafts_until_the_rows_cost_is_fitted():
    planner = DraftPlanner(6)
    assert planner.acceptance == PRIOR_ACCEPTANCE
    assert planner.cap(1, 8) == 6 and planner.cap(32, 8) == 6
    planner.observe_step(1, 1, 1e-3, 2e-3)  # one size of step: no slope yet
    assert planner.cap(1, 8) == 6


def test_deep_for_one_request_when_a_step_is_mostly_fixed_cost_none_for_a_large_batch():
    # the 3.1M model's shape: ~0.4 ms a step, ~0.1 ms a row, ~0.3 ms of host work a schedule
    planner = fitted(0.4e-3, 0.1e-3, 0.3e-3)
    for _ in range(10):
        planner.observe_verify(4, 3)  # prompt lookup on ARC grids keeps most drafts
    assert planner.cap(1, 8) >= 4
    assert planner.cap(16, 8) == 0
    assert 0 < planner.cap(2, 8) <= planner.cap(1, 8)


def test_no_drafts_when_they_are_mostly_rejected_or_rows_cost_a_whole_step():
    planner = fitted(0.4e-3, 0.1e-3, 0.3e-3)
    for _ in range(20):
        planner.observe_verify(4, 0)
    assert planner.acceptance < 0.05 and planner.cap(1, 8) == 0
    assert fitted(0.0, 1e-3, 0.0).cap(1, 8) == 0  # a row costs what it earns at best


def test_the_host_cost_of_losing_a_run_of_decode_steps_counts_against_drafts():
    """The same row costs: drafts pay when a schedule runs one step either way, not when `off`
    would share one schedule's host work over 8 decode steps."""
    planner = fitted(0.2e-3, 0.1e-3, 2e-3)
    for _ in range(10):
        planner.observe_verify(4, 1)
    assert planner.cap(4, 1) > 0
    assert planner.cap(4, 8) == 0


@pytest.mark.parametrize("max_batch", [1, 8])
def test_auto_gives_the_tokens_of_decoding_one_at_a_time(max_batch):
    r = FakeRunner(vocab=(97, 99))
    s, r, _ = make_scheduler(r, speculation="auto", num_speculative_tokens=4, max_batch=max_batch)
    prompts = random_prompts(4, 3, 20, seed=max_batch, alphabet="ab")
    for i, prompt in enumerate(prompts):
        s.add_request(NewRequest(f"r{i}", prompt, SamplingParams(max_tokens=24, ignore_eos=True)))
    collected = drain(s, r)
    for i, prompt in enumerate(prompts):
        assert tokens_of(collected[f"r{i}"]) == reference_tokens(r, prompt, 24), f"r{i}"
    # no step costs were reported (no engine): the planner probes with the most drafts
    assert s.counters.spec_drafted_tokens_total > 0
    assert_all_free(s)


def test_a_planner_that_says_drafts_do_not_pay_schedules_plain_decode_runs():
    r = FakeRunner(vocab=(97, 99))
    s, r, _ = make_scheduler(r, speculation="auto", num_scheduler_steps=4, adaptive_batch=False)
    s.planner = fitted(0.0, 1e-3, 0.0)
    for i, prompt in enumerate(random_prompts(3, 3, 10, seed=1, alphabet="ab")):
        s.add_request(NewRequest(f"r{i}", prompt, SamplingParams(max_tokens=40, ignore_eos=True)))
    runs = 0
    while s.has_work():
        out, _ = step(s, r)
        assert not any(seq.num_drafts for seq in out.sequences)
        runs += out.num_steps > 1
    assert runs > 0 and s.counters.spec_drafted_tokens_total == 0
    assert_all_free(s)
