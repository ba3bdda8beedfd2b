"""Statistics against hand-computed cases: percentiles, TTFT/TPOT/ITL/E2E, attainment, goodput."""

from __future__ import annotations

import pytest
from sloserve.bench.stats import (
    RequestRecord,
    effective_slo,
    meets_slo,
    rate_at_attainment,
    summarise,
    summary,
)
from sloserve.sampling_params import SLO


def record(send, chunks, end, tokens=None, status="ok", **kw) -> RequestRecord:
    """chunks: list of (arrival time, tokens in the chunk)."""
    r = RequestRecord(
        "r",
        send,
        chunk_times=[t for t, _ in chunks],
        chunk_tokens=[n for _, n in chunks],
        end_time=end,
        status=status,
        **kw,
    )
    r.output_tokens = sum(n for _, n in chunks) if tokens is None else tokens
    return r


def test_summary_percentiles_interpolate_linearly():
    s = summary([4.0, 1.0, 3.0, 2.0])
    assert s["mean"] == pytest.approx(2.5)
    assert s["p50"] == pytest.approx(2.5)
    assert s["p90"] == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7 -> 3 + 0.7
    assert s["p99"] == pytest.approx(3.97)
    assert summary([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_request_timings_follow_vllm_definitions():
    r = record(10.0, [(10.5, 1), (10.7, 2), (11.0, 1)], 11.1)
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.2, 0.3])
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)  # 4 tokens: 3 after the first
    one = record(0.0, [(0.4, 1)], 0.5)
    assert one.tpot is None and one.itl == []
    refused = record(0.0, [], 0.1, status="refused")
    assert refused.ttft is None and refused.tpot is None


def test_meets_slo_needs_every_objective_given():
    r = record(0.0, [(0.3, 1), (0.5, 1), (0.7, 1)], 0.8)  # ttft .3, tpot .25, e2e .8
    assert meets_slo(r, None)
    assert meets_slo(r, SLO(ttft_s=0.3, tpot_s=0.25, e2e_s=0.8))
    assert not meets_slo(r, SLO(ttft_s=0.29))
    assert not meets_slo(r, SLO(ttft_s=1.0, tpot_s=0.2))
    assert not meets_slo(r, SLO(e2e_s=0.79))
    assert meets_slo(record(0.0, [(0.1, 1)], 0.2), SLO(tpot_s=0.001))  # one token: TPOT counts as 0
    assert not meets_slo(record(0.0, [], 0.01, status="refused"), None)


def test_effective_slo_prefers_the_request_fields():
    assert effective_slo(None, None) is None
    assert effective_slo(SLO(ttft_s=1.0), None) == SLO(ttft_s=1.0)
    assert effective_slo(SLO(ttft_s=1.0), SLO(ttft_s=2.0, e2e_s=5.0)) == SLO(ttft_s=1.0, e2e_s=5.0)


def test_summarise_counts_attainment_goodput_and_throughput():
    good = record(
        0.0,
        [(0.2, 1), (0.4, 2)],
        0.5,
        prompt_tokens=10,
        cached_tokens=4,
        expected_output="12\n",
        text="12\n\nInput:",
        finish_reason="length",
    )
    slow = record(
        0.0,
        [(1.5, 1), (1.6, 1)],
        1.7,
        prompt_tokens=20,
        expected_output="3\n",
        text="4\n",
        finish_reason="stop",
    )
    single = record(1.0, [(1.1, 1)], 1.2, prompt_tokens=5, finish_reason="stop")
    refused = record(
        1.0, [], 1.05, status="refused", error_code="RESOURCE_EXHAUSTED", error_reason="queue_full"
    )
    failed = record(1.0, [], 1.3, status="failed", error_code="UNAVAILABLE")
    out = summarise([good, slow, single, refused, failed], 2.0, SLO(ttft_s=1.0, tpot_s=0.5), 4.0)
    assert (out["completed"], out["refused"], out["failed"], out["requests"]) == (3, 1, 1, 5)
    assert out["refusals"] == {"RESOURCE_EXHAUSTED:queue_full": 1, "UNAVAILABLE": 1}
    assert out["slo_attainment"] == pytest.approx(2 / 5)  # good and single; slow misses TTFT
    assert out["goodput"] == pytest.approx(1.0)
    assert out["request_throughput"] == pytest.approx(1.5)
    assert out["output_token_throughput"] == pytest.approx((3 + 2 + 1) / 2.0)
    assert (out["prompt_tokens"], out["prefix_hit_tokens"]) == (35, 4)
    assert out["exact_match"] == pytest.approx(0.5)
    assert out["rate"] == 4.0
    assert out["ttft_s"]["mean"] == pytest.approx((0.2 + 1.5 + 0.1) / 3)
    assert out["itl_s"]["mean"] == pytest.approx((0.2 + 0.1) / 2)
    assert out["tpot_s"]["p50"] == pytest.approx((0.3 / 2 + 0.2) / 2)
    assert out["e2e_s"]["p50"] == pytest.approx(0.5)
    lengths = out["output_tokens_per_request"]
    assert (lengths["min"], lengths["p50"], lengths["max"]) == (1, 2, 3)
    assert out["finish_reasons"] == {"stop": 2, "length": 1}


def test_summarise_per_request_slo_and_infinite_rate():
    loose = record(0.0, [(0.9, 1)], 1.0, slo=SLO(ttft_s=2.0))
    out = summarise([loose], 1.0, SLO(ttft_s=0.5), float("inf"))
    assert out["slo_attainment"] == 1.0 and out["rate"] is None
    empty = summarise([], 0.0, None, 1.0)
    assert empty["slo_attainment"] is None and empty["request_throughput"] is None


def test_rate_at_attainment_interpolates_the_crossing():
    points = [(1.0, 1.0), (4.0, 0.87), (2.0, 0.97), (8.0, 0.5)]
    assert rate_at_attainment(points) == pytest.approx(2.4)  # 2 + 2 * (0.97 - 0.95) / 0.10
    assert rate_at_attainment([(1.0, 0.9)]) is None
    assert rate_at_attainment([(1.0, 0.99), (3.0, 0.96)]) == 3.0
