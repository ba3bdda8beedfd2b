"""The write-up's before/after table, measured on this machine: 3 seeds, fresh requests, ARC answers.

before = naive (fifo, max batch 1, no prefix cache, no chunked prefill); after = the full server.
Method (issue 12):
- each seed shuffles the ARC trace (or synthetic ARC) its own way; prompts of <= --max-prompt-chars,
  outputs the trace's answer lengths capped at --max-tokens (the cap that keeps a run <= 15 min);
- the SLO is scaled to this machine: TTFT <= --ttft-factor x and end-to-end <= --e2e-factor x the
  naive server's unloaded p90 (16 requests one at a time, seed 0), the same for every seed;
- a Poisson sweep per seed and mode over a ladder of rates, multiples of the naive unloaded
  capacity: upward from 0.5x until attainment falls below 95%; when the first point already
  misses, downward (each rung /1.6, down to ~0.03x) until one meets it, so a naive server whose
  head-of-line waits miss the objective at half its capacity still gets a QPS@95% (a naive
  server can miss at every rate down to 0.2x, which left the ratio undefined). Seeds after the first start at
  the highest rung the first one met;
  --requests-per-rate fresh requests per point: no point on one server reuses a prompt of an
  earlier one (a new server when the prompts run out);
- rows (median [min-max] over seeds): QPS at 95% attainment (interpolated; a sweep that never met
  95%, its budget spent above the crossing, bounds it below its lowest rate, and one that never
  missed above its highest: the median and the ratio are then bounds, judged only when the whole
  interval is on one side of the goal); P99 end-to-end at the naive QPS@95% (the median over
  seeds, a bound taken as the rate), one more point per seed and mode on a fresh server;
  peak KV in use = peak blocks in use (the engine's kv_blocks_peak, else Info sampled every
  0.1 s) x kv_block_bytes, next to contiguous caches of the maximum length = peak running
  requests (sampled) x max_model_len x bytes per token (kv_block_bytes / block_size); peak RSS of
  the server process and its engine process (the sum of their VmHWM).

    python -m benchmarks.seed_table     # the estimate is printed after calibration (~12 min quiet)
    python -m benchmarks.seed_table --report benchmarks/out/seed_table.json   # a saved run's table
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from sloserve.bench.client import LoadSpec
from sloserve.bench.stats import rate_at_attainment, summarise
from sloserve.sampling_params import SLO

from benchmarks import _goodput_arms as ga
from benchmarks import harness

WRITE_UP = {"qps": (3.2, 10.1), "p99_ms": (1842.0, 623.0), "memory_gb": (78.0, 64.0)}
GRID = (0.5, 0.8, 1.25, 2.0, 3.2, 5.0, 8.0, 12.5)  # multiples of the naive unloaded capacity
LOWER_RUNGS = 6  # rungs below the grid, each /1.6: down to 0.5 / 1.6^6 = 0.03x the naive capacity
TARGET = 0.95
MODES = ("naive", "full")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument(
        "--workload", default=None, help="default: the ARC trace if present, else synthetic-arc"
    )
    p.add_argument("--requests-per-rate", type=int, default=100)
    p.add_argument("--max-prompt-chars", type=int, default=600)
    p.add_argument(
        "--max-tokens", type=int, default=256, help="cap on the trace's answer lengths (1%% longer)"
    )
    p.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",")], default=[0, 1, 2])
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--ttft-factor", type=float, default=2.0)
    p.add_argument("--e2e-factor", type=float, default=2.0)
    p.add_argument("--tpot-factor", type=float, default=None, help="adds a TPOT objective")
    p.add_argument("--slo-ttft", type=float, default=None, help="seconds; overrides the factor")
    p.add_argument("--slo-e2e", type=float, default=None, help="seconds; overrides the factor")
    p.add_argument("--slo-tpot", type=float, default=None, help="seconds; overrides the factor")
    p.add_argument(
        "--budget-s", type=float, default=200.0, help="most seconds of one sweep (mode, seed)"
    )
    p.add_argument("--name", default="seed_table", help="benchmarks/out/NAME.json and NAME.txt")
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        help="print the table of a saved results JSON; runs nothing",
    )
    args = p.parse_args(argv)
    if args.requests_per_rate < 1 or not args.seeds:
        p.error("--requests-per-rate must be >= 1 and --seeds non-empty")
    return args


class Served:
    """One mode's servers for one seed: a fresh slice of the pool per point, a new server when the
    pool runs out; keeps the peaks (running, KV blocks, RSS) over all of them."""

    def __init__(self, mode: str, args: argparse.Namespace, pool: list, seed: int) -> None:
        self.mode, self.args, self.pool, self.seed = mode, args, pool, seed
        self.server: harness.ServerProcess | None = None
        self.start, self.info = 0, {}
        self.peak = {"running": 0, "blocks_sampled": 0, "blocks_counter": None, "rss_bytes": None}

    def run(self, rate: float, slo: SLO, index: int) -> dict:
        n = self.args.requests_per_rate
        if self.server is None or (self.start and self.start + n > len(self.pool)):
            self.close()
            self.server = harness.launch(
                self.mode, self.args.model, harness.LOGS / f"seed_table_{self.mode}_server.log"
            )
            self.server.wait_ready(600)
            self.start = 0
        items = harness.take(self.pool, self.start, n)
        self.start += n
        spec = LoadSpec(
            rate=rate,
            num_requests=n,
            streams=self.args.streams,
            seed=self.seed * 1000 + index,
            slo=slo,
        )
        result, peaks = harness.run(harness.send_sampled(self.server.target, items, spec))
        self.peak["running"] = max(self.peak["running"], peaks.running)
        self.peak["blocks_sampled"] = max(self.peak["blocks_sampled"], peaks.blocks_in_use)
        return summarise(result.records, result.duration_s, slo, rate)

    def close(self) -> None:
        if self.server is None:
            return
        try:
            self.info = harness.run(harness.engine_info(self.server.target))
            counter = self.info.get("stats", {}).get("kv_blocks_peak")
            if counter is not None:
                self.peak["blocks_counter"] = max(self.peak["blocks_counter"] or 0, counter)
            rss = self.server.peak_rss_bytes()
            if rss is not None:
                self.peak["rss_bytes"] = max(self.peak["rss_bytes"] or 0, rss)
        finally:
            self.server.stop()
            self.server = None

    def kv(self) -> dict:
        """Peak KV bytes in use and what contiguous max-length caches for the peak batch need."""
        block_bytes, block_size = self.info.get("kv_block_bytes"), self.info.get("block_size")
        blocks = (
            self.peak["blocks_counter"]
            if self.peak["blocks_counter"] is not None
            else self.peak["blocks_sampled"]
        )
        if not block_bytes or not block_size:
            return {
                "paged_bytes": None,
                "contiguous_bytes": None,
                "blocks": blocks,
                "source": "n/a",
            }
        return {
            "paged_bytes": blocks * block_bytes,
            "blocks": blocks,
            "source": "kv_blocks_peak" if self.peak["blocks_counter"] is not None else "sampled",
            "contiguous_bytes": self.peak["running"]
            * self.info["max_model_len"]
            * block_bytes
            // block_size,
        }


def ladder(capacity: float) -> list[float]:
    """The sweep's rates, ascending: LOWER_RUNGS rungs below the grid, then the grid, x capacity."""
    grid = [round(capacity * g, 3) for g in GRID]
    return [round(grid[0] / 1.6**k, 3) for k in range(LOWER_RUNGS, 0, -1)] + grid


def sweep(served: Served, rates: list[float], slo: SLO, first: int, budget_s: float) -> list[dict]:
    """Rates upward from rates[first] until attainment falls below the target; if the first rate
    already misses, the rates below it, each on a fresh server, until one meets it. Both stop at
    the budget."""
    runs: list[dict] = []
    began, n = time.monotonic(), served.args.requests_per_rate

    def one(index: int, rate: float) -> dict | None:
        if runs and time.monotonic() - began + n / rate > budget_s:
            print(f"    rate {rate:7.3f}/s  skipped: over the --budget-s of this sweep", flush=True)
            return None
        run = served.run(rate, slo, index)
        runs.append(run)
        print(
            f"    rate {rate:7.3f}/s  attainment {100 * run['slo_attainment']:5.1f}%  refused {run['refused']:3}  "
            f"p99 e2e {1000 * (run['e2e_s']['p99'] or 0):8.1f} ms  ({run['duration_s']:.0f} s)",
            flush=True,
        )
        return run

    for i in range(first, len(rates)):
        if (run := one(i, rates[i])) is None or run["slo_attainment"] < TARGET:
            break
    for i in range(first - 1, -1, -1):
        if any(r["slo_attainment"] >= TARGET for r in runs):
            break
        served.close()  # a fresh server: no admission estimate carried over from the overload above
        if one(i, rates[i]) is None:
            break
    return sorted(runs, key=lambda r: r["rate"])


def calibrate(args: argparse.Namespace, pool: list) -> tuple[SLO, float, dict]:
    """Unloaded latencies (16 requests one at a time through the naive server) -> SLO, capacity."""
    with harness.launch(
        "naive", args.model, harness.LOGS / "seed_table_naive_server.log"
    ) as server:
        server.wait_ready(600)
        result = harness.run(harness.send(server.target, pool[:16], LoadSpec(concurrency=1)))
    unloaded = summarise(result.records, result.duration_s, None, None)
    if unloaded["completed"] < len(result.records):
        raise SystemExit(f"calibration failed: {unloaded['refusals']}")
    tpot = args.slo_tpot or (
        round(args.tpot_factor * (unloaded["tpot_s"]["p90"] or 0.01), 4)
        if args.tpot_factor
        else None
    )
    slo = SLO(
        ttft_s=args.slo_ttft or round(args.ttft_factor * unloaded["ttft_s"]["p90"], 3),
        tpot_s=tpot,
        e2e_s=args.slo_e2e or round(args.e2e_factor * unloaded["e2e_s"]["p90"], 3),
    )
    return slo, 1.0 / unloaded["e2e_s"]["mean"], unloaded


def estimate_s(n: int, capacity: float, seeds: int, budget_s: float) -> float:
    """Rough wall time: naive missing at 0.5x and crossing three rungs below (~0.12x: naive can
    meet only 79-94% at 0.2x), full near 5x, each sweep at most the budget and a point; the two P99 points at naive's
    crossing; 3 s per server start. Later seeds start at the first one's crossing."""
    rungs = [0.5 / 1.6**k for k in range(4)]
    naive = sum(n / (g * capacity) for g in rungs)
    full = sum(n / (g * capacity) for g in GRID if g <= 5.0)
    cap = budget_s + n / capacity
    return 16 / capacity + seeds * (
        min(naive, cap) + min(full, cap) + 2 * n / (rungs[-1] * capacity) + 8 * 3.0
    )


def qps_bounds(runs: list[dict]) -> tuple[float, float]:
    """(low, high) bounds of one sweep's QPS at TARGET, attainment taken to fall as the rate rises:
    equal where the sweep crossed it (interpolated); (highest rate, inf) where no rate missed;
    (0, lowest rate) where none met it -- a sweep whose budget ran out above its crossing."""
    points = [(r["rate"], r["slo_attainment"]) for r in runs]
    rate = rate_at_attainment(points, TARGET)
    if rate is None:
        return 0.0, min(r for r, _ in points)
    if all(a >= TARGET for _, a in points):
        return rate, math.inf
    return rate, rate


def finite_bound(bounds: tuple[float, float]) -> float:
    """The value a bounded QPS is taken at: itself when known, else its finite bound."""
    low, high = bounds
    return low if math.isinf(high) else high


def bounded_median(bounds: list[tuple[float, float]]) -> dict:
    """median [min-max] over seeds of values each known within (low, high): the median lies
    between the median of the lows and the median of the highs; "median" is the value a rate
    can be taken at (the finite bound of a one-sided seed)."""
    lows, highs = [b[0] for b in bounds], [b[1] for b in bounds]
    known = [finite_bound(b) for b in bounds]
    return {
        "median": statistics.median(known),
        "min": min(known),
        "max": max(known),
        "n": len(bounds),
        "low": statistics.median(lows),
        "high": statistics.median(highs),
    }


def bounded_cell(figure: dict | None, scale: float, digits: int) -> str:
    """ga.cell, marked '<= ' or '>= ' where the median is only bounded on one side."""
    if figure is None or figure.get("low", 0) == figure.get("high", 0):
        return ga.cell(figure, scale, digits)
    low, high = figure["low"] * scale, figure["high"] * scale
    if math.isinf(high):
        return f">= {low:.{digits}f}"
    return f"<= {high:.{digits}f}" if low == 0 else f"{low:.{digits}f}-{high:.{digits}f}"


def ratio_row(
    label: str,
    before: dict | None,
    after: dict | None,
    scale: float,
    digits: int,
    goal: float,
    at_least: bool,
    write_up: str,
) -> list[str]:
    """A table row: before, after, after/before on medians, the goal's verdict.

    A figure with "low" and "high" (bounded_median) is known only within them, and so is the
    ratio: (after's low / before's high, after's high / before's low). The verdict holds when the
    whole interval is on one side of the goal, else "n/a (not crossed)"."""
    if before is None or after is None or not before["median"]:
        ratio = None
    else:
        b_lo, b_hi = before.get("low", before["median"]), before.get("high", before["median"])
        a_lo, a_hi = after.get("low", after["median"]), after.get("high", after["median"])
        ratio = (a_lo / b_hi if b_hi else math.inf, a_hi / b_lo if b_lo else math.inf)
    if ratio is None:
        change, verdict = "n/a", "n/a"
    else:
        lo, hi = ratio
        change = (
            f"x{lo:.2f}"
            if lo == hi
            else "n/a"
            if lo == 0 and math.isinf(hi)
            else f">= x{lo:.2f}"
            if math.isinf(hi)
            else f"<= x{hi:.2f}"
            if lo == 0
            else f"x{lo:.2f}-x{hi:.2f}"
        )
        meets = (lambda r: r >= goal) if at_least else (lambda r: r <= goal)
        verdict = (
            "PASS"
            if meets(lo) and meets(hi)
            else "FAIL"
            if not meets(lo) and not meets(hi)
            else "n/a (not crossed)"
        )
    return [
        label,
        bounded_cell(before, scale, digits),
        bounded_cell(after, scale, digits),
        change,
        f"{'>=' if at_least else '<='} x{goal:.2f} {verdict}",
        write_up,
    ]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.report:
        print(report(json.loads(args.report.read_text())))
        return 0
    began, n = time.monotonic(), args.requests_per_rate
    pools = {
        s: harness.arc_pool(s, args.max_prompt_chars, args.max_tokens, args.workload)
        for s in args.seeds
    }
    spec, pool0 = pools[args.seeds[0]]
    print(
        f"workload {spec}: {len(pool0)} requests with prompts <= {args.max_prompt_chars} chars, answers <= "
        f"{args.max_tokens} tokens; {n} fresh requests per rate point; seeds {args.seeds}",
        flush=True,
    )
    slo, capacity, unloaded = calibrate(args, pool0)
    rates = ladder(capacity)
    estimate = estimate_s(n, capacity, len(args.seeds), args.budget_s)
    print(
        f"unloaded naive: TTFT p90 {1000 * unloaded['ttft_s']['p90']:.1f} ms, e2e mean "
        f"{1000 * unloaded['e2e_s']['mean']:.1f} ms (p90 {1000 * unloaded['e2e_s']['p90']:.1f}), "
        f"{unloaded['output_tokens_per_request']['mean']:.0f} tokens/request -> SLO {slo_text(slo)}; "
        f"estimated {estimate / 60:.1f} min",
        flush=True,
    )
    runs = {m: {} for m in MODES}
    peaks = {m: {} for m in MODES}
    for seed in args.seeds:
        for mode in MODES:
            print(
                f"[{mode} seed {seed}] ({(time.monotonic() - began) / 60:.1f} min elapsed)",
                flush=True,
            )
            first = LOWER_RUNGS  # 0.5x
            if runs[mode]:  # start where the first seed last met the target
                passed = [
                    rates.index(r["rate"])
                    for r in runs[mode][args.seeds[0]]
                    if r["slo_attainment"] >= TARGET
                ]
                first = max(passed, default=LOWER_RUNGS)
            served = Served(mode, args, pools[seed][1], seed)
            try:
                runs[mode][seed] = sweep(served, rates, slo, first, args.budget_s)
            finally:
                served.close()
            peaks[mode][seed] = {
                **served.kv(),
                "running": served.peak["running"],
                "rss_bytes": served.peak["rss_bytes"],
            }
    # where a seed never met the target, its lowest rate probed (an upper bound on its QPS@95%)
    common_rate = statistics.median(finite_bound(qps_bounds(runs["naive"][s])) for s in args.seeds)
    print(f"[P99 at the naive QPS@95% {common_rate:.3f} req/s]", flush=True)
    p99 = {m: {} for m in MODES}
    for seed in args.seeds:
        for mode in MODES:
            served = Served(mode, args, pools[seed][1], seed)
            try:
                run = served.run(common_rate, slo, 900)
            finally:
                served.close()
            p99[mode][seed] = run["e2e_s"]["p99"]
            print(
                f"    {mode} seed {seed}: p99 e2e {1000 * (run['e2e_s']['p99'] or 0):.1f} ms, attainment "
                f"{100 * run['slo_attainment']:.1f}%",
                flush=True,
            )
    payload = {
        "machine": harness.machine(),
        "workload": spec,
        "args": vars(args),
        "unloaded": unloaded,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "e2e_s": slo.e2e_s},
        "rates": rates,
        "common_rate": common_rate,
        "p99_e2e_s": p99,
        "peaks": peaks,
        "write_up": WRITE_UP,
        "sweeps": runs,
        "estimate_s": estimate,
        "elapsed_s": time.monotonic() - began,
    }
    text = report(payload)
    print("\n" + text)
    path = harness.save(args.name, payload)
    (harness.OUT / f"{args.name}.txt").write_text(text + "\n")
    print(f"wrote {path} and {args.name}.txt")
    return 0


def report(payload: dict) -> str:
    """The table from a run's saved figures (main's payload, or its JSON: seeds as strings)."""
    seeds = payload["args"]["seeds"]
    per_seed = lambda d: {int(k): v for k, v in d.items()}  # noqa: E731
    runs = {m: per_seed(payload["sweeps"][m]) for m in MODES}
    peaks = {m: per_seed(payload["peaks"][m]) for m in MODES}
    p99 = {m: per_seed(payload["p99_e2e_s"][m]) for m in MODES}
    bounds = {m: {s: qps_bounds(runs[m][s]) for s in seeds} for m in MODES}
    mr = {
        m: {
            "qps": bounded_median(list(bounds[m].values())),
            "p99": ga.median_range(list(p99[m].values())),
            "paged": ga.median_range([p["paged_bytes"] for p in peaks[m].values()]),
            "contiguous": ga.median_range([p["contiguous_bytes"] for p in peaks[m].values()]),
            "rss": ga.median_range([p["rss_bytes"] for p in peaks[m].values()]),
        }
        for m in MODES
    }
    slo = payload["slo"]
    wq, wp, wm, mib = WRITE_UP["qps"], WRITE_UP["p99_ms"], WRITE_UP["memory_gb"], 2.0**-20
    rows = [
        ratio_row(
            "QPS at 95% SLO attainment",
            mr["naive"]["qps"],
            mr["full"]["qps"],
            1,
            2,
            wq[1] / wq[0],
            True,
            f"{wq[0]} -> {wq[1]}",
        ),
        ratio_row(
            f"P99 e2e at {payload['common_rate']:.3g} req/s (ms)",
            mr["naive"]["p99"],
            mr["full"]["p99"],
            1000,
            0,
            wp[1] / wp[0],
            False,
            f"{wp[0]:g} -> {wp[1]:g} ms",
        ),
        ratio_row(
            "peak KV of full (MiB): contiguous -> paged",
            mr["full"]["contiguous"],
            mr["full"]["paged"],
            mib,
            1,
            wm[1] / wm[0],
            False,
            f"memory {wm[0]:g} -> {wm[1]:g} GB",
        ),
        [
            "peak KV in use, paged (MiB)",
            ga.cell(mr["naive"]["paged"], mib),
            ga.cell(mr["full"]["paged"], mib),
            "",
            "",
            "",
        ],
        [
            "peak RSS, server + engine (MiB)",
            ga.cell(mr["naive"]["rss"], mib, 0),
            ga.cell(mr["full"]["rss"], mib, 0),
            "",
            "",
            f"{wm[0]:g} -> {wm[1]:g} GB",
        ],
    ]
    info = next(iter(peaks["full"].values()))
    lines = [
        f"SLO {slo_text(SLO(**slo))}; {len(seeds)} seeds, {payload['args']['requests_per_rate']} fresh requests "
        "per rate; median [min-max] over seeds",
        "",
        ga.table(["", "before (naive)", "after (full)", "change", "goal", "write-up"], rows),
        "",
        f"KV: paged = peak blocks in use ({info['source']}) x kv_block_bytes; contiguous = peak running requests "
        f"(sampled; full: {', '.join(str(p['running']) for p in peaks['full'].values())}) x max_model_len x "
        "bytes per token (kv_block_bytes / block_size), one max-length cache per running request.",
        "QPS@95%: '<= x' where a sweep never met 95% (its lowest rate probed), '>= x' where it never fell "
        "below; a ratio of bounded medians is itself a bound, and its verdict holds only when the whole "
        "interval is on one side of the goal.",
    ]
    for mode in MODES:
        for seed in seeds:
            lo, hi = bounds[mode][seed]
            qps = f"{lo:.3f}" if lo == hi else f">= {lo:.3f}" if math.isinf(hi) else f"< {hi:.3f}"
            lines.append(
                f"{mode} seed {seed}: QPS@95 {qps}; "
                + ", ".join(
                    f"{r['rate']:g}/s {100 * r['slo_attainment']:.0f}%" for r in runs[mode][seed]
                )
            )
    if "estimate_s" in payload:
        lines.append(
            f"\ntotal {payload['elapsed_s'] / 60:.1f} min (estimated {payload['estimate_s'] / 60:.1f})"
        )
    return "\n".join(lines)


def slo_text(slo: SLO) -> str:
    return " and ".join(
        f"{name} <= {value} s"
        for name, value in (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s), ("E2E", slo.e2e_s))
        if value is not None
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
