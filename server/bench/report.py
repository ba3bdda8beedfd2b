"""Bench reports: the JSON document (a stable interface), a text table, and latency plots.

JSON schema (``schema_version`` 1): top level ``server``, ``server_info``, ``workload``,
``config`` and ``runs``; each run (one per rate of a sweep) holds at least ``rate`` (null for
unpaced), ``completed``, ``refused``, ``duration_s``, ``request_throughput``,
``output_token_throughput``, ``prompt_tokens``, ``prefix_hit_tokens``, ``slo_attainment``,
``goodput``, and ``ttft_s``, ``tpot_s``, ``itl_s``, ``e2e_s`` each with ``mean``, ``p50``,
``p90``, ``p99`` (seconds; null when there is nothing to measure); ``output_tokens_per_request``
(the same plus ``min`` and ``max``, in tokens) and ``finish_reasons`` (completed requests per
reason: ``stop`` for end-of-sequence or a stop string, ``length`` for max_tokens); ``classes``,
one entry per SLO class (a workload line's ``class``, else a name derived from its effective
objectives such as ``ttft<=0.3s tpot<=30ms e2e<=2s``, or ``no objective``) holding
``requests``, ``completed``, ``refused``, ``failed``, ``slo_attainment`` (met / requests of the
class), ``goodput`` (met per second of the whole run) and ``ttft_s``, ``tpot_s``, ``e2e_s``
summaries; ``vllm``, the fields `vllm bench serve` writes for the same run under its names and
units (``request_throughput``, ``output_throughput``, ``mean_ttft_ms``, ``median_ttft_ms``,
``p99_ttft_ms`` ... for ttft, tpot, itl and e2el, ``request_goodput``; sloserve.bench.vllm_compat).
The text table shows a per-class table after the run table when a run holds more than
one class.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path

import orjson
from sloserve.bench.client import RunResult

SCHEMA_VERSION = 1


def build_report(
    server: str, server_info: dict, workload: str, config: dict, runs: list[dict]
) -> dict:
    """The JSON document of one bench invocation."""
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "sloserve bench",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "server": server,
        "server_info": server_info,
        "workload": workload,
        "config": config,
        "runs": runs,
    }


def write_json(report: dict, path: str | Path) -> None:
    """Write the report with orjson (indented, keys in a stable order)."""
    Path(path).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))


def _num(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _lengths(stats: dict | None) -> str:
    if not stats or stats.get("max") is None:
        return "-"
    return f"{stats['p50']:.0f}/{stats['p90']:.0f}/{stats['max']}"


def rate_label(rate: float | None) -> str:
    return "inf" if rate is None or not math.isfinite(rate) else f"{rate:g}/s"


def format_table(runs: list[dict]) -> str:
    """One column per run (rate), one row per figure; latencies in milliseconds."""
    rows: list[tuple[str, list[str]]] = [
        ("rate", [rate_label(r["rate"]) for r in runs]),
        ("completed / sent", [f"{r['completed']}/{r['requests']}" for r in runs]),
        ("refused", [str(r["refused"]) for r in runs]),
        ("failed", [str(r["failed"]) for r in runs]),
        ("duration (s)", [_num(r["duration_s"]) for r in runs]),
        ("requests/s", [_num(r["request_throughput"]) for r in runs]),
        ("output tokens/s", [_num(r["output_token_throughput"], digits=1) for r in runs]),
        ("prompt tokens", [str(r["prompt_tokens"]) for r in runs]),
        ("output tokens p50/p90/max", [_lengths(r.get("output_tokens_per_request")) for r in runs]),
        (
            "stopped: EOS / max_tokens",
            [
                f"{r.get('finish_reasons', {}).get('stop', 0)}/"
                f"{r.get('finish_reasons', {}).get('length', 0)}"
                for r in runs
            ],
        ),
        ("prefix-hit tokens", [str(r["prefix_hit_tokens"]) for r in runs]),
        ("SLO attainment %", [_num(r["slo_attainment"], 100.0, 1) for r in runs]),
        ("goodput (req/s)", [_num(r["goodput"]) for r in runs]),
    ]
    if any(r.get("exact_match") is not None for r in runs):
        rows.append(("exact match %", [_num(r.get("exact_match"), 100.0, 1) for r in runs]))
    for metric, label in (
        ("ttft_s", "TTFT"),
        ("tpot_s", "TPOT"),
        ("itl_s", "ITL"),
        ("e2e_s", "E2E"),
    ):
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{label} {stat} (ms)", [_num(r[metric][stat], 1000.0, 1) for r in runs]))
    refusals = sorted({k for r in runs for k in r.get("refusals", {})})
    for key in refusals:
        rows.append((f"  {key}", [str(r.get("refusals", {}).get(key, 0)) for r in runs]))
    width = max(len(name) for name, _ in rows)
    cols = [max(len(row[1][i]) for row in rows) for i in range(len(runs))]
    lines = [
        f"{name:<{width}}  " + "  ".join(f"{v:>{c}}" for v, c in zip(values, cols, strict=True))
        for name, values in rows
    ]
    rule = "-" * len(lines[0])
    table = "\n".join([rule, lines[0], rule, *lines[1:], rule])
    classes = format_class_table(runs)
    return f"{table}\n\n{classes}" if classes else table


_CLASS_HEADER = (
    "rate",
    "SLO class",
    "completed / sent",
    "refused",
    "failed",
    "attainment %",
    "goodput (req/s)",
    "TTFT p50/p90 (ms)",
    "TPOT p50/p90 (ms)",
    "E2E p50/p90 (ms)",
)


def _pair(stats: dict) -> str:
    return f"{_num(stats['p50'], 1000.0, 1)}/{_num(stats['p90'], 1000.0, 1)}"


def format_class_table(runs: list[dict]) -> str:
    """One row per run and SLO class; empty when no run holds more than one class."""
    if not any(len(r.get("classes") or {}) > 1 for r in runs):
        return ""
    rows = [_CLASS_HEADER]
    for run in runs:
        for name, c in (run.get("classes") or {}).items():
            rows.append(
                (
                    rate_label(run["rate"]),
                    name,
                    f"{c['completed']}/{c['requests']}",
                    str(c["refused"]),
                    str(c["failed"]),
                    _num(c["slo_attainment"], 100.0, 1),
                    _num(c["goodput"]),
                    _pair(c["ttft_s"]),
                    _pair(c["tpot_s"]),
                    _pair(c["e2e_s"]),
                )
            )
    return "\n".join(ruled_rows(rows))


def ruled_rows(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows (the first a header) as aligned columns, the first two left and the rest right, ruled
    above and below the header and at the end."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            v.ljust(w) if i < 2 else v.rjust(w)
            for i, (v, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    rule = "-" * len(lines[0])
    return [rule, lines[0], rule, *lines[1:], rule]


def _cdf(ax, values: list[float], label: str) -> None:
    if values:
        xs = sorted(v * 1000.0 for v in values)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def write_plot(results: list[RunResult], runs: list[dict], path: str | Path) -> None:
    """Latency CDFs (TTFT, TPOT, E2E) per rate; for a sweep also attainment and P99 vs rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = len(runs) > 1
    fig, axes = plt.subplots(2 if sweep else 1, 3, figsize=(15, 8 if sweep else 4.2), squeeze=False)
    for ax, (name, getter) in zip(
        axes[0],
        (
            ("TTFT", lambda r: [r.ttft]),
            ("TPOT", lambda r: [r.tpot]),
            ("end-to-end", lambda r: [r.e2e]),
        ),
        strict=True,
    ):
        for result in results:
            done = [r for r in result.records if r.status == "ok"]
            _cdf(ax, [v for r in done for v in getter(r) if v is not None], rate_label(result.rate))
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if sweep:
        points = [(r["rate"], r) for r in runs if r["rate"] is not None]
        rates = [p for p, _ in points]
        ax = axes[1][0]
        ax.plot(rates, [100.0 * (r["slo_attainment"] or 0.0) for _, r in points], marker="o")
        ax.set(title="SLO attainment", xlabel="request rate (req/s)", ylabel="%", ylim=(0, 102))
        ax = axes[1][1]
        ax.plot(rates, [r["goodput"] or 0.0 for _, r in points], marker="o", label="goodput")
        ax.plot(
            rates,
            [r["request_throughput"] or 0.0 for _, r in points],
            marker="x",
            label="throughput",
        )
        ax.set(title="Goodput", xlabel="request rate (req/s)", ylabel="req/s")
        ax.legend(fontsize="small")
        ax = axes[1][2]
        for metric, label in (("ttft_s", "TTFT p99"), ("e2e_s", "E2E p99")):
            ys = [r[metric]["p99"] for _, r in points]
            ax.plot(
                rates, [math.nan if y is None else y * 1000.0 for y in ys], marker="o", label=label
            )
        ax.set(title="P99 latency", xlabel="request rate (req/s)", ylabel="ms")
        ax.legend(fontsize="small")
        for ax in axes[1]:
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
