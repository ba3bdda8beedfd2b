"""The fused step's team with and without backing off to one thread, beside busy neighbours.

On cores shared with other busy processes, the fused decode step's threads (`hotpath/_team.h`)
wait for each other at spinning barriers whenever the OS deschedules one of them. TeamSize
(`sloserve.executor.team`) backs off to one thread while the team stalls. This times the same
prepared decode step of the built-in model in three arms -- the team always whole
(`TeamSize(n, adaptive=False)`), TeamSize as served, and one thread throughout (the bound that
backing off can reach) -- in rotating rounds of --seconds each, while --neighbours processes run
a duty cycle on the same cores (busy --busy-ms, asleep --sleep-ms: the shape of a front end
answering a flood). Printed per neighbour count: steps/s of each arm (median of the rounds),
adaptive / fixed, one / fixed, and the share of steps the adaptive arm ran alone.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.team_contention [--neighbours 0 1 2 4] [--batch 16]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from pathlib import Path

from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
from sloserve.executor import ModelRunner
from sloserve.executor.team import TeamSize
from sloserve.models.default import BUILTIN_MODELS, ensure_default_model

from benchmarks._output import OUT, write_json
from benchmarks.decode_kernel import decode_step


def neighbour(busy_s: float, sleep_s: float, stop) -> None:
    """Busy for busy_s, asleep for sleep_s, until `stop` is set."""
    while not stop.is_set():
        until = time.perf_counter() + busy_s
        while time.perf_counter() < until:
            pass
        time.sleep(sleep_s)


def steps_per_s(runner: ModelRunner, step, seconds: float) -> float:
    n, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        runner.forward(step)
        n += 1
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--neighbours", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--sleep-ms", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=2.0, help="per timed round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT / "team_contention.json")
    args = parser.parse_args()
    path = str(ensure_default_model(args.model)) if args.model in BUILTIN_MODELS else args.model
    config = SloserveConfig(
        model=ModelConfig(path=path, device="cpu", max_model_len=1024),
        cache=CacheConfig(kv_pool_bytes=args.batch * (args.context + 64) * 8 * 2**10, swap_bytes=0),
        scheduler=SchedulerConfig(max_batch=args.batch, max_batched_tokens=1024),
    )
    runner = ModelRunner(config)
    fused = runner.decode_step.fused if runner.decode_step else None
    if fused is None or fused.threads < 2:
        raise SystemExit(
            f"{path}: no fused step with a team of 2+ threads here ({os.cpu_count()} cores)"
        )
    threads = fused.threads
    step = decode_step(runner, args.batch, args.context)
    print(
        f"batch {args.batch}, context {args.context}, team of {threads}, {os.cpu_count()} cores, "
        f"neighbours busy {args.busy_ms} ms / asleep {args.sleep_ms} ms, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'neighbours':>10} {'fixed/s':>9} {'adaptive/s':>10} {'one/s':>7} {'adaptive/fixed':>14} "
        f"{'one/fixed':>9} {'alone':>6}"
    )
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for count in args.neighbours:
        stop = ctx.Event()
        procs = [
            ctx.Process(target=neighbour, args=(args.busy_ms / 1e3, args.sleep_ms / 1e3, stop))
            for _ in range(count)
        ]
        for p in procs:
            p.start()
        time.sleep(0.5 if procs else 0)
        rates: dict[str, list[float]] = {"fixed": [], "adaptive": [], "one": []}
        alone = []
        try:
            for rnd in range(args.rounds):
                arms = list(rates)
                for arm in arms[rnd % 3 :] + arms[: rnd % 3]:
                    fused.team = TeamSize(
                        1 if arm == "one" else threads, adaptive=arm == "adaptive"
                    )
                    rates[arm].append(steps_per_s(runner, step, args.seconds))
                    if arm == "adaptive":
                        team = fused.team
                        alone.append(team.alone_steps / max(1, team.alone_steps + team.team_steps))
        finally:
            stop.set()
            for p in procs:
                p.join(10)
        fixed, adaptive, one = (statistics.median(rates[a]) for a in ("fixed", "adaptive", "one"))
        rows.append(
            {
                "neighbours": count,
                "fixed_steps_per_s": round(fixed, 1),
                "adaptive_steps_per_s": round(adaptive, 1),
                "one_steps_per_s": round(one, 1),
                "adaptive_over_fixed": round(adaptive / fixed, 3),
                "one_over_fixed": round(one / fixed, 3),
                "alone_share": round(statistics.mean(alone), 3),
                "rounds": rates,
            }
        )
        print(
            f"{count:>10} {fixed:>9.0f} {adaptive:>10.0f} {one:>7.0f} {adaptive / fixed:>14.2f} "
            f"{one / fixed:>9.2f} {statistics.mean(alone):>6.0%}",
            flush=True,
        )
    fused.team = TeamSize(threads)
    write_json(
        args.out,
        {
            "benchmark": "team_contention",
            "model": path,
            "threads": threads,
            "args": vars(args) | {"out": str(args.out)},
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
