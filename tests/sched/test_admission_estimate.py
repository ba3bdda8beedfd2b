"""The first-token estimate behind SLO admission: slot waits in a full batch, queue order, pricing."""

from __future__ import annotations

import pytest
from sloserve.errors import RequestRefusedError
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SLO, SamplingParams

from tests.engine.fakes import FakeRunner
from tests.engine.helpers import assert_all_free, drain, step
from tests.engine.helpers import make_scheduler as _make_scheduler

OVERHEAD_S, PER_TOKEN_S = 0.01, 0.001


def _teach_speed(s) -> None:
    """Timed steps of varied size: step = 10 ms + 1 ms per token."""
    for tokens in (1, 2, 500, 3, 1000, 1):
        s.admission.speed.observe(tokens, OVERHEAD_S + PER_TOKEN_S * tokens)


def _fill(s, r, n: int, max_tokens: int, prefix: str = "run") -> None:
    """Start `n` requests (no SLO) and step until all of them are decoding."""
    for i in range(n):
        s.add_request(
            NewRequest(
                f"{prefix}{i}", [97 + i] * 6, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            )
        )
    step(s, r)
    step(s, r)
    assert len(s.running) == n and all(q.num_output_tokens == 2 for q in s.running)


def make_scheduler(*args, **kw):
    """Slot waits as they are priced without slack preemption: running requests without objectives
    hold their slots (with it, an urgent newcomer takes theirs: test_admission_policy)."""
    kw.setdefault("slack_preemption", False)
    return _make_scheduler(*args, **kw)


def _runner() -> FakeRunner:
    return FakeRunner(num_blocks=512, num_host_blocks=0)


def test_a_full_batch_of_long_decodes_refuses_a_tight_slo():
    s, r, _ = make_scheduler(_runner(), max_batch=4, adaptive_batch=False)
    _fill(s, r, 4, max_tokens=200)
    _teach_speed(s)
    # Its prefill alone would take ~15 ms, but no slot frees for 198 decode steps (~2.8 s).
    with pytest.raises(RequestRefusedError) as info:
        s.add_request(NewRequest("tight", [98] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=0.5)))
    assert info.value.reason == "slo_unattainable"
    assert "198 steps for a slot in the full batch of 4" in str(info.value)
    assert s.stats()["refusals"] == {"slo_unattainable": 1}
    s.add_request(NewRequest("loose", [98] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=5.0)))
    drain(s, r)
    assert_all_free(s)


@pytest.mark.parametrize("deadline_steps", [False, True])
def test_an_empty_batch_admits_the_same_request(deadline_steps):
    s, r, _ = make_scheduler(
        _runner(), max_batch=4, adaptive_batch=False, deadline_steps=deadline_steps
    )
    _teach_speed(s)
    s.add_request(NewRequest("tight", [98] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=0.5)))
    est = s.admission.estimate(s.requests["tight"], [], [], 4)
    assert est is not None and est.slot_steps == 0 and est.steps == 1 and est.tokens == 6
    if deadline_steps:  # a step priced by the tokens it computes
        assert est.seconds == pytest.approx(OVERHEAD_S + 6 * PER_TOKEN_S)
    else:  # by past step times: one sequence, then its prompt tokens
        assert est.seconds == pytest.approx(OVERHEAD_S + PER_TOKEN_S + 6 * PER_TOKEN_S)
    drain(s, r)
    assert_all_free(s)


def test_a_prompt_alone_is_priced_as_the_one_step_it_runs_in():
    """Scheduler._alone: with nothing running or queued a prompt fills the step's token budget, not
    a chunk; admission prices it so, and in chunks again once anyone else is there."""
    s, r, _ = make_scheduler(
        _runner(), max_batch=4, adaptive_batch=False, prefill_chunk=16, max_batched_tokens=64
    )
    _teach_speed(s)
    s.add_request(NewRequest("alone", [98] * 40, SamplingParams(max_tokens=4), SLO(ttft_s=5.0)))
    assert s.admission.estimate(s.requests["alone"], [], [], 4).steps == 1
    # 16+16+8
    assert s.admission.estimate(s.requests["alone"], [], [s.requests["alone"]], 4).steps == 3
    out, _ = step(s, r)
    assert [len(q.token_ids) for q in out.sequences] == [40]
    drain(s, r)
    assert_all_free(s)


@pytest.mark.parametrize("deadline_steps", [False, True])
def test_an_idle_engine_refuses_a_prompt_only_when_its_own_prefill_misses(deadline_steps):
    """The margin is for waits behind others: on an idle engine a 60-token prompt (~70 ms, 70% of a
    100 ms TTFT) is admitted; one whose own prefill takes ~130 ms is refused."""
    s, r, _ = make_scheduler(
        _runner(), max_batch=4, adaptive_batch=False, deadline_steps=deadline_steps
    )
    _teach_speed(s)
    s.add_request(NewRequest("fits", [98] * 60, SamplingParams(max_tokens=2), SLO(ttft_s=0.1)))
    drain(s, r)
    with pytest.raises(RequestRefusedError) as info:
        s.add_request(
            NewRequest("misses", [99] * 120, SamplingParams(max_tokens=2), SLO(ttft_s=0.1))
        )
    assert info.value.reason == "slo_unattainable"
    drain(s, r)
    assert_all_free(s)


def test_a_full_batch_about_to_finish_admits_it():
    """Occupancy alone is not the wait: the running requests' remaining output tokens are."""
    s, r, _ = make_scheduler(_runner(), max_batch=4, adaptive_batch=False)
    _fill(s, r, 4, max_tokens=5)
    _teach_speed(s)
    s.add_request(NewRequest("tight", [98] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=0.5)))
    est = s.admission.estimate(s.requests["tight"], s.running, [], 4)
    assert est.slot_steps == 3 and est.steps == 4  # 3 more tokens each, then its prefill
    drain(s, r)
    assert_all_free(s)


def test_requests_ahead_take_the_slots_that_free_first():
    s, r, _ = make_scheduler(_runner(), max_batch=2, adaptive_batch=False)
    s.add_request(NewRequest("a", [97] * 6, SamplingParams(max_tokens=7, ignore_eos=True)))
    s.add_request(NewRequest("b", [98] * 6, SamplingParams(max_tokens=12, ignore_eos=True)))
    step(s, r)
    step(s, r)  # a: 5 steps left, b: 10
    _teach_speed(s)
    s.add_request(
        NewRequest("w", [99] * 6, SamplingParams(max_tokens=20, ignore_eos=True), SLO(ttft_s=30.0))
    )
    s.add_request(NewRequest("x", [100] * 6, SamplingParams(max_tokens=2), SLO(ttft_s=60.0)))
    est = s.admission.estimate(s.requests["x"], s.running, [s.requests["w"]], 2)
    # w takes a's slot at step 5 (and holds it until 25); x takes b's at step 10.
    assert (est.slot_steps, est.steps, est.ahead) == (10, 11, 1)
    first_token_step = {}
    while s.has_work():
        out, outputs = step(s, r)
        for o in outputs:
            first_token_step.setdefault(o.request_id, s.step_count - 2)
    assert first_token_step["x"] == est.steps
    assert_all_free(s)


def test_the_estimate_errs_late_but_close_on_a_priced_clock():
    """Steps cost exactly what the model says: the admitted request's real TTFT is within the estimate."""
    s, r, clock = make_scheduler(_runner(), max_batch=4, adaptive_batch=False)
    _fill(s, r, 4, max_tokens=30)
    for i in range(3):
        s.add_request(
            NewRequest(
                f"q{i}",
                [100 + i] * (5 + 7 * i),
                SamplingParams(max_tokens=10 + 5 * i, ignore_eos=True),
            )
        )
    _teach_speed(s)
    s.add_request(NewRequest("probe", [120] * 9, SamplingParams(max_tokens=3), SLO(ttft_s=5.0)))
    probe = s.requests["probe"]
    ahead = [q for q in s.waiting if q is not probe]
    est = s.admission.estimate(probe, s.running, ahead, 4)
    while probe.first_token_time is None:
        out, _ = step(s, r)
        clock.t += OVERHEAD_S + PER_TOKEN_S * out.num_tokens
    actual = probe.first_token_time - probe.arrival_time
    assert est.seconds >= actual and est.seconds <= 1.2 * actual, (est, actual)
    drain(s, r)
    assert_all_free(s)


@pytest.mark.parametrize("waited_s, refused", [(0.0, False), (0.5, True)])
def test_a_looser_request_past_the_starvation_guard_counts_as_ahead(waited_s, refused):
    """The queue's order without deadline steps: a request past the 200 ms guard goes first."""
    s, r, clock = make_scheduler(
        _runner(), max_batch=1, adaptive_batch=False, max_wait_s=0.2, deadline_steps=False
    )
    s.add_request(NewRequest("busy", [97] * 6, SamplingParams(max_tokens=10, ignore_eos=True)))
    step(s, r)
    s.add_request(
        NewRequest(
            "old",
            [98] * 6,
            SamplingParams(max_tokens=100, ignore_eos=True),
            SLO(ttft_s=10.0),
            arrival_time=clock.t - waited_s,
        )
    )
    _teach_speed(s)
    # Behind 'busy' alone: ~9 steps (~0.1 s). If 'old' has starved it runs first: ~110 steps.
    if refused:
        with pytest.raises(RequestRefusedError) as info:
            s.add_request(
                NewRequest("tight", [99] * 6, SamplingParams(max_tokens=2), SLO(ttft_s=0.5))
            )
        assert info.value.reason == "slo_unattainable" and "1 waiting ahead" in str(info.value)
    else:
        s.add_request(NewRequest("tight", [99] * 6, SamplingParams(max_tokens=2), SLO(ttft_s=0.5)))
    drain(s, r)
    assert_all_free(s)


def test_with_deadline_steps_the_least_slack_goes_first_despite_the_guard():
    s, r, clock = make_scheduler(_runner(), max_batch=1, adaptive_batch=False, max_wait_s=0.2)
    s.add_request(NewRequest("busy", [97] * 6, SamplingParams(max_tokens=10, ignore_eos=True)))
    step(s, r)
    s.add_request(
        NewRequest(
            "old",
            [98] * 6,
            SamplingParams(max_tokens=100, ignore_eos=True),
            SLO(ttft_s=10.0),
            arrival_time=clock.t - 0.5,
        )
    )
    _teach_speed(s)
    # admitted
    s.add_request(NewRequest("tight", [99] * 6, SamplingParams(max_tokens=2), SLO(ttft_s=0.5)))
    first = []
    while s.has_work():
        _, outputs = step(s, r)
        first += [o.request_id for o in outputs if o.request_id not in first and o.new_token_ids]
    assert first.index("tight") < first.index("old")
    assert_all_free(s)


def test_no_estimate_before_any_step_was_timed_admits():
    s, r, _ = make_scheduler(_runner(), max_batch=1, adaptive_batch=False)
    _fill(s, r, 1, max_tokens=200)
    s.add_request(NewRequest("tight", [98] * 6, SamplingParams(max_tokens=2), SLO(ttft_s=0.01)))
    assert s.admission.estimate(s.requests["tight"], s.running, [], 1) is None
    drain(s, r)
    assert_all_free(s)


def test_decode_only_timing_still_prices_the_slot_wait():
    """Only 1-token steps seen: no prefill speed, but the mean step time prices a wait of steps."""
    s, r, _ = make_scheduler(_runner(), max_batch=1, adaptive_batch=False)
    _fill(s, r, 1, max_tokens=200)
    for _ in range(10):
        s.admission.speed.observe(1, 0.02)
    assert s.admission.speed.fit() is None
    with pytest.raises(RequestRefusedError) as info:
        s.add_request(NewRequest("tight", [98] * 6, SamplingParams(max_tokens=2), SLO(ttft_s=1.0)))
    assert info.value.reason == "slo_unattainable"  # 198 steps of 20 ms
    drain(s, r)
    assert_all_free(s)


def test_steps_with_a_prefill_chunk_are_priced_apart_from_decode_steps():
    """A backend may run mixed steps far slower than decode-only ones: the wait prices each kind."""
    s, r, _ = make_scheduler(_runner(), max_batch=4, adaptive_batch=False)
    _fill(s, r, 4, max_tokens=10)  # 8 more steps each
    adm, t = s.admission, 0.0
    for _ in range(10):  # schedule-to-schedule cycles: decode-only 40 ms, with a prefill 300 ms
        adm.on_step(t, 4, False)
        t += 0.04
        adm.on_step(t, 4, True)
        t += 0.3
    req = s.add_request(
        NewRequest("probe", [98] * 6, SamplingParams(max_tokens=2), SLO(ttft_s=60.0))
    )
    est = adm.estimate(req, s.running, [], 4)
    assert (est.slot_steps, est.steps) == (8, 9)
    assert est.seconds == pytest.approx(8 * 0.04 + 0.3)  # 8 decode-only steps, then its own prefill
    drain(s, r)
    assert_all_free(s)


def test_the_kept_backlog_matches_one_built_from_scratch():
    """Same-SLO arrivals are priced against a Backlog extended in place; it must equal a fresh one."""
    s, r, _ = make_scheduler(_runner(), max_batch=3, adaptive_batch=False)
    _fill(s, r, 3, max_tokens=12)
    _teach_speed(s)
    for i in range(7):
        s.add_request(
            NewRequest(
                f"q{i}",
                [100 + i] * (4 + 3 * i),
                SamplingParams(max_tokens=3 + 4 * i),
                SLO(ttft_s=100.0),
            )
        )
    kept = s.admission._backlog
    assert kept is not None and kept.queued == 7
    fresh = s.admission.backlog(s.running, list(s.waiting), 3)
    assert sorted(kept.slots) == sorted(fresh.slots)
    assert (kept.pending, kept.occupants, kept.prefill_steps) == (
        fresh.pending,
        fresh.occupants,
        fresh.prefill_steps,
    )
    step(s, r)
    assert s.admission._backlog is None  # a step changes the batch: rebuilt on the next admission
    drain(s, r)
    assert_all_free(s)


def _light_load_admission(monkeypatch=None) -> list[str]:
    """An idle engine after light load: 64 single-decode steps and every eighth step a 400-480-token
    prompt, two of those eight after idle at 0.3 s instead of 50 ms (cold threads). The fit over
    every step then prices a 500-token prompt alone above a 0.1 s TTFT; prompt steps cost ~0.12 ms
    a token at their median. Returns which of a 500- and a 1,000-token prompt were admitted."""
    s, r, _ = make_scheduler(
        FakeRunner(num_blocks=512, num_host_blocks=0, max_model_len=2048),
        max_batch=4,
        adaptive_batch=False,
    )
    for i in range(64):
        s.admission.on_compute(1, 0.0007 + 0.0002 * (i % 3), decodes=1)
        if i % 8 == 0:
            s.admission.on_compute(400 + 20 * (i % 5), 0.3 if i % 32 == 0 else 0.05)
    if monkeypatch is not None:  # the idle check on the step model's price alone, as before
        monkeypatch.setattr(type(s.admission), "alone_seconds", lambda self, tokens: float("inf"))
    admitted = []
    for name, token, tokens in (("short", 98, 500), ("long", 99, 1000)):
        try:
            s.add_request(
                NewRequest(name, [token] * tokens, SamplingParams(max_tokens=2), SLO(ttft_s=0.1))
            )
            admitted.append(name)
        except RequestRefusedError:
            pass
        drain(s, r)
    return admitted


def test_an_idle_engine_prices_a_prompt_alone_at_recent_prompt_steps():
    """The 500-token prompt (~60 ms at the median) is admitted, the 1,000-token one (~120 ms) refused."""
    assert _light_load_admission() == ["short"]


def test_priced_by_the_fit_over_every_step_the_idle_engine_refuses_both(monkeypatch):
    assert _light_load_admission(monkeypatch) == []
