"""Does front-end load slow the engine? Engine step time at a steady load, then under a flood.

For each arm (`process`: the engine in its own process, as `sloserve serve` runs it; `thread`:
the engine in the front end's process, `--no-engine-process`), one server is started and:
  1. steady: a closed loop at --concurrency (no SLO) for --seconds; its completion rate is the
     sustainable rate, and Info's step-time p50/p99 (the engine's last 512 steps) the baseline;
  2. flood: the same closed loop plus an open loop at --flood-x times the sustainable rate of
     requests with a tight first-token SLO (admission refuses most) for --seconds; step-time
     p50/p99 again, the closed loop's completion rate, and the flood's refusal latency.
Goal (issue 11): with the engine process, flood p99 <= 1.2x steady p99.

    python benchmarks/frontend_load.py [--model default] [--seconds 10] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

from harness import free_port, machine, save
from sloserve.bench.client import LoadSpec, connect, run_load, wait_ready
from sloserve.bench.workloads import WorkloadItem
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.sampling_params import SLO


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def _phase(target: str, items: list[WorkloadItem], args, flood_rate: float | None) -> dict:
    channel = await connect(target)
    try:
        steady = LoadSpec(concurrency=args.concurrency, duration_s=args.seconds, streams=2, ignore_eos=True)
        jobs = [run_load(channel, items, steady, id_prefix=f"steady{flood_rate or 0:.0f}")]
        if flood_rate:
            flood = LoadSpec(rate=flood_rate, duration_s=args.seconds, streams=4, ignore_eos=True,
                             slo=SLO(ttft_s=args.flood_ttft_s), seed=1)
            jobs.append(run_load(channel, items, flood, id_prefix="flood"))
        started = time.perf_counter()
        results = await asyncio.gather(*jobs)
        stats = (await pb_grpc.SloserveStub(channel).Info(pb.InfoRequest(), timeout=10)).stats
        elapsed = time.perf_counter() - started
    finally:
        await channel.close()
    steady_done = [r for r in results[0].records if r.status == "ok"]
    out = {"completed_per_s": len(steady_done) / elapsed,
           "step_p50_ms": stats.step_time_p50_s * 1e3, "step_p99_ms": stats.step_time_p99_s * 1e3}
    if flood_rate:
        flood_records = results[1].records
        refused = [r for r in flood_records if r.status == "refused"]
        out.update(offered_per_s=len(flood_records) / args.seconds, refused=len(refused),
                   flood_completed=sum(r.status == "ok" for r in flood_records),
                   refusal_p50_ms=quantile([r.end_time - r.send_time for r in refused if r.end_time], 0.5) * 1e3,
                   refusal_p99_ms=quantile([r.end_time - r.send_time for r in refused if r.end_time], 0.99) * 1e3)
    return out


def run_arm(arm: str, args) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "sloserve.cli.main", "serve", "--model", args.model, "--device", "cpu",
           "--port", str(port), "--metrics-port", "off", "--http-port", "off", "--max-model-len", "512"]
    if arm == "thread":
        cmd.append("--no-engine-process")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    target = f"127.0.0.1:{port}"
    try:
        async def ready() -> None:
            channel = await connect(target, timeout_s=300)
            try:
                await wait_ready(channel, 300)
            finally:
                await channel.close()

        asyncio.run(ready())
        items = [WorkloadItem(f"steady load prompt {i}: " + "0123456789\n" * 6, args.max_tokens)
                 for i in range(64)]
        asyncio.run(_phase(target, items, argparse.Namespace(**{**vars(args), "seconds": 3}), None))  # warm
        steady = asyncio.run(_phase(target, items, args, None))
        flood = asyncio.run(_phase(target, items, args, args.flood_x * steady["completed_per_s"]))
    finally:
        proc.terminate()
        proc.wait(60)
    return {"steady": steady, "flood": flood,
            "p99_ratio": flood["step_p99_ms"] / steady["step_p99_ms"],
            "p50_ratio": flood["step_p50_ms"] / steady["step_p50_ms"],
            "completion_ratio": flood["completed_per_s"] / steady["completed_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")  # the 3M built-in: fast steps, so the front end is stressed
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--flood-x", type=float, default=10.0)
    parser.add_argument("--flood-ttft-s", type=float, default=0.05)
    parser.add_argument("--arms", default="process,thread")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    results = {arm: run_arm(arm, args) for arm in args.arms.split(",")}
    print(f"{'arm':8} {'phase':7} {'done/s':>7} {'step p50':>9} {'step p99':>9} {'offered/s':>9} "
          f"{'refused':>7} {'refusal p99':>11}")
    for arm, r in results.items():
        for phase in ("steady", "flood"):
            p = r[phase]
            print(f"{arm:8} {phase:7} {p['completed_per_s']:7.1f} {p['step_p50_ms']:7.2f}ms {p['step_p99_ms']:7.2f}ms "
                  f"{p.get('offered_per_s', 0):9.0f} {p.get('refused', 0):7d} {p.get('refusal_p99_ms', 0):9.1f}ms")
        print(f"{arm:8} flood/steady: step p50 x{r['p50_ratio']:.2f}, step p99 x{r['p99_ratio']:.2f} "
              f"(goal <= x1.2), closed-loop completions x{r['completion_ratio']:.2f}")
    save("frontend_load", {"machine": machine(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
