"""`sloserve bench compare`: scheduling policies side by side on the same arrivals.

Loads are multiples of a measured capacity (``1.5x``) or rates (``3``, req/s). Capacity is the
throughput of a closed loop of ``concurrency`` requests on the first policy's server (completed
requests per second between its first completion and its last send). Every (load, policy) runs on
a fresh server; the policies of a load run one after another in an order that rotates from load
to load (so a drift of the machine's speed moves them alike); every policy gets the identical
requests and arrival times. Goodput per policy is the highest rate with attainment >= the target,
interpolated between the loads measured (stats.rate_at_attainment).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sloserve.bench.client import LoadSpec
from sloserve.bench.local_server import LocalServer, send_load
from sloserve.bench.plan import WorkloadPlan, unpaced
from sloserve.bench.stats import (
    RequestRecord,
    meets_slo,
    rate_at_attainment,
    steady_throughput,
    summarise,
)
from sloserve.bench.workloads import WorkloadItem


@dataclass(slots=True, frozen=True)
class Load:
    """A point of the sweep: a multiple of the capacity, or a rate in requests/s."""

    value: float
    relative: bool

    @property
    def label(self) -> str:
        return f"{self.value:g}x" if self.relative else f"{self.value:g}/s"

    def rate(self, capacity: float | None) -> float:
        return self.value * capacity if self.relative else self.value


def parse_loads(text: str) -> list[Load]:
    """'0.5x,1x,2' -> loads; ValueError names the part that is wrong."""
    loads = []
    for part in (p.strip() for p in text.split(",")):
        relative = part.endswith("x")
        try:
            value = float(part[:-1] if relative else part)
        except ValueError:
            value = math.nan
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(
                f"--rates: cannot read {part!r}; use multiples of capacity like 0.5x,1x,2x or req/s"
            )
        loads.append(Load(value, relative))
    if not loads:
        raise ValueError("--rates needs at least one load")
    return loads


@dataclass(slots=True, frozen=True)
class CompareSettings:
    """What to compare, on what, and how the runs are bounded."""

    policies: tuple[str, ...]
    model: str
    loads: tuple[Load, ...]
    plan: WorkloadPlan
    serve_args: tuple[str, ...] = ()
    capacity: float | None = None  # req/s; None: measured when a load is relative
    concurrency: int = 32
    capacity_requests: int = 100
    streams: int = 4
    request_timeout_s: float = 120.0
    attainment: float = 0.9
    interactive_class: str = "interactive"
    ready_timeout_s: float = 600.0
    log_dir: Path | None = None

    def __post_init__(self) -> None:
        if not self.policies or len(set(self.policies)) != len(self.policies):
            raise ValueError(
                f"--policies must name distinct policies, got {','.join(self.policies)!r}"
            )
        if self.capacity is not None and not (self.capacity > 0 and math.isfinite(self.capacity)):
            raise ValueError(f"--capacity must be > 0 req/s, got {self.capacity:g}")
        if self.concurrency < 1 or self.capacity_requests < 1 or self.streams < 1:
            raise ValueError("--concurrency, --capacity-requests and --streams must be >= 1")
        if not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be > 0 s, got {self.request_timeout_s:g}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {self.attainment:g}")


def interactive_attainment(records: list[RequestRecord], name: str) -> float | None:
    """Attainment of the class `name`, or, when no request carries it, of the requests with a TTFT
    objective (the latency-sensitive ones); None when there are none."""
    members = [r for r in records if r.slo_class == name] or [
        r for r in records if r.slo is not None and r.slo.ttft_s is not None
    ]
    return sum(meets_slo(r, r.slo) for r in members) / len(members) if members else None


# (policy, label) -> a context manager with .target, .wait_ready()
ServerFactory = Callable[[str, str], Any]
# (label, requests) -> a context manager, called per record
ProgressFactory = Callable[[str, int], Any]
# (server, point, records), the server still up
PointHook = Callable[[Any, dict, list[RequestRecord]], None]


class Comparison:
    """Runs a CompareSettings: capacity, then every load on every policy; `report()` is its JSON.

    start_server: how to start the server of a policy (default `sloserve serve --policy P`);
    workload: the requests of load i (default: the plan's, the same for every load); on_point: called
    after each run while its server is up (to read its counters into the point).
    """

    def __init__(
        self,
        settings: CompareSettings,
        start_server: ServerFactory | None = None,
        progress: ProgressFactory | None = None,
        log: Callable[[str], None] = print,
        workload: Callable[[int], list[WorkloadItem]] | None = None,
        on_point: PointHook | None = None,
    ) -> None:
        self.s, self.log, self.workload, self.on_point = settings, log, workload, on_point
        self.start_server = start_server or self._local_server
        self.progress = progress or (lambda label, total: contextlib.nullcontext(None))
        self.capacity: float | None = settings.capacity
        self.capacity_measured = False
        self.points: list[dict] = []
        self.info: dict = {}
        self.began = time.monotonic()

    def _local_server(self, policy: str, label: str) -> LocalServer:
        log = None if self.s.log_dir is None else self.s.log_dir / f"compare_{label}.log"
        return LocalServer.serve(
            self.s.model,
            ("--policy", policy, *self.s.serve_args),
            log,
            label=f"{policy} server ({label})",
        )

    def _send(self, target: str, items: list[WorkloadItem], spec: LoadSpec, label: str):
        with self.progress(label, len(items)) as bar:
            return asyncio.run(send_load(target, items, spec, bar))

    def run(self) -> dict:
        """The capacity (when a load is relative and none was given), then every point; the report."""
        s = self.s
        items = None
        if self.workload is None or (
            self.capacity is None and any(load.relative for load in s.loads)
        ):
            items = self.measure_capacity()
        for i, load in enumerate(s.loads):
            turn = (s.plan.seed + i) % len(s.policies)
            sent = items if self.workload is None else self.workload(i)
            for policy in s.policies[turn:] + s.policies[:turn]:
                self._point(policy, load, sent, seed=s.plan.seed + i)
        return self.report()

    def measure_capacity(self) -> list[WorkloadItem]:
        """Start the first policy's server, build the requests for its context and, unless given,
        measure the capacity with a closed loop; returns the requests."""
        s = self.s
        with self.start_server(s.policies[0], "capacity") as server:
            self.info = server.wait_ready(s.ready_timeout_s)
            items = (
                s.plan.items(self.info.get("max_model_len") or None)
                if self.workload is None
                else self.workload(0)
            )
            if self.capacity is None:
                self.capacity = self._closed_loop(server.target, items)
        return items

    def _closed_loop(self, target: str, items: list[WorkloadItem]) -> float:
        s = self.s
        batch = unpaced([items[k % len(items)] for k in range(s.capacity_requests)])
        spec = LoadSpec(
            concurrency=s.concurrency,
            streams=s.streams,
            seed=s.plan.seed,
            request_timeout_s=s.request_timeout_s,
        )
        result = self._send(target, batch, spec, f"capacity ({s.policies[0]})")
        done = [r for r in result.records if r.status == "ok"]
        capacity = steady_throughput(result.records) or (
            len(done) / result.duration_s if done else None
        )
        if not capacity:
            raise RuntimeError(
                "the capacity run completed no request; see the server log (--log-dir)"
            )
        self.capacity_measured = True
        self.log(
            f"capacity: {capacity:.3g} req/s (closed loop of {s.concurrency} on {s.policies[0]}, "
            f"{s.capacity_requests} requests)"
        )
        return capacity

    def _point(self, policy: str, load: Load, items: list[WorkloadItem], seed: int) -> None:
        s = self.s
        rate = load.rate(self.capacity)
        sent = s.plan.at_rate(items, rate)
        spec = LoadSpec(
            rate=rate,
            num_requests=len(sent),
            streams=s.streams,
            seed=seed,
            request_timeout_s=s.request_timeout_s,
        )
        began = time.monotonic()
        with self.start_server(policy, f"{policy}_{load.label.replace('/', 'ps')}") as server:
            server.wait_ready(s.ready_timeout_s)
            result = self._send(server.target, sent, spec, f"{policy} {load.label}")
            figures = summarise(result.records, result.duration_s, None, rate)
            point = {
                "policy": policy,
                "load": load.label,
                "rate": rate,
                "multiple": rate / self.capacity if self.capacity else None,
                "attainment": figures["slo_attainment"],
                "interactive_attainment": interactive_attainment(
                    result.records, s.interactive_class
                ),
                "goodput": figures["goodput"],
                "completed": figures["completed"],
                "refused": figures["refused"],
                "failed": figures["failed"],
                "requests": figures["requests"],
                "wall_s": time.monotonic() - began,
                "run": figures,
            }
            if self.on_point is not None:
                self.on_point(server, point, result.records)
        self.points.append(point)
        self.log(
            f"  [{policy} {load.label} = {rate:.3g} req/s] attainment {_pct(point['attainment'])}, "
            f"interactive {_pct(point['interactive_attainment'])}, refused {point['refused']}, "
            f"failed {point['failed']} (elapsed {(time.monotonic() - self.began) / 60:.1f} min)"
        )

    def goodput(self) -> dict[str, float | None]:
        """Per policy: the highest rate with attainment >= the target, interpolated between loads."""
        return {
            policy: rate_at_attainment(
                [(p["rate"], p["attainment"] or 0.0) for p in self.points if p["policy"] == policy],
                self.s.attainment,
            )
            for policy in self.s.policies
        }

    def report(self) -> dict:
        s = self.s
        return {
            "schema_version": 1,
            "tool": "sloserve bench compare",
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "model": s.model,
            "server_info": self.info,
            "workload": s.plan.workload,
            "policies": list(s.policies),
            "loads": [load.label for load in s.loads],
            "serve_args": list(s.serve_args),
            "capacity_rps": self.capacity,
            "capacity_measured": self.capacity_measured,
            "attainment_target": s.attainment,
            "interactive_class": s.interactive_class,
            "config": {
                "length_scale": s.plan.length_scale,
                "time_scale": s.plan.time_scale,
                "num_requests": s.plan.num_requests,
                "max_tokens": s.plan.max_tokens,
                "slo_rules": [r.text for r in s.plan.rules],
                "seed": s.plan.seed,
                "concurrency": s.concurrency,
                "capacity_requests": s.capacity_requests,
                "streams": s.streams,
                "request_timeout_s": s.request_timeout_s,
            },
            "goodput_rps": self.goodput(),
            "elapsed_s": time.monotonic() - self.began,
            "points": self.points,
        }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"
