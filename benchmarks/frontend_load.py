"""A 10x flood against one front end and against several (`--frontends N`), side by side.

For each arm (an integer N: `sloserve serve --frontends N`; `thread`: one front end with the
engine in its process, `--no-engine-process`) a fresh server is started and:
  1. steady: a closed loop at --concurrency (no SLO) for --seconds; its completion rate is the
     capacity, and Info's step-time p50/p99 (the engine's last 512 steps) the baseline;
  2. flood: the same closed loop plus an open loop at --flood-x times the capacity of requests
     with a tight first-token SLO (admission refuses most), offered by --clients processes over
     --connections connections each (SO_REUSEPORT spreads connections, not requests, over the
     front ends, and one Python client cannot offer thousands a second alone).
During both, the CPU each role used is read from /proc, in cores (CPU seconds / wall seconds):
the engine process, the front ends, the closed-loop client (this process) and the flood
clients. On one machine the clients share the cores with the server; these say how.
Every arm of a round is offered the same flood rate (--flood-rate, else --flood-x times the
capacity the round's first arm measured). Printed per arm: the refusals' latency p50/p99
(issue 44: ~10 s at p99 with one front end at 4-5k requests/s offered); the closed loop's
completions under the flood / capacity (done/cap) and all completions, the closed loop's and
the admitted flood requests' (served/cap: the flood's requests are the same size); step p99
flood / steady (issue 11's goal <= x1.2); and the cores each role used. Arms alternate over
--rounds.

    python -m benchmarks.frontend_load [--arms 1,4] [--seconds 10] [--flood-x 10] [--clients 4]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import time

from sloserve.bench.client import CHANNEL_OPTIONS, LoadSpec, connect, run_load, wait_ready
from sloserve.bench.workloads import WorkloadItem
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.sampling_params import SLO
from sloserve.testing.procfs import cpu_seconds, process_tree
from sloserve.testing.quantile import quantile

from benchmarks.harness import ServerProcess, free_port, machine, save

OWN_CONNECTION = [
    *CHANNEL_OPTIONS,
    ("grpc.use_local_subchannel_pool", 1),
]  # not shared with other channels


def workload(max_tokens: int) -> list[WorkloadItem]:
    return [
        WorkloadItem(f"steady load prompt {i}: " + "0123456789\n" * 6, max_tokens)
        for i in range(64)
    ]


async def _flood_connections(
    target: str, rate: float, args, seed: int
) -> list[tuple[str, float | None]]:
    """--connections connections of this process, each an open loop at rate / connections."""
    import grpc

    items = workload(args.max_tokens)
    channels = [
        grpc.aio.insecure_channel(target, options=OWN_CONNECTION) for _ in range(args.connections)
    ]
    try:
        spec = [
            LoadSpec(
                rate=rate / args.connections,
                duration_s=args.seconds,
                streams=2,
                ignore_eos=True,
                slo=SLO(ttft_s=args.flood_ttft_s),
                seed=seed * 1000 + i,
            )
            for i in range(args.connections)
        ]
        results = await asyncio.gather(
            *(
                run_load(ch, items, s, id_prefix=f"flood{seed}.{i}")
                for i, (ch, s) in enumerate(zip(channels, spec, strict=True))
            )
        )
    finally:
        for ch in channels:
            await ch.close()
    return [
        (r.status, r.end_time - r.send_time if r.end_time else None)
        for res in results
        for r in res.records
    ]


def flood_client(target: str, rate: float, args, seed: int) -> list[tuple[str, float | None]]:
    """One flood client process: (status, seconds to the answer) of every request it sent."""
    return asyncio.run(_flood_connections(target, rate, args, seed))


async def _steady(target: str, args, seconds: float) -> dict:
    """The closed loop for `seconds`, and Info's step times after it."""
    channel = await connect(target)
    try:
        spec = LoadSpec(
            concurrency=args.concurrency, duration_s=seconds, streams=2, ignore_eos=True
        )
        started = time.perf_counter()
        result = await run_load(
            channel, workload(args.max_tokens), spec, id_prefix=f"steady{started:.0f}"
        )
        elapsed = time.perf_counter() - started
        stats = (await pb_grpc.SloserveStub(channel).Info(pb.InfoRequest(), timeout=10)).stats
    finally:
        await channel.close()
    return {
        "completed_per_s": sum(r.status == "ok" for r in result.records) / elapsed,
        "step_p50_ms": stats.step_time_p50_s * 1e3,
        "step_p99_ms": stats.step_time_p99_s * 1e3,
    }


class RoleCpu:
    """Cores each role's processes used between start() and cores() (see the module doc)."""

    def __init__(self, server: ServerProcess, engine: int) -> None:
        server_pids = set(server.pids())
        me = os.getpid()
        self.roles = {
            "engine": [engine],
            "frontends": sorted(server_pids - {engine}),
            "closed_client": [me],
            "flood_clients": sorted(set(process_tree(me)) - server_pids - {me}),
        }
        self._start = self._now()

    def _now(self) -> tuple[float, dict[str, float]]:
        return time.perf_counter(), {role: cpu_seconds(p) for role, p in self.roles.items()}

    def start(self) -> None:
        self._start = self._now()

    def cores(self) -> dict[str, float]:
        (t0, cpu0), (t1, cpu1) = self._start, self._now()
        return {role: round((cpu1[role] - cpu0[role]) / (t1 - t0), 3) for role in self.roles}


def _flood(target: str, args, rate: float, pool) -> dict:
    """The closed loop in this process while --clients processes flood the server at `rate`."""
    jobs = [
        pool.apply_async(flood_client, (target, rate / args.clients, args, k + 1))
        for k in range(args.clients)
    ]
    out = asyncio.run(_steady(target, args, args.seconds))
    sent = [rec for job in jobs for rec in job.get(timeout=args.seconds + 600)]
    refused = [latency for status, latency in sent if status == "refused" and latency is not None]
    out.update(
        offered_per_s=len(sent) / args.seconds,
        refused=len(refused),
        flood_completed=sum(status == "ok" for status, _ in sent),
        flood_failed=sum(status == "failed" for status, _ in sent),
        refusal_p50_ms=quantile(refused, 0.5) * 1e3,
        refusal_p99_ms=quantile(refused, 0.99) * 1e3,
    )
    return out


def run_arm(arm: str, args, pool, flood_rate: float | None) -> dict:
    """One fresh server: steady, then the flood (at flood_rate, else --flood-x times this capacity)."""
    port = free_port()
    cmd = [
        "serve",
        "--model",
        args.model,
        "--device",
        "cpu",
        "--port",
        str(port),
        "--metrics-port",
        "off",
        "--http-port",
        "off",
        "--max-model-len",
        "512",
        "--log-format",
        "json",  # RoleCpu reads the engine's pid from its log line
    ]
    cmd += ["--no-engine-process"] if arm == "thread" else ["--frontends", arm]
    server = ServerProcess(cmd, port=port, env={"OMP_WAIT_POLICY": "PASSIVE"})
    target = server.target
    try:

        async def ready() -> None:
            channel = await connect(target, timeout_s=300)
            try:
                await wait_ready(channel, 300)
            finally:
                await channel.close()

        asyncio.run(ready())
        # the other front ends join the engine
        time.sleep(2.0 if arm != "thread" and int(arm) > 1 else 0.0)
        asyncio.run(_steady(target, args, min(3.0, args.seconds)))  # warm
        cpu = RoleCpu(server, server.proc.pid if arm == "thread" else server.engine_pid())
        steady = asyncio.run(_steady(target, args, args.seconds))
        steady["cores"] = cpu.cores()
        cpu.start()
        flood = _flood(target, args, flood_rate or args.flood_x * steady["completed_per_s"], pool)
        flood["cores"] = cpu.cores()
    finally:
        server.stop(60)
    served = flood["completed_per_s"] + flood["flood_completed"] / args.seconds
    return {
        "steady": steady,
        "flood": flood,
        "p99_ratio": flood["step_p99_ms"] / steady["step_p99_ms"],
        "completion_ratio": flood["completed_per_s"] / steady["completed_per_s"],
        "served_ratio": served / steady["completed_per_s"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # the 3M built-in: fast steps, so the front end is stressed
    p.add_argument("--model", default="default")
    p.add_argument(
        "--arms", default="1,4", help="comma-separated: a number of front ends, or 'thread'"
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="each round runs every arm (order alternates)"
    )
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--flood-x", type=float, default=10.0)
    p.add_argument("--flood-ttft-s", type=float, default=0.05)
    p.add_argument(
        "--flood-rate",
        type=float,
        default=None,
        help="requests/s offered by the flood [default: --flood-x times the capacity the "
        "round's first arm measured, the same for every arm of the round]",
    )
    p.add_argument("--clients", type=int, default=4, help="flood client processes")
    p.add_argument("--connections", type=int, default=4, help="connections per flood client")
    p.add_argument("--name", default="frontend_load", help="benchmarks/out/NAME.json")
    args = p.parse_args(argv)
    args.arm_list = args.arms.split(",")
    if any(a != "thread" and not (a.isdigit() and int(a) >= 1) for a in args.arm_list):
        p.error("--arms: each arm is a number of front ends >= 1 or 'thread'")
    if min(args.rounds, args.clients, args.connections, args.concurrency) < 1 or args.seconds <= 0:
        p.error("--rounds, --clients, --connections and --concurrency must be >= 1, --seconds > 0")
    return args


def _cores(cores: dict[str, float]) -> str:
    return "/".join(f"{c:.2f}" for c in cores.values())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"load average before: {os.getloadavg()}")
    results: dict[str, list[dict]] = {arm: [] for arm in args.arm_list}
    with multiprocessing.get_context("spawn").Pool(args.clients) as pool:
        for rnd in range(args.rounds):
            rate = args.flood_rate
            for arm in args.arm_list if rnd % 2 == 0 else args.arm_list[::-1]:
                results[arm].append(run_arm(arm, args, pool, rate))
                rate = rate or args.flood_x * results[arm][-1]["steady"]["completed_per_s"]
    print(
        f"{'arm':8} {'rnd':>3} {'capacity/s':>10} {'offered/s':>9} {'refused':>7} {'admitted':>8} "
        f"{'refusal p50':>11} {'refusal p99':>11} {'done/cap':>8} {'served/cap':>10} "
        f"{'step p99 x':>10}  cores steady -> flood (engine, front ends, closed client, flood clients)"
    )
    for arm, runs in results.items():
        for rnd, r in enumerate(runs):
            f = r["flood"]
            print(
                f"{arm:8} {rnd:3d} {r['steady']['completed_per_s']:10.1f} {f['offered_per_s']:9.0f} {f['refused']:7d} "
                f"{f['flood_completed']:8d} "
                f"{f['refusal_p50_ms']:9.1f}ms {f['refusal_p99_ms']:9.1f}ms {r['completion_ratio']:8.2f} "
                f"{r['served_ratio']:10.2f} {r['p99_ratio']:10.2f}  "
                f"{_cores(r['steady']['cores'])} -> {_cores(f['cores'])}"
            )
    base = args.arm_list[0]
    for arm in args.arm_list[1:]:
        pairs = zip(results[base], results[arm], strict=True)
        ratios = [b["flood"]["refusal_p99_ms"] / a["flood"]["refusal_p99_ms"] for a, b in pairs]
        print(f"refusal p99 {arm} / {base}: " + ", ".join(f"x{x:.2f}" for x in ratios))
    print(
        f"saved {save(args.name, {'machine': machine(), 'args': vars(args), 'results': results})}"
    )


if __name__ == "__main__":
    main()
