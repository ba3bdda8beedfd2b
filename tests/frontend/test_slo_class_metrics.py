"""sloserve_slo_requests_total{slo_class, outcome} and the TTFT prediction error gauges."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from sloserve.config import SloserveConfig
from sloserve.engine.outputs import EngineStats
from sloserve.frontend import Frontend, ParsedRequest, RequestHandle
from sloserve.frontend.failures import FailureCode
from sloserve.frontend.metrics import (
    SLO_CLASSES,
    SLO_OUTCOMES,
    Metrics,
    slo_class,
    slo_outcome,
    slo_outcomes,
)
from sloserve.frontend.requests import Finished
from sloserve.sampling_params import SLO, SamplingParams
from sloserve.testing.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(30)

INTERACTIVE = SLO(ttft_s=0.3, tpot_s=0.03, e2e_s=2.0)


def _counts(metrics: Metrics) -> dict[tuple[str, str], float]:
    """Every non-zero (slo_class, outcome) count."""
    counts = {}
    for label in SLO_CLASSES:
        for outcome in SLO_OUTCOMES:
            value = metrics.registry.get_sample_value(
                "sloserve_slo_requests_total",
                {"model_name": metrics.model_name, "slo_class": label, "outcome": outcome},
            )
            # every series a class can have exists from the start, and no other
            assert (value is not None) == (outcome in slo_outcomes(label)), (label, outcome)
            if value:
                counts[label, outcome] = value
    return counts


def _request(slo: SLO | None) -> ParsedRequest:
    return ParsedRequest("hi", SamplingParams(), slo)


def _finished(ttft: float | None, e2e: float, tokens: int = 3, reason: str = "length") -> Finished:
    return Finished(reason, 4, tokens, 0, 0.0, ttft, e2e)


@pytest.mark.parametrize(
    ("slo", "label"),
    [
        (None, "none"),
        (SLO(), "none"),
        (SLO(e2e_s=30.0), "batch"),
        (SLO(ttft_s=1.0), "interactive"),
        (SLO(tpot_s=0.05, e2e_s=30.0), "interactive"),
        (INTERACTIVE, "interactive"),
    ],
)
def test_the_class_is_a_bounded_label_of_the_objectives(slo, label):
    assert slo_class(slo) == label


@pytest.mark.parametrize(
    ("slo", "finished", "outcome"),
    [
        (INTERACTIVE, _finished(0.2, 0.25), "met"),  # TPOT 25 ms
        (INTERACTIVE, _finished(0.31, 0.35), "missed"),  # TTFT over
        (INTERACTIVE, _finished(0.2, 0.28), "missed"),  # TPOT 40 ms
        (SLO(e2e_s=1.0), _finished(0.2, 1.5), "missed"),
        (SLO(tpot_s=0.001), _finished(0.2, 0.2, tokens=1), "met"),  # one token: TPOT 0
        (
            SLO(ttft_s=1.0),
            _finished(None, 0.1, tokens=0),
            "met",
        ),  # no token (max_tokens 0): its answer is judged
        (SLO(ttft_s=1.0), _finished(None, 1.5, tokens=0), "missed"),
        (None, _finished(5.0, 50.0), "unjudged"),  # no objective: never counted as met
        (SLO(), _finished(5.0, 50.0), "unjudged"),
        (None, _finished(0.1, 0.2, reason="cancelled"), "unjudged"),
        (SLO(e2e_s=30.0), _finished(0.1, 0.2, reason="stop"), "met"),
    ],
)
def test_met_or_missed_from_the_server_timings(slo, finished, outcome):
    assert slo_outcome(slo, finished) == outcome


def test_request_done_and_failed_count_by_class_and_outcome():
    metrics = Metrics()
    assert _counts(metrics) == {}
    metrics.request_done("length", _finished(0.2, 0.25), _request(INTERACTIVE))
    metrics.request_done("length", _finished(0.5, 0.6), _request(INTERACTIVE))
    metrics.request_done("stop", _finished(1.0, 10.0), _request(SLO(e2e_s=30.0)))
    metrics.request_done("cancelled", request=_request(None))  # abandoned by its client
    metrics.request_failed(
        FailureCode.RESOURCE_EXHAUSTED, "slo_unattainable", _request(INTERACTIVE)
    )
    metrics.request_failed(
        FailureCode.DEADLINE_EXCEEDED, "deadline_passed", _request(SLO(e2e_s=1.0))
    )
    metrics.request_failed(FailureCode.INTERNAL, "internal", _request(None))
    metrics.request_failed(FailureCode.UNAVAILABLE, "engine_dead", _request(SLO(e2e_s=1.0)))
    # rejected by an edge before the front end ran it: counted by outcome only
    metrics.request_failed(FailureCode.INVALID_ARGUMENT, "invalid_argument")
    metrics.request_done("length", _finished(0.1, 0.2))
    assert _counts(metrics) == {
        ("interactive", "met"): 1,
        ("interactive", "missed"): 1,
        ("interactive", "refused"): 1,
        ("batch", "met"): 1,
        ("batch", "refused"): 1,
        ("batch", "failed"): 1,
        ("none", "unjudged"): 1,
        ("none", "failed"): 1,
    }
    assert (
        metrics.registry.get_sample_value(
            "sloserve_requests_total", {"model_name": "default", "outcome": "length"}
        )
        == 3
    )


async def _frontend(engine: FakeEngine) -> tuple[Frontend, Metrics]:
    await engine.start()
    metrics = Metrics(engine.stats)
    return Frontend(engine, SloserveConfig(), metrics), metrics


async def _run(frontend: Frontend, parsed: ParsedRequest, engine_id: str = "r") -> list:
    frontend.check(parsed)
    return [e async for e in frontend.run(RequestHandle(engine_id, time.monotonic()), parsed)]


async def test_the_front_end_counts_what_it_ran_under_the_request_class():
    frontend, metrics = await _frontend(FakeEngine(step_s=0.001))
    await _run(frontend, ParsedRequest("abc", SamplingParams(max_tokens=3), SLO(ttft_s=10.0)), "a")
    await _run(frontend, ParsedRequest("abc", SamplingParams(max_tokens=3), SLO(e2e_s=1e-6)), "b")
    await _run(frontend, ParsedRequest("abc", SamplingParams(max_tokens=3)), "c")
    frontend.failure(ValueError("bad input at the edge"))  # no request: not in the class counter
    assert _counts(metrics) == {
        ("interactive", "met"): 1,
        ("batch", "missed"): 1,
        ("none", "unjudged"): 1,
    }


async def test_an_admission_refusal_counts_as_refused():
    frontend, metrics = await _frontend(FakeEngine(max_running=0))
    await _run(frontend, ParsedRequest([1, 2], SamplingParams(max_tokens=2), SLO(ttft_s=1.0)))
    assert _counts(metrics) == {("interactive", "refused"): 1}


async def test_an_abandoned_request_counts_as_missed():
    frontend, metrics = await _frontend(FakeEngine(step_s=0.01))
    events = frontend.run(
        RequestHandle("x", time.monotonic()),
        ParsedRequest("hi", SamplingParams(max_tokens=50), SLO(e2e_s=30.0)),
    )
    await anext(events)
    await events.aclose()
    assert _counts(metrics) == {("batch", "missed"): 1}


def _value(metrics: Metrics):
    """get_sample_value with the model_name label every series carries."""
    return lambda name, labels=None: metrics.registry.get_sample_value(
        name, {"model_name": metrics.model_name, **(labels or {})}
    )


def test_ttft_prediction_error_gauges_from_engine_stats():
    stats = EngineStats(
        ttft_predictions=7, ttft_prediction_error_p50_s=-0.01, ttft_prediction_error_p90_s=0.25
    )
    value = _value(Metrics(lambda: stats))
    assert value("sloserve_ttft_prediction_error_seconds", {"quantile": "0.5"}) == pytest.approx(
        -0.01
    )
    assert value("sloserve_ttft_prediction_error_seconds", {"quantile": "0.9"}) == pytest.approx(
        0.25
    )
    assert value("sloserve_ttft_predictions_total") == 7


def test_stats_without_prediction_fields_read_as_zero():
    fields = (
        "waiting",
        "running",
        "kv_blocks_total",
        "kv_blocks_free",
        "kv_blocks_cached",
        "prompt_tokens_total",
        "prefix_hit_tokens_total",
        "generated_tokens_total",
        "preemptions_total",
        "step_time_s",
    )
    # an engine from before the fields
    older = SimpleNamespace(**dict.fromkeys(fields, 0), refusals={})
    value = _value(Metrics(lambda: older))
    assert value("sloserve_ttft_prediction_error_seconds", {"quantile": "0.9"}) == 0.0
    assert value("sloserve_ttft_predictions_total") == 0
