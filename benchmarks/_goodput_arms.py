"""The pure parts of benchmarks/goodput.py: arms, ablations, the mixed workload, statistics, goals."""

from __future__ import annotations

import dataclasses
import random
import statistics

from sloserve.bench.stats import RequestRecord, meets_slo, missed_counts, steady_throughput  # noqa: F401 - goodput.py
from sloserve.bench.workloads import WorkloadItem
from sloserve.sampling_params import SLO

# arm -> (harness mode, config overrides); priority and fifo keep the slo arm's batching, prefix
# cache and chunking, so only the policy differs
ARMS: dict[str, tuple[str, dict]] = {
    "slo": ("full", {}),
    "priority": ("full", {"scheduler": {"policy": "priority"}}),
    "fifo": ("full", {"scheduler": {"policy": "fifo"}}),
    "naive": ("naive", {}),
}
# the ablation: the slo arm with one mechanism switched off at a time
ABLATIONS: dict[str, dict] = {
    "full": {},
    "deadline_steps": {"scheduler": {"deadline_steps": False}},
    "slack_preemption": {"scheduler": {"slack_preemption": False}},
    "finish_margin": {"scheduler": {"finish_margin": 0.0}},
    "admission_control": {"scheduler": {"admission_control": False}},
    "adaptive_batch": {"scheduler": {"adaptive_batch": False}},
    "aging+guard": {"scheduler": {"aging": 1.0, "max_wait_s": 1e9}},
    "prefix_cache": {"cache": {"prefix_cache": False}},
    "chunked_prefill": {"scheduler": {"chunked_prefill": False}},
}
CLASSES = ("interactive", "batch")
PRIORITY = {"interactive": 0, "batch": 1}
# NOTE: WorkloadItem gained slo_class and priority with issue 12; without them the priority arm
# sends no priorities and the per-class figures come from class_figures' own bookkeeping
ITEM_FIELDS = {f.name for f in dataclasses.fields(WorkloadItem)}


def tag(item: WorkloadItem, name: str, slo: SLO) -> WorkloadItem:
    """The item as a request of class `name`: its objectives, class and priority."""
    extra = {
        key: value
        for key, value in (("slo_class", name), ("priority", PRIORITY[name]))
        if key in ITEM_FIELDS
    }
    return dataclasses.replace(item, slo=slo, **extra)


def classes_of(n: int, share: float, seed: int) -> list[str]:
    """round(share * n) 'interactive' at seeded random positions, the rest 'batch'."""
    chosen = set(random.Random(seed).sample(range(n), round(share * n)))
    return ["interactive" if i in chosen else "batch" for i in range(n)]


def mix(
    items: list[WorkloadItem], labels: list[str], interactive: SLO, batch: SLO
) -> list[WorkloadItem]:
    slos = {"interactive": interactive, "batch": batch}
    return [tag(item, name, slos[name]) for item, name in zip(items, labels, strict=True)]


def class_figures(
    figures: dict, records: list[RequestRecord], labels: list[str]
) -> dict[str, dict]:
    """Attainment, goodput and refusals per class: summarise()'s 'classes' when it names ours, else
    computed from the records (the client names request i 'bench-i'; its class is labels[i])."""
    theirs = figures.get("classes") or {}
    if all(name in theirs for name in CLASSES):
        return {
            name: {
                key: theirs[name][key]
                for key in ("requests", "slo_attainment", "goodput", "refused", "missed")
            }
            for name in CLASSES
        }
    seconds = figures["duration_s"] or float("nan")
    out = {}
    for name in CLASSES:
        members = [r for r in records if labels[int(r.request_id.rsplit("-", 1)[1])] == name]
        good = sum(meets_slo(r, r.slo) for r in members)
        out[name] = {
            "requests": len(members),
            "slo_attainment": good / len(members) if members else None,
            "goodput": good / seconds if seconds > 0 else None,
            "refused": sum(r.status == "refused" for r in members),
            "missed": missed_counts((r, r.slo) for r in members),
        }
    return out


def point(figures: dict, classes: dict, **where) -> dict:
    """One measured point: where it was taken (arm, seed, multiple, rate, ...) and its figures."""
    return {
        **where,
        "goodput": figures["goodput"] or 0.0,
        "attainment": figures["slo_attainment"],
        "completed": figures["completed"],
        "refused": figures["refused"],
        "failed": figures["failed"],
        "refusals": figures["refusals"],
        "duration_s": figures["duration_s"],
        "ttft_p99_s": figures["ttft_s"]["p99"],
        "e2e_p99_s": figures["e2e_s"]["p99"],
        "interactive": classes["interactive"]["slo_attainment"],
        "interactive_refused": classes["interactive"]["refused"],
        "batch": classes["batch"]["slo_attainment"],
        "classes": classes,
    }


def median_range(values: list[float | None]) -> dict | None:
    """median, min and max over seeds (None values left out); None when there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


AGGREGATED = (
    "goodput",
    "attainment",
    "interactive",
    "interactive_refused",
    "batch",
    "refused",
    "failed",
    "duration_s",
    "steps",
    "busy_s",
    "step_ms",
    "busy_ms_per_request",
    "prompt_computed",
    "prefix_hits",
    "generated",
    "preemptions",
)


def engine_work(stats: dict, completed: int) -> dict:
    """What one point cost the engine, from a fresh server's counters (Info stats as message_dict
    gives them) after the point: model steps, the runner's busy seconds, mean milliseconds per
    step and per completed request (what a policy pays per request it serves: a point that runs
    past its arrivals is as long as this times the requests served), prompt tokens computed (hits
    excluded, recomputes included) and served from the prefix cache, tokens generated, preemptions."""
    steps, busy = stats.get("steps_total", 0), stats.get("busy_seconds_total", 0.0)
    return {
        "steps": steps,
        "busy_s": busy,
        "step_ms": 1e3 * busy / steps if steps else None,
        "busy_ms_per_request": 1e3 * busy / completed if completed else None,
        "prompt_computed": stats.get("computed_prompt_tokens_total", 0),
        "prefix_hits": stats.get("prefix_hit_tokens_total", 0),
        "generated": stats.get("generated_tokens_total", 0),
        "preemptions": stats.get("preemptions_total", 0),
    }


def aggregate(points: list[dict], key: str) -> dict:
    """{group: {figure: median_range over seeds}} with points grouped by point[key] (and multiple);
    a figure a point lacks (a result file from before it was measured) is left out."""
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault((p[key], p.get("multiple")), []).append(p)
    return {
        group: {name: median_range([p.get(name) for p in members]) for name in AGGREGATED}
        for group, members in groups.items()
    }


def med(agg: dict, group: tuple, name: str, stat: str = "median") -> float | None:
    figure = agg.get(group, {}).get(name)
    return None if figure is None else figure[stat]


def goals(agg: dict, multiples: list[float]) -> list[tuple[str, bool | None, str]]:
    """The issue's goals on the slo arm, judged on medians over seeds: (goal, passed or None for
    not measured, the numbers)."""
    out = []

    def judge(
        text: str,
        value: float | None,
        bound: float | None,
        at_least: bool = True,
        fmt: str = "{:.3g}",
    ):
        if value is None or bound is None:
            out.append((text, None, "not measured"))
        else:
            out.append(
                (
                    text,
                    value >= bound if at_least else value <= bound,
                    f"{fmt.format(value)} {'>=' if at_least else '<='} {fmt.format(bound)}",
                )
            )

    for m in (1.5, 2.0):
        slo = med(agg, ("slo", m), "goodput")
        for other, factor in (("fifo", 1.5), ("priority", 1.2)):
            base = med(agg, (other, m), "goodput")
            judge(
                f"{m:g}x: slo goodput >= {factor:g}x {other}",
                slo,
                None if base is None else factor * base,
            )
        judge(
            f"{m:g}x: slo interactive attainment >= 95%", med(agg, ("slo", m), "interactive"), 0.95
        )
    for m in (m for m in multiples if m <= 1.0):
        judge(
            f"{m:g}x: slo refuses nothing (most over seeds)",
            med(agg, ("slo", m), "refused", "max"),
            0,
            at_least=False,
            fmt="{:g}",
        )
        judge(f"{m:g}x: slo attainment >= 99%", med(agg, ("slo", m), "attainment"), 0.99)
    best = [g for m in multiples if (g := med(agg, ("slo", m), "goodput")) is not None]
    judge(
        "3x: slo goodput >= 90% of its best point",
        med(agg, ("slo", 3.0), "goodput"),
        0.9 * max(best) if best else None,
    )
    return out


def point_s(n: int, capacity: float, m: float, arm: str, timeout_s: float) -> float:
    """Rough wall time of one point: the arrivals (n / rate), then the backlog above capacity
    served at capacity (naive at a quarter of it, as measured on 2 CPUs: one request at a time),
    at most the client's request timeout, and a second to settle."""
    served = capacity / 4 if arm == "naive" else capacity
    arrivals = n / (m * capacity)
    return arrivals + min(timeout_s, max(0.0, n / served - arrivals)) + 1.0


def estimate_s(
    n: int,
    capacity: float,
    multiples: list[float],
    arms: list[str],
    seeds: int,
    ablations: int,
    ablation_multiple: float,
    timeout_s: float,
    start_s: float = 4.0,
) -> float:
    """Rough wall time of the sweeps and the ablation (point_s each) with a server start per point."""
    sweeps = seeds * sum(
        start_s + point_s(n, capacity, m, arm, timeout_s) for m in multiples for arm in arms
    )
    return sweeps + seeds * ablations * (
        start_s + point_s(n, capacity, ablation_multiple, "slo", timeout_s)
    )


def cell(figure: dict | None, scale: float = 1.0, digits: int = 1) -> str:
    """'median [min-max]' (just the median for one seed)."""
    if figure is None:
        return "n/a"
    text = f"{figure['median'] * scale:.{digits}f}"
    if figure["n"] > 1:
        text += f" [{figure['min'] * scale:.{digits}f}-{figure['max'] * scale:.{digits}f}]"
    return text


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    )
