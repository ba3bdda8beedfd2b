"""Admission refuses only what would miss; priming and recovery of its cost model; the priority policy."""

from __future__ import annotations

import pytest
from sloserve.config import SchedulerConfig
from sloserve.engine.outputs import EngineStats
from sloserve.engine.priming import prime, priming_shapes
from sloserve.errors import RequestRefusedError
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SLO, SamplingParams
from sloserve.sched.slo import admission

from tests.engine.fakes import FakeRunner
from tests.engine.helpers import drain, make_scheduler, step

OVERHEAD_S, PER_TOKEN_S = 0.01, 0.001


def _busy(s, r, n: int = 4, max_tokens: int = 300) -> None:
    """A full batch of long decodes and a step-cost model that knows steps of 10 ms + 1 ms/token."""
    for tokens in (1, 2, 500, 3, 1000, 1):
        s.admission.on_compute(tokens, OVERHEAD_S + PER_TOKEN_S * tokens)
    for i in range(n):
        s.add_request(
            NewRequest(
                f"run{i}", [97 + i] * 6, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            )
        )
    step(s, r)
    step(s, r)


def _scheduler(**sched):
    # NOTE: without slack preemption, so the running requests hold their slots
    return make_scheduler(
        FakeRunner(num_blocks=512, num_host_blocks=0),
        max_batch=4,
        adaptive_batch=False,
        slack_preemption=False,
        **sched,
    )


def test_a_request_without_objectives_is_never_refused_for_time():
    s, r, _ = _scheduler()
    _busy(s, r)
    # its first token is ~4 s away
    s.add_request(NewRequest("patient", [98] * 6, SamplingParams(max_tokens=4)))
    # ... and predicted so (the default 2 s is no objective)
    assert s.requests["patient"].predicted_ttft_s > 2.0


def test_an_end_to_end_objective_is_refused_only_when_even_the_first_token_is_late():
    s, r, _ = _scheduler()
    _busy(s, r)
    # ~4.2 s to a free slot: a 5 s end-to-end objective may still be met (no margin taken), a 4 s one cannot.
    s.add_request(NewRequest("fits", [98] * 6, SamplingParams(max_tokens=4), SLO(e2e_s=5.0)))
    with pytest.raises(RequestRefusedError, match="first token expected"):
        s.add_request(NewRequest("late", [99] * 6, SamplingParams(max_tokens=4), SLO(e2e_s=4.0)))


def test_the_ttft_prediction_error_is_measured_when_first_tokens_come():
    s, r, clock = _scheduler()
    for tokens in (1, 2, 500, 3, 1000, 1):
        s.admission.on_compute(tokens, OVERHEAD_S + PER_TOKEN_S * tokens)
    s.add_request(NewRequest("a", [97] * 6, SamplingParams(max_tokens=2), SLO(ttft_s=5.0)))
    predicted = s.requests["a"].predicted_ttft_s
    clock.t += 0.25
    drain(s, r)
    stats = EngineStats(**s.stats())
    assert stats.ttft_predictions == 1
    assert stats.ttft_prediction_error_p50_s == pytest.approx(predicted - 0.25)


def test_cycle_times_of_an_overload_are_forgotten_when_the_engine_goes_idle():
    s, r, clock = _scheduler()
    adm = s.admission
    for tokens in (1, 2, 500, 3, 1000, 1):
        adm.on_compute(tokens, OVERHEAD_S + PER_TOKEN_S * tokens)
    for _ in range(20):  # overload: each 4-sequence decode cycle took 1 s (a contended GIL)
        adm.on_step(clock.t, 4, False)
        clock.t += 1.0
    assert adm.step_costs()[0][0] + 4 * adm.step_costs()[0][1] > 0.5
    adm.on_idle()
    (overhead, per_seq), _ = adm.step_costs()
    assert overhead + 4 * per_seq < 0.05  # back to the compute-time model: ~14 ms
    # not refused
    s.add_request(NewRequest("light", [97] * 6, SamplingParams(max_tokens=2), SLO(ttft_s=0.1)))


def test_a_long_wait_is_priced_at_the_longer_run_step_time_not_a_lull():
    """On a contended machine step times swing by several times within a second: a request that
    waits hundreds of steps is priced at the long window's cycle time, not the last few dozen
    fast steps' (issue 12: a flood admitted during a lull missed its TTFT)."""
    s, r, clock = _scheduler()
    _busy(s, r)  # a newcomer waits ~300 decode steps for a slot
    adm = s.admission
    for seconds in [0.030] * 300 + [0.012] * 40:  # contended 30 ms cycles, then a lull of 12 ms
        adm.on_step(clock.t, 4, False, tokens=4, decodes=4)
        adm.on_compute(4, 0.011, decodes=4)
        clock.t += seconds
    s.add_request(NewRequest("patient", [98] * 6, SamplingParams(max_tokens=4)))
    predicted = s.requests["patient"].predicted_ttft_s
    assert predicted > 290 * 0.025  # the lull alone would say ~300 x 12 ms = 3.6 s
    # still admitted
    s.add_request(NewRequest("soon", [99] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=60.0)))


def test_the_front_ends_output_backlog_is_priced_and_fades_in_real_time():
    """A front end that hands first tokens out late adds its backlog to every TTFT (issue 12: a
    cold flood's admitted requests missed a 1 s TTFT by the front end's delay, not the engine's)."""
    s, r, clock = _scheduler()
    _busy(s, r)  # a newcomer's first token is ~4.2 s away
    adm = s.admission
    s.add_request(NewRequest("fits", [98] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=8.0)))
    adm.report_delivery_lag(1.0, clock.t)
    adm.report_delivery_lag(0.2, clock.t)  # a smaller report does not lower the backlog at once
    with pytest.raises(RequestRefusedError, match="output backlog in the front end"):
        s.add_request(NewRequest("behind", [99] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=8.0)))
    clock.t += 1.0  # nothing new reported: the backlog has drained
    assert adm.delivery_lag(clock.t) == 0.0
    s.add_request(NewRequest("later", [100] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=8.0)))


def test_long_waits_under_a_ttft_objective_calibrate_the_estimate_until_idle():
    s, r, _ = _scheduler()
    _busy(s, r)
    adm = s.admission
    s.add_request(NewRequest("no-ttft", [97] * 6, SamplingParams(max_tokens=4)))
    # overtaken by design: ignored
    adm.on_first_token(s.requests["no-ttft"], 10 * s.requests["no-ttft"].model_ttft_s)
    assert adm.calibration == 1.0
    for i in range(8):
        s.add_request(NewRequest(f"q{i}", [98] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=60.0)))
    for i in range(8):  # their first tokens came twice as late as the model said
        req = s.requests[f"q{i}"]
        adm.on_first_token(req, 2.0 * req.model_ttft_s)
    assert adm.calibration == pytest.approx(2.0)
    s.add_request(NewRequest("new", [99] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=60.0)))
    new = s.requests["new"]
    assert new.predicted_ttft_s == pytest.approx(2.0 * new.model_ttft_s, rel=1e-3)
    adm.on_first_token(new, 0.5 * new.model_ttft_s)  # early ones never lower it below 1
    assert adm.calibration >= 1.0
    adm.on_idle()
    assert adm.calibration == 1.0


def _first_tokens(s, late_s: float, n: int = 8, tag: str = "seen") -> None:
    """`n` requests under a TTFT objective got their first tokens `late_s` after their estimate."""
    for i in range(n):
        s.add_request(
            NewRequest(f"{tag}{i}", [90 + i] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=60.0))
        )
        req = s.requests[f"{tag}{i}"]
        s.admission.on_first_token(req, req.predicted_ttft_s + late_s)
        s.abort(f"{tag}{i}")


def test_next_in_line_the_margin_is_how_late_recent_first_tokens_came():
    """A request that starts at the next step is refused when its estimate plus the 90th
    percentile of recent first tokens' lateness (at most the share SLO_MARGIN leaves) misses its
    TTFT; before enough first tokens were seen, and once they are old, when its estimate passes
    SLO_MARGIN of the time left."""
    s, r, clock = _scheduler()
    _busy(s, r, n=2)  # two decodes running, two slots free: a newcomer starts at the next step
    s.add_request(NewRequest("probe", [98] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=60.0)))
    estimate = s.requests["probe"].predicted_ttft_s
    s.abort("probe")
    objective = estimate / 0.75  # its estimate is 75% of the objective: past the 60% share
    with pytest.raises(RequestRefusedError, match="first token expected"):
        s.add_request(
            NewRequest("early", [99] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=objective))
        )
    _first_tokens(s, late_s=0.0)
    s.add_request(
        NewRequest("on-time", [99] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=objective))
    )
    s.abort("on-time")
    # now most came half an objective late
    _first_tokens(s, late_s=0.5 * objective, n=16, tag="late")
    with pytest.raises(RequestRefusedError, match="first token expected"):
        s.add_request(
            NewRequest("after-late", [99] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=objective))
        )
    clock.t += admission.LATE_WINDOW_S + 1.0  # old first tokens say nothing of now: the share again
    step(s, r)  # (a step in flight again, as when the estimate was probed)
    assert s.admission.lateness(clock.t) is None
    with pytest.raises(RequestRefusedError, match="first token expected"):
        s.add_request(
            NewRequest("much-later", [99] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=objective))
        )
    _first_tokens(s, late_s=0.0, tag="again")
    assert s.admission.lateness(clock.t) == 0.0
    s.admission.on_idle()
    assert s.admission.lateness(clock.t) is None


class _TimedRunner(FakeRunner):
    """A fake runner whose steps take 2 ms + 0.5 ms per token, reported by time_steps."""

    def time_steps(self, shapes):
        return [(seqs, tokens, 0.002 + 0.0005 * seqs * tokens) for seqs, tokens in shapes]


def test_with_slack_preemption_a_newcomer_waits_for_no_slot_of_a_prompt_without_objectives():
    s, r, _ = make_scheduler(
        FakeRunner(num_blocks=512, num_host_blocks=0),
        max_batch=4,
        adaptive_batch=False,
        prefill_chunk=16,
    )
    for tokens in (1, 2, 500, 3, 1000, 1):
        s.admission.on_compute(tokens, OVERHEAD_S + PER_TOKEN_S * tokens)
    for i in range(4):  # long prompts without objectives, still prefilling: no token out yet
        s.add_request(NewRequest(f"long{i}", [97 + i] * 96, SamplingParams(max_tokens=8)))
    step(s, r)
    assert all(s.requests[f"long{i}"].first_token_time is None for i in range(4))
    # not refused
    s.add_request(NewRequest("tight", [98] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=1.0)))
    for _ in range(3):
        step(s, r)
    assert s.requests["tight"].num_output_tokens >= 1
    assert s.counters.preemptions_total == 1


def test_a_decoding_request_keeps_its_slot_and_the_newcomer_is_priced_behind_it():
    """Decodes free their slots by finishing: preempting one for a newcomer only churns, so
    admission prices the wait for their slots (here: past the TTFT, so it refuses)."""
    s, r, _ = make_scheduler(
        FakeRunner(num_blocks=512, num_host_blocks=0), max_batch=4, adaptive_batch=False
    )
    _busy(s, r)
    with pytest.raises(RequestRefusedError, match="steps for a slot in the full batch of 4"):
        s.add_request(NewRequest("tight", [98] * 6, SamplingParams(max_tokens=4), SLO(ttft_s=0.5)))
    assert s.counters.preemptions_total == 0


def test_priming_prices_steps_before_any_request_ran():
    s, r, _ = make_scheduler(_TimedRunner())
    assert s.admission.step_costs() is None  # a fresh model admits blindly
    fed = prime(r, s.admission, s.config, s.max_model_len)
    assert fed == len(priming_shapes(s.config, s.max_model_len)) >= 5
    overhead, per_token = s.admission.speed.fit()
    assert overhead == pytest.approx(0.002, abs=1e-4) and per_token == pytest.approx(
        0.0005, rel=0.01
    )


def test_priming_shapes_span_decode_batches_and_prefill_chunks():
    shapes = priming_shapes(SchedulerConfig(max_batch=64, prefill_chunk=512), 4096)
    assert (1, 1) in shapes and (64, 1) in shapes and (1, 512) in shapes and (1, 128) in shapes
    assert all(seqs == 1 or tokens == 1 for seqs, tokens in shapes)


# ---- the priority policy -----------------------------------------------------------------


def test_priority_runs_lower_values_first_and_fifo_within_a_priority():
    s, r, _ = make_scheduler(
        FakeRunner(num_blocks=512),
        policy="priority",
        max_batch=1,
        adaptive_batch=False,
        admission_control=False,
    )
    for name, prio in (("b1", 1), ("a0", 0), ("c1", 1), ("d0", 0)):
        s.add_request(NewRequest(name, [97] * 4, SamplingParams(max_tokens=1), priority=prio))
    order = []
    for _ in range(20):
        out, outputs = step(s, r)
        order += [o.request_id for o in outputs if o.finished]
    assert order == ["a0", "d0", "b1", "c1"]


def test_priority_preempts_the_highest_value_then_the_latest_arrival():
    s, r, clock = make_scheduler(
        FakeRunner(num_blocks=10, num_host_blocks=0, max_model_len=256),
        policy="priority",
        preemption_mode="recompute",
        adaptive_batch=False,
    )
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    s.add_request(NewRequest("urgent", [97] * 6, params, priority=0))
    clock.t += 1
    s.add_request(NewRequest("old-low", [98] * 6, params, priority=2))
    clock.t += 1
    s.add_request(NewRequest("new-mid", [99] * 6, params, priority=1))
    for _ in range(40):
        step(s, r)
        preempted = [q.request_id for q in s.requests.values() if q.num_preemptions]
        if preempted:
            assert preempted == ["old-low"]
            return
    raise AssertionError("the pool never ran out")
