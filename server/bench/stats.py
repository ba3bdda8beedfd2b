"""Per-request timings and the statistics of a run, defined as vLLM's ``bench serve`` defines them.

For one request sent at time s whose chunks arrive at t_1 < t_2 < ... and whose terminal
message arrives at t_end (all client clock):

    TTFT = t_1 - s                          time to the first chunk
    ITL  = [t_i - t_{i-1} for i >= 2]       one gap per chunk after the first
    E2E  = t_end - s                        end-to-end latency
    TPOT = (E2E - TTFT) / (n_out - 1)       when n_out > 1, else undefined (and 0 for goodput)

A request meets its SLO when it completed and every objective given holds (TTFT, TPOT, E2E);
SLO attainment is that count over every request sent (refused and failed ones miss), and
goodput is that count per second of the run (the DistServe / vLLM definition). Each request
also belongs to an SLO class, its workload's explicit ``class`` or a name derived from its
effective objectives (``slo_class_name``), and the run's figures are repeated per class (goodput
per class still divides by the whole run's span).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
from sloserve.bench.record import RequestRecord
from sloserve.bench.vllm_compat import vllm_fields
from sloserve.sampling_params import SLO

PERCENTILES = (50, 90, 99)
OBJECTIVES = ("ttft", "tpot", "e2e")  # the names missed_objectives reports


def summary(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (numpy's linear interpolation); None for each when there are no values."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(arr.mean()),
        **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES},
    }


def effective_slo(own: SLO | None, run: SLO | None) -> SLO | None:
    """A request's own objectives, each falling back to the run's."""
    if own is None or run is None:
        return own or run
    return SLO(
        *(
            a if a is not None else b
            for a, b in ((own.ttft_s, run.ttft_s), (own.tpot_s, run.tpot_s), (own.e2e_s, run.e2e_s))
        )
    )


def slo_class_name(slo: SLO | None) -> str:
    """A class name from objectives, e.g. 'ttft<=0.3s tpot<=30ms e2e<=2s', or 'no objective'."""
    if slo is None:
        return "no objective"
    parts = [
        f"{name}<={value * scale:g}{unit}"
        for name, value, scale, unit in (
            ("ttft", slo.ttft_s, 1.0, "s"),
            ("tpot", slo.tpot_s, 1e3, "ms"),
            ("e2e", slo.e2e_s, 1.0, "s"),
        )
        if value is not None
    ]
    return " ".join(parts) or "no objective"


def meets_slo(record: RequestRecord, slo: SLO | None) -> bool:
    """Completed, and every objective given holds (a one-token request has TPOT 0)."""
    return record.status == "ok" and not missed_objectives(record, slo)


def missed_counts(checked: Iterable[tuple[RequestRecord, SLO | None]]) -> dict[str, int]:
    """Completed requests that missed each of OBJECTIVES, from (record, its objectives) pairs
    (one request may miss several)."""
    counts = dict.fromkeys(OBJECTIVES, 0)
    for record, slo in checked:
        if record.status == "ok":
            for objective in missed_objectives(record, slo):
                counts[objective] += 1
    return counts


def missed_objectives(record: RequestRecord, slo: SLO | None) -> list[str]:
    """Which of 'ttft', 'tpot', 'e2e' a completed request missed (all of its objectives if it did
    not complete)."""
    if slo is None:
        return []
    checks = zip(
        OBJECTIVES,
        (slo.ttft_s, slo.tpot_s, slo.e2e_s),
        (record.ttft, record.tpot or 0.0, record.e2e),
        strict=True,
    )
    done = record.status == "ok"
    return [
        name
        for name, limit, value in checks
        if limit is not None and (not done or value is None or value > limit)
    ]


def normalise_output(text: str) -> str:
    """The answer part of a generated ARC grid: up to the first blank line, outer whitespace removed."""
    return text.split("\n\n", 1)[0].strip()


def summarise(
    records: list[RequestRecord], duration_s: float, slo: SLO | None, rate: float | None
) -> dict:
    """One run's figures: the JSON schema of `sloserve bench` (see report.py)."""
    done = [r for r in records if r.status == "ok"]
    refused = [r for r in records if r.status == "refused"]
    refusals: dict[str, int] = {}
    for r in records:
        if r.status in ("refused", "failed"):
            key = f"{r.error_code}:{r.error_reason}" if r.error_reason else str(r.error_code)
            refusals[key] = refusals.get(key, 0) + 1
    met = [meets_slo(r, effective_slo(r.slo, slo)) for r in records]
    good = sum(met)
    graded = [r for r in done if r.expected_output is not None]
    matched = sum(
        normalise_output(r.text) == normalise_output(r.expected_output or "") for r in graded
    )
    seconds = duration_s if duration_s > 0 else math.nan
    output_tokens = sum(r.output_tokens for r in done)
    finish_reasons: dict[str, int] = {}
    for r in done:
        reason = r.finish_reason or "unspecified"
        finish_reasons[reason] = finish_reasons.get(reason, 0) + 1
    lengths = [r.output_tokens for r in done]
    return {
        "rate": rate if rate is not None and math.isfinite(rate) else None,
        "requests": len(records),
        "completed": len(done),
        "refused": len(refused),
        "failed": len(records) - len(done) - len(refused),
        "refusals": refusals,
        "duration_s": duration_s,
        "request_throughput": _finite(len(done) / seconds),
        "output_token_throughput": _finite(output_tokens / seconds),
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": output_tokens,
        "output_tokens_per_request": {
            **summary(lengths),
            "min": min(lengths, default=None),
            "max": max(lengths, default=None),
        },
        "finish_reasons": finish_reasons,  # 'stop': end-of-sequence or a stop string; 'length': max_tokens
        "prefix_hit_tokens": sum(r.cached_tokens for r in done),
        "slo_attainment": good / len(records) if records else None,
        "goodput": _finite(good / seconds),
        "exact_match": matched / len(graded) if graded else None,
        "ttft_s": summary([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": summary([r.tpot for r in done if r.tpot is not None]),
        "itl_s": summary([gap for r in done for gap in r.itl]),
        "e2e_s": summary([r.e2e for r in done if r.e2e is not None]),
        "classes": _classes(records, met, slo, seconds),
        "vllm": vllm_fields(records, duration_s, good),
    }


def _classes(
    records: list[RequestRecord], met: list[bool], slo: SLO | None, seconds: float
) -> dict:
    """The run's figures per SLO class (sorted by name); goodput divides by the whole run's span."""
    groups: dict[str, list[tuple[RequestRecord, bool]]] = {}
    for r, ok in zip(records, met, strict=True):
        name = r.slo_class or slo_class_name(effective_slo(r.slo, slo))
        groups.setdefault(name, []).append((r, ok))
    classes = {}
    for name in sorted(groups):
        members = [r for r, _ in groups[name]]
        good = sum(ok for _, ok in groups[name])
        done = [r for r in members if r.status == "ok"]
        refused = sum(r.status == "refused" for r in members)
        classes[name] = {
            "requests": len(members),
            "completed": len(done),
            "refused": refused,
            "failed": len(members) - len(done) - refused,
            "slo_attainment": good / len(members),
            "goodput": _finite(good / seconds),
            "ttft_s": summary([r.ttft for r in done if r.ttft is not None]),
            "tpot_s": summary([r.tpot for r in done if r.tpot is not None]),
            "e2e_s": summary([r.e2e for r in done if r.e2e is not None]),
            "missed": missed_counts((r, effective_slo(r.slo, slo)) for r in done),
        }
    return classes


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def rate_at_attainment(points: list[tuple[float, float]], target: float = 0.95) -> float | None:
    """Highest request rate meeting the attainment target, from (rate, attainment) sweep points.

    Linear interpolation between the last rate that meets the target and the first one above it
    that does not; None when even the lowest rate misses; the highest rate when none misses.
    """
    points = sorted(points)
    if not points or points[0][1] < target:
        return None
    for (r0, a0), (r1, a1) in zip(points, points[1:], strict=False):
        if a1 < target:
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
    return points[-1][0]


def steady_throughput(records: list[RequestRecord]) -> float | None:
    """Completed requests per second of a closed loop between its first completion and its last
    send: neither the opening burst (every slot's prefill at once) nor the drain at the end (fewer
    requests in flight than the loop's limit) counts; None when that window holds none."""
    sent = [r.send_time for r in records if r.send_time]
    ends = sorted(r.end_time for r in records if r.status == "ok" and r.end_time is not None)
    if not sent or not ends:
        return None
    first, last = ends[0], max(sent)
    done = sum(first < end <= last for end in ends)
    return done / (last - first) if last > first and done else None
