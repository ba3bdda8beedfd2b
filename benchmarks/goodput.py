"""Goodput on mixed objectives: the slo policy against priority, fifo and the naive server (issue 12).

ARC-like prompts (the ARC trace when present, else synthetic ARC) with Poisson arrivals; a share
of the requests is interactive (TTFT, TPOT and end-to-end objectives, priority 0), the rest batch
(an end-to-end objective only, priority 1). Capacity is measured first: a closed loop of
--concurrency requests on the slo arm, completed requests per second between its first completion
and its last send. Then each arm serves --requests Poisson arrivals at each multiple of that
capacity: every point on a fresh server, the arms of a point one after another in an order that
rotates from point to point (so a drift of the machine's speed moves the arms of a point alike),
the same prompts and classes for every arm. Figures are medians over seeds
with the range in brackets. Then the ablation: the slo arm at --ablation-multiple x capacity with
each mechanism switched off in turn, each on a fresh server. Requests still open after
--request-timeout are cancelled and count as misses, which bounds an overloaded point's length.
After each point the fresh server's engine counters give what it cost (a table of its own): model
steps, milliseconds per step, busy seconds, prompt tokens computed and prefix-cache hits, tokens
generated, preemptions.

    python -m benchmarks.goodput                     # the full run: time estimate printed first
    python -m benchmarks.goodput --requests 12 --seeds 0 --multiples 1 --arms slo,fifo \\
        --no-ablation --capacity-requests 20         # a smoke run, ~1 min
"""

from __future__ import annotations

import argparse
import sys
import time

from sloserve.bench.compare import CompareSettings, Comparison, Load
from sloserve.bench.plan import WorkloadPlan
from sloserve.bench.stats import OBJECTIVES
from sloserve.sampling_params import SLO

from benchmarks import _goodput_arms as ga
from benchmarks import harness


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def names(choices):
    def parse(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        if bad := [x for x in out if x not in choices]:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad)}: choose from {', '.join(choices)}"
            )
        return out

    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument(
        "--workload", default=None, help="default: the ARC trace if present, else synthetic-arc"
    )
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=1000,
        help="longest prompt (the trace holds 1,094 of <= 1000)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="cap on the trace's answer lengths")
    p.add_argument("--interactive-share", type=float, default=0.3)
    p.add_argument("--ttft", type=float, default=0.3, help="interactive TTFT objective, s")
    p.add_argument("--tpot", type=float, default=0.03, help="interactive TPOT objective, s")
    p.add_argument("--e2e", type=float, default=2.0, help="interactive end-to-end objective, s")
    p.add_argument("--batch-e2e", type=float, default=30.0, help="batch end-to-end objective, s")
    p.add_argument("--arms", type=names(tuple(ga.ARMS)), default=list(ga.ARMS))
    p.add_argument(
        "--multiples", type=floats, default=[0.5, 1.0, 1.5, 2.0, 3.0], help="of capacity"
    )
    p.add_argument(
        "--points",
        type=ints,
        default=None,
        help="positions in --multiples to run (default all); each keeps its prompts and classes, "
        "so --points 3 reruns a full run's 2x point alone",
    )
    p.add_argument("--requests", type=int, default=200, help="Poisson arrivals per point")
    p.add_argument("--seeds", type=ints, default=[0, 1, 2])
    p.add_argument("--concurrency", type=int, default=32, help="closed loop of the capacity run")
    p.add_argument("--capacity-requests", type=int, default=100)
    p.add_argument("--capacity", type=float, default=None, help="req/s: skip the capacity run")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--request-timeout", type=float, default=None, help="s; default 2x --batch-e2e")
    p.add_argument("--ablation", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--ablation-multiple", type=float, default=1.5)
    p.add_argument("--name", default="goodput", help="benchmarks/out/NAME.json and NAME.txt")
    args = p.parse_args(argv)
    if not 0.0 <= args.interactive_share <= 1.0:
        p.error(f"--interactive-share must be in [0, 1], got {args.interactive_share}")
    if not args.multiples or min(args.multiples) <= 0:
        p.error("--multiples must be numbers > 0, e.g. 0.5,1,1.5,2,3")
    if args.points is not None and (
        not args.points or not all(0 <= i < len(args.multiples) for i in args.points)
    ):
        p.error(
            f"--points must be positions 0..{len(args.multiples) - 1} in --multiples, got {args.points}"
        )
    if not args.seeds or args.requests < 1 or args.capacity_requests < 1 or args.concurrency < 1:
        p.error(
            "--seeds, --requests, --capacity-requests and --concurrency must be non-empty / >= 1"
        )
    if args.capacity is not None and args.capacity <= 0:
        p.error("--capacity must be > 0 req/s")
    args.request_timeout = args.request_timeout or 2 * args.batch_e2e
    return args


class Runner:
    """Runs the sweeps and the ablation through `sloserve bench compare`'s Comparison (a fresh
    server per arm and point, the arms' order rotating), keeps the points and prints one line each."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.capacity = args, 0.0
        self.interactive = SLO(ttft_s=args.ttft, tpot_s=args.tpot, e2e_s=args.e2e)
        self.batch = SLO(e2e_s=args.batch_e2e)
        self.start, self.points, self.ablation = time.monotonic(), [], []
        pools = {
            seed: harness.arc_pool(seed, args.max_prompt_chars, args.max_tokens, args.workload)
            for seed in args.seeds
        }
        # the ARC trace, or synthetic-arc where it is absent
        self.workload = pools[args.seeds[0]][0]
        self.pools = {seed: items for seed, (_, items) in pools.items()}

    def load(self, seed: int, start: int, n: int, tag: int) -> tuple[list, list[str]]:
        """n fresh requests from the seed's pool, with their classes (the same for every arm)."""
        labels = ga.classes_of(n, self.args.interactive_share, seed * 1000 + tag)
        return ga.mix(
            harness.take(self.pools[seed], start, n), labels, self.interactive, self.batch
        ), labels

    def compare(
        self,
        seed: int,
        names: list[str],
        launch: dict[str, tuple[str, dict]],
        loads: list[float],
        requests: list[tuple[list, list[str]]],
        kind: str,
        into: list[dict],
    ) -> Comparison:
        """A Comparison of `names` (each launched as harness mode + overrides) at `loads` (multiples
        of capacity), load k sending requests[k]; each point lands in `into` as ga.point gives it."""
        a = self.args
        settings = CompareSettings(
            tuple(names),
            a.model,
            tuple(Load(m, True) for m in loads),
            WorkloadPlan(self.workload, seed=seed),
            capacity=self.capacity or None,
            concurrency=a.concurrency,
            capacity_requests=a.capacity_requests,
            streams=a.streams,
            request_timeout_s=a.request_timeout,
            interactive_class="interactive",
        )

        def start(name: str, label: str) -> harness.ServerProcess:
            mode, overrides = launch[name]
            return harness.launch(
                mode, a.model, harness.LOGS / f"goodput_{label}_server.log", overrides=overrides
            )

        def on_point(server: harness.ServerProcess, point: dict, records: list) -> None:
            k = [f"{m:g}x" for m in loads].index(point["load"])
            figures, labels = point["run"], requests[k][1]
            p = ga.point(
                figures,
                ga.class_figures(figures, records, labels),
                **{kind: point["policy"]},
                seed=seed,
                multiple=loads[k],
                rate=round(point["rate"], 3),
                wall_s=point["wall_s"],
            )
            p.update(
                ga.engine_work(
                    harness.run(harness.engine_info(server.target)).get("stats", {}), p["completed"]
                )
            )
            into.append(p)
            self.save(partial=True)
            print(
                f"  [{kind} {point['policy']} seed {seed} multiple {loads[k]:g}] goodput {p['goodput']:.2f} req/s, "
                f"attainment {pct(p['attainment'])} (interactive {pct(p['interactive'])}, batch {pct(p['batch'])}), "
                f"refused {p['refused']}, failed {p['failed']}; {p['wall_s']:.0f} s "
                f"(elapsed {(time.monotonic() - self.start) / 60:.1f} min)",
                flush=True,
            )

        return Comparison(
            settings,
            start_server=start,
            workload=lambda k: requests[k][0],
            on_point=on_point,
            log=lambda line: None,
        )

    def measure_capacity(self) -> float:
        """A closed loop of --concurrency on the slo arm."""
        a = self.args
        cmp = self.compare(
            a.seeds[0],
            ["slo"],
            ga.ARMS,
            [],
            [self.load(a.seeds[0], 0, a.capacity_requests, 999)],
            "arm",
            [],
        )
        cmp.measure_capacity()
        return cmp.capacity

    def sweep(self, seed: int, points: list[int]) -> None:
        """Every arm at multiples[i] for i in points: load i keeps its own prompts and classes."""
        a = self.args
        requests = [self.load(seed, i * a.requests, a.requests, i) for i in points]
        self.compare(
            seed, a.arms, ga.ARMS, [a.multiples[i] for i in points], requests, "arm", self.points
        ).run()

    def ablate(self, seed: int, ablations: dict[str, dict]) -> None:
        """The slo arm with each mechanism off in turn, at --ablation-multiple, on the same prompts."""
        a = self.args
        launch = {config: ("full", overrides) for config, overrides in ablations.items()}
        self.compare(
            seed,
            list(ablations),
            launch,
            [a.ablation_multiple],
            [self.load(seed, 0, a.requests, 500)],
            "config",
            self.ablation,
        ).run()

    def save(self, partial: bool = False, extra: dict | None = None) -> None:
        a = self.args
        harness.save(
            a.name,
            {
                "partial": partial,
                "args": vars(a),
                "workload": self.workload,
                "capacity_rps": self.capacity,
                "machine": harness.machine(),
                "elapsed_s": time.monotonic() - self.start,
                "objectives": {
                    "interactive": {"ttft_s": a.ttft, "tpot_s": a.tpot, "e2e_s": a.e2e},
                    "batch": {"e2e_s": a.batch_e2e},
                },
                "points": self.points,
                "ablation": self.ablation,
                **(extra or {}),
            },
        )


WORK_COLUMNS = (
    ("duration_s", 1),
    ("steps", 0),
    ("step_ms", 1),
    ("busy_s", 1),
    ("busy_ms_per_request", 1),
    ("prompt_computed", 0),
    ("prefix_hits", 0),
    ("generated", 0),
    ("preemptions", 0),
)


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def interactive_misses(points: list[dict], arm: str, multiple: float) -> str:
    """Completed interactive requests that missed their TTFT / TPOT / end-to-end objective, summed
    over seeds (one request may miss several): which objective the schedule loses."""
    totals = dict.fromkeys(OBJECTIVES, 0)
    for p in points:
        if p["arm"] == arm and p["multiple"] == multiple:
            for objective, n in (p["classes"]["interactive"].get("missed") or {}).items():
                totals[objective] += n
    return "/".join(str(totals[k]) for k in OBJECTIVES)


def report(runner: Runner, capacity: float, verdicts: list[tuple[str, bool | None, str]]) -> str:
    """The tables and the goal lines of `verdicts` (printed and saved as text)."""
    a, lines = runner.args, []
    agg = ga.aggregate(runner.points, "arm")
    rows = [
        [
            arm,
            f"{m:g}x",
            f"{m * capacity:.2f}",
            ga.cell(agg[(arm, m)]["goodput"], digits=2),
            ga.cell(agg[(arm, m)]["attainment"], 100),
            ga.cell(agg[(arm, m)]["interactive"], 100),
            ga.cell(agg[(arm, m)]["batch"], 100),
            ga.cell(agg[(arm, m)]["refused"], digits=0),
            ga.cell(agg[(arm, m)]["interactive_refused"], digits=0),
            interactive_misses(runner.points, arm, m),
        ]
        for arm in a.arms
        for m in a.multiples
        if (arm, m) in agg
    ]
    lines += [
        f"workload {runner.workload}; capacity {capacity:.2f} req/s; {a.requests} requests per point, seeds "
        f"{','.join(map(str, a.seeds))}; median [min-max] over seeds",
        "",
        ga.table(
            [
                "arm",
                "load",
                "req/s",
                "goodput",
                "attain %",
                "interactive %",
                "batch %",
                "refused",
                "interactive refused",
                "interactive served, missed ttft/tpot/e2e",
            ],
            rows,
        ),
        "",
        "goals (medians over seeds):",
    ]
    lines += [
        f"  {'n/a ' if ok is None else 'PASS' if ok else 'FAIL'}  {text}: {detail}"
        for text, ok, detail in verdicts
    ]
    rows = [
        [arm, f"{m:g}x", *(ga.cell(agg[(arm, m)][name], digits=d) for name, d in WORK_COLUMNS)]
        for arm in a.arms
        for m in a.multiples
        if (arm, m) in agg
    ]
    lines += [
        "",
        "engine work per point (a fresh server's counters; the run lasts until its last request ends):",
        ga.table(["arm", "load", *(name for name, _ in WORK_COLUMNS)], rows),
    ]
    if runner.ablation:
        abl = ga.aggregate(runner.ablation, "config")
        rows = [
            [
                f"{'full' if c == 'full' else 'no ' + c}",
                ga.cell(abl[(c, a.ablation_multiple)]["goodput"], digits=2),
                ga.cell(abl[(c, a.ablation_multiple)]["interactive"], 100),
                ga.cell(abl[(c, a.ablation_multiple)]["attainment"], 100),
            ]
            for c in ga.ABLATIONS
            if (c, a.ablation_multiple) in abl
        ]
        lines += [
            "",
            f"ablation at {a.ablation_multiple:g}x capacity ({a.ablation_multiple * capacity:.2f} req/s):",
            ga.table(["slo arm", "goodput", "interactive %", "attain %"], rows),
        ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    ablations, skipped = {}, {}
    if a.ablation:
        for config, overrides in ga.ABLATIONS.items():
            try:
                ablations[config] = harness.check_overrides(overrides)
            except ValueError as exc:
                skipped[config] = str(exc)
                print(f"ablation '{config}' skipped: {exc}")
    for arm in a.arms:  # fail now, not an hour in, on a policy this build lacks
        try:
            harness.check_overrides(ga.ARMS[arm][1])
        except ValueError as exc:
            raise SystemExit(f"arm {arm}: {exc}") from None
    if "priority" not in ga.ITEM_FIELDS:
        print(
            "note: WorkloadItem has no 'priority' field in this build: the priority arm gets no priorities"
        )
    runner = Runner(a)
    pool = len(runner.pools[a.seeds[0]])
    print(
        f"workload {runner.workload}: {len(a.seeds)} seed(s), {pool} prompts of <= "
        f"{a.max_prompt_chars} chars, outputs <= "
        f"{a.max_tokens} tokens; {100 * a.interactive_share:g}% interactive (TTFT {a.ttft:g} s, TPOT "
        f"{1000 * a.tpot:g} ms, e2e {a.e2e:g} s), batch e2e {a.batch_e2e:g} s",
        flush=True,
    )
    capacity = a.capacity
    if capacity is None:
        print(
            f"capacity: closed loop of {a.concurrency} on the slo arm, {a.capacity_requests} requests",
            flush=True,
        )
        capacity = runner.measure_capacity()
    points = [i for i in range(len(a.multiples)) if a.points is None or i in a.points]
    estimate = ga.estimate_s(
        a.requests,
        capacity,
        [a.multiples[i] for i in points],
        a.arms,
        len(a.seeds),
        len(ablations),
        a.ablation_multiple,
        a.request_timeout,
    )
    runner.capacity = capacity
    print(
        f"capacity {capacity:.2f} req/s; points {len(a.arms)} arms x {len(points)} multiples x "
        f"{len(a.seeds)} seeds + {len(ablations)} ablation configs x {len(a.seeds)} seeds; "
        f"estimated {estimate / 60:.1f} min more",
        flush=True,
    )
    for seed in a.seeds:
        runner.sweep(seed, points)  # arms interleaved per point, their order rotating
    if ablations:
        for seed in a.seeds:
            runner.ablate(seed, ablations)
    verdicts = ga.goals(ga.aggregate(runner.points, "arm"), [a.multiples[i] for i in points])
    text = report(runner, capacity, verdicts)
    elapsed = time.monotonic() - runner.start
    text += f"\n\ntotal {elapsed / 60:.1f} min (sweeps and ablation estimated {estimate / 60:.1f})"
    print("\n" + text)
    runner.save(
        extra={
            "ablation_skipped": skipped,
            "goals": [{"goal": t, "passed": ok, "detail": d} for t, ok, d in verdicts],
        }
    )
    (harness.OUT / f"{a.name}.txt").write_text(text + "\n")
    print(f"wrote {harness.OUT / a.name}.json and .txt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
