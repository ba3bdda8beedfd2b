"""The engine's idle spin, side by side: first-token latency after an idle gap, and its CPU price.

Requests go one at a time to a full server, each after a pause taken in turn from --gaps (0: back
to back). Two arms: `--idle-spin 0` (the engine process sleeps on its socket as soon as work runs
out) and the default window (it keeps polling that long first, see engine/process.py IdleWait).
Each round starts a fresh server per arm; the arms alternate and the first to run switches every
round. Prompts are distinct ARC prompts (a repeated one would be a prefix-cache hit).

Printed per gap: TTFT p50 / p90 of each arm and the ratio spin / asleep (below 1: the spin serves
faster), and the CPU seconds the server's processes used per request (the price of spinning).

    python -m benchmarks.idle_spin [--rounds 2] [--gaps 0 0.25 0.5 1 2] [--per-gap 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from sloserve.bench.client import LoadSpec, connect, run_load
from sloserve.bench.stats import summary
from sloserve.bench.workloads import WorkloadItem
from sloserve.config import ServerConfig
from sloserve.testing.procfs import cpu_seconds

from benchmarks.harness import arc_pool, launch, machine, run, save

DEFAULT_SPIN_S = ServerConfig().idle_spin_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--gaps", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0, 2.0], help="seconds"
    )
    p.add_argument(
        "--per-gap", type=int, default=8, help="requests after each gap per round and arm"
    )
    p.add_argument(
        "--spin", type=float, default=DEFAULT_SPIN_S, help="the spinning arm's window, seconds"
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-prompt-chars", type=int, default=600)
    p.add_argument("--name", default="idle_spin")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.per_gap < 1 or min(args.gaps) < 0 or args.spin <= 0:
        p.error("--rounds and --per-gap must be >= 1, --gaps >= 0 and --spin > 0")
    return args


def distinct_prompts(n: int, max_chars: int, max_tokens: int) -> list[WorkloadItem]:
    """n ARC requests with pairwise different prompts (the trace lists two attempts of each)."""
    seen, items = set(), []
    for item in arc_pool(0, max_chars, max_tokens)[1]:
        if item.prompt not in seen:
            seen.add(item.prompt)
            items.append(item)
    if len(items) < n:
        raise SystemExit(
            f"only {len(items)} distinct prompts of at most {max_chars} characters; lower --per-gap"
        )
    return items[:n]


async def one_by_one(
    target: str, items: list[WorkloadItem], gaps: list[float]
) -> list[tuple[float, float]]:
    """(gap, TTFT) of each request, sent alone after its gap."""
    channel = await connect(target)
    try:
        # the connection and the stream path
        await run_load(channel, items[:2], LoadSpec(concurrency=1))
        out = []
        for item, gap in zip(items[2:], gaps, strict=True):
            await asyncio.sleep(gap)
            record = (await run_load(channel, [item], LoadSpec(num_requests=1))).records[0]
            if record.status != "ok" or record.ttft is None:
                raise SystemExit(
                    f"request failed: {record.status} {record.error_code} {record.error_reason}"
                )
            out.append((gap, record.ttft))
        return out
    finally:
        await channel.close()


def serve(
    spin_s: float, items: list[WorkloadItem], gaps: list[float]
) -> tuple[list[tuple[float, float]], float]:
    """One fresh server: its (gap, TTFT) rows and CPU seconds per request (warm-up excluded)."""
    with launch("full", overrides={"server": {"idle_spin_s": spin_s}}) as server:
        server.wait_ready(600)
        pids = server.pids()
        before = cpu_seconds(pids)
        rows = run(one_by_one(server.target, items, gaps))
        time.sleep(spin_s)  # the spin after the last request is part of its price
        return rows, (cpu_seconds(pids) - before) / len(rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    arms = {"asleep": 0.0, "spin": args.spin}
    n = len(args.gaps) * args.per_gap
    items = distinct_prompts(2 + n * args.rounds * 2, args.max_prompt_chars, args.max_tokens)
    results = {arm: {"rows": [], "cpu_s": []} for arm in arms}
    started = time.monotonic()
    for r in range(args.rounds):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for k, arm in enumerate(order):
            # every arm gets fresh prompts; the gaps interleave so drift hits all of them alike
            base = 2 + (2 * r + k) * n
            gaps = [args.gaps[i % len(args.gaps)] for i in range(n)]
            rows, cpu = serve(arms[arm], items[:2] + items[base : base + n], gaps)
            results[arm]["rows"] += rows
            results[arm]["cpu_s"].append(cpu)
            print(
                f"round {r + 1} {arm}: {n} requests, {1000 * cpu:.0f} ms CPU per request",
                flush=True,
            )
    table = []
    print(
        f"\nTTFT by idle gap before the request; {args.rounds} rounds x {args.per_gap} requests per gap and arm; "
        f"spin window {args.spin:g} s"
    )
    print(
        f"{'gap (s)':>8} {'asleep p50/p90 (ms)':>20} {'spin p50/p90 (ms)':>18} {'p50 spin/asleep':>16}"
    )
    for gap in args.gaps:
        cells = {}
        for arm in arms:
            ttft = summary([t for g, t in results[arm]["rows"] if g == gap])
            cells[arm] = (ttft["p50"], ttft["p90"])
        ratio = cells["spin"][0] / cells["asleep"][0]
        table.append(
            {
                "gap_s": gap,
                **{f"{arm}_ttft_p50_s": c[0] for arm, c in cells.items()},
                **{f"{arm}_ttft_p90_s": c[1] for arm, c in cells.items()},
                "p50_ratio": ratio,
            }
        )
        print(
            f"{gap:>8g} {1000 * cells['asleep'][0]:>10.1f} / {1000 * cells['asleep'][1]:<7.1f}"
            f"{1000 * cells['spin'][0]:>9.1f} / {1000 * cells['spin'][1]:<7.1f} {ratio:>10.2f}"
        )
    cpu = {arm: statistics.median(results[arm]["cpu_s"]) for arm in arms}
    print(
        f"CPU per request, server processes (median of rounds): asleep {1000 * cpu['asleep']:.0f} ms, "
        f"spin {1000 * cpu['spin']:.0f} ms (x{cpu['spin'] / cpu['asleep']:.2f})"
    )
    print(f"total {(time.monotonic() - started) / 60:.1f} min")
    save(
        args.name,
        {
            "machine": machine(),
            "args": vars(args),
            "table": table,
            "cpu_s_per_request": cpu,
            "rows": {arm: results[arm]["rows"] for arm in arms},
        },
    )


if __name__ == "__main__":
    main()
