"""The mixed step-cost model: a slope per prompt token and per decoding sequence, and its margin."""

from __future__ import annotations

import random

import pytest
from sloserve.sched.slo.deadlines import DeadlinePlan
from sloserve.sched.slo.step_model import MixedStepModel, StepPrice

OVERHEAD, PER_TOKEN, PER_DECODE = 0.002, 6e-5, 3e-4


def _feed(model: MixedStepModel, steps: int, seed: int = 0, noise: float = 0.0) -> None:
    rng = random.Random(seed)
    for _ in range(steps):
        prompt, decodes = rng.choice([0, 16, 64, 200, 512]), rng.randrange(0, 40)
        jitter = rng.gauss(0.0, noise) if noise else 0.0
        model.observe(
            prompt, decodes, OVERHEAD + PER_TOKEN * prompt + PER_DECODE * decodes + jitter
        )


def test_the_fit_recovers_both_slopes_and_the_overhead():
    model = MixedStepModel()
    _feed(model, 200)
    overhead, per_token, per_decode = model.fit()
    assert overhead == pytest.approx(OVERHEAD, rel=1e-6)
    assert per_token == pytest.approx(PER_TOKEN, rel=1e-6)
    assert per_decode == pytest.approx(PER_DECODE, rel=1e-6)
    assert model.margin() == pytest.approx(0.0, abs=1e-9)  # an exact fit overruns nothing


def test_no_fit_until_both_kinds_have_varied_apart():
    only_decodes = MixedStepModel()
    for b in (1, 4, 16, 64) * 5:
        only_decodes.observe(0, b, OVERHEAD + PER_DECODE * b)
    assert only_decodes.fit() is None  # the prompt slope was never seen
    together = MixedStepModel()
    for n in (1, 4, 16, 64) * 5:  # prompt tokens and decodes always in the same proportion
        together.observe(8 * n, n, OVERHEAD + PER_TOKEN * 8 * n + PER_DECODE * n)
    assert together.fit() is None
    assert MixedStepModel().fit() is None


def test_the_margin_is_the_fits_recent_overrun_at_the_80th_percentile():
    model = MixedStepModel()
    _feed(model, 400, noise=0.002)
    assert 0.0012 < model.margin() < 0.0025  # N(0, 2 ms): its 80th percentile is ~1.7 ms


def test_the_plan_prices_decoding_sequences_apart_from_prompt_tokens():
    price = StepPrice(overhead_s=0.002, per_token_s=1e-4, per_decode_s=5e-4, margin_s=0.001)
    plan = DeadlinePlan(price, [], now=0.0, chunk=512, max_wait_s=2.0, step_tokens=2048)
    plan.cap_s = 0.013
    # 10 decodes take 5 ms of the 13 ms cap; 2 ms overhead and 1 ms margin leave 5 ms: 50 tokens
    assert plan.room(0, 10) == 50
    # 19 + 1 decodes: 12 + 1 ms, 21: 13.5 ms
    assert plan.decode_fits(0, 18) and not plan.decode_fits(0, 20)
    flat = DeadlinePlan(
        StepPrice(0.002, 1e-4), [], now=0.0, chunk=512, max_wait_s=2.0, step_tokens=2048
    )
    flat.cap_s = 0.013
    assert flat.room(0, 10) == 100  # without a decode slope a decode costs one token
