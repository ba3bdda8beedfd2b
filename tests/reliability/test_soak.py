"""Soak: many mixed requests in a steady closed loop; no leak, flat memory, flat latency.

500 requests (10,000 with SLOSERVE_FULL=1) after a short warm-up, in four equal quarters with the
same deterministic mix (short and long prompts, a shared prefix, stop strings, seeded sampling,
unary calls, cancels). Between quarters the server goes quiescent and is measured: KV blocks and
swap slots all free, RSS, CPU seconds used.

Latency: the last quarter's median end-to-end latency (server-side Final.e2e_s) must be within
10% of the second's (the first still settles; see the NOTE below) with SLOSERVE_FULL=1. In CI
the bound is 2x, and that looser bound is
deliberate: on the shared 2-core CI box (load average ~10 from other jobs) the same steady
probe (one small request sent alone 30 times after each quarter) moved by -30%..+95% between
quarters of one run while an in-process engine run of 2,000 requests showed flat probe latency,
so a 10% bound there would measure the neighbours, not the server. 2x still catches a server
whose per-request cost grows with the number of requests served. The probe and the server's CPU
seconds per request are printed for each quarter (not asserted: they are as noisy).
"""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.quantile import quantile
from sloserve.testing.server_process import SERVICE_NAME, ServerProcess, describe, quiescent

from tests.reliability.client import Record, StreamClient, generate
from tests.reliability.harness import FULL, count

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600 if FULL else 400)]

TOTAL = count(500, 10_000)
WARMUP = count(60, 500)
CONCURRENCY = 6
PROBES = 30
LATENCY_BOUND = 1.10 if FULL else 2.0  # see the module docstring for why CI is looser
PREFIX = "You are a careful assistant. Answer in one short line. "  # shared by every 3rd prompt


def _mixed(n: int) -> tuple[pb.ClientMessage, bool]:
    """Request n of the deterministic mix (period 12); the flag says whether to cancel it mid-stream."""
    k = n % 12
    body = f"request {n}: " + "abcdefghij" * (1 + k % 4)
    text = PREFIX + body if k % 3 == 0 else body
    msg = generate(f"m{n}", text=text, max_tokens=(4, 16, 32, 8)[k % 4])
    if k == 5:
        msg.generate.sampling.temperature = 0.8
        msg.generate.sampling.seed = n
    if k == 7:
        msg.generate.sampling.stop.append("q")
        msg.generate.sampling.ignore_eos = False
    return msg, k == 11


@dataclass
class Quarter:
    e2e: list[float]
    cpu_s: float
    rss: int
    outcomes: Counter
    probe: float = 0.0  # 10th-percentile server-side e2e of the steady probe after the quarter
    probe_cpu: float = 0.0  # server CPU seconds per probe request

    @property
    def median_e2e(self) -> float:
        return statistics.median(self.e2e)


async def _probe(server: ServerProcess, stub) -> tuple[float, float]:
    """The same small request, alone on the server, PROBES times: p10 e2e, and server CPU s per request."""
    client = StreamClient(stub)
    e2e = []
    cpu0 = server.cpu_seconds()
    for i in range(PROBES):
        record = await client.send(generate(f"probe{i}", text="steady probe prompt", max_tokens=16))
        assert await client.wait_terminals(60)
        e2e.append(record.final.e2e_s)
    await client.close()
    return quantile(e2e, 0.1), (server.cpu_seconds() - cpu0) / PROBES


async def _phase(server: ServerProcess, stub, start: int, n: int) -> Quarter:
    client = StreamClient(stub)
    cpu0 = server.cpu_seconds()
    next_index = iter(range(start, start + n))
    records: list[Record] = []
    tally: Counter = Counter()

    async def unary(i: int) -> None:
        msg, _ = _mixed(i)
        async for reply in stub.Generate(msg.generate, timeout=120):
            if reply.WhichOneof("kind") == "final":
                tally[f"unary:{pb.FinishReason.Name(reply.final.finish_reason)}"] += 1

    async def worker() -> None:
        for i in next_index:
            if i % 10 == 9:
                await unary(i)
                continue
            msg, cancel = _mixed(i)
            record = await client.send(msg)
            if cancel:
                while not record.tokens and record.final is None:
                    await asyncio.sleep(0.001)
                await client.cancel(record.request_id)
            while record.final is None and record.error is None:
                await asyncio.sleep(0.002)
            records.append(record)

    await asyncio.wait_for(
        asyncio.gather(*(worker() for _ in range(CONCURRENCY))), 3000 if FULL else 300
    )
    await client.close()
    assert client.status == grpc.StatusCode.OK
    stats = server.wait_quiescent()
    assert quiescent(stats), f"leak after requests {start}..{start + n}: {describe(stats)}"
    probe, probe_cpu = await _probe(server, stub)
    tally.update(r.outcome for r in records)
    assert set(tally) <= {
        "final:FINISH_REASON_LENGTH",
        "final:FINISH_REASON_STOP",
        "final:FINISH_REASON_CANCELLED",
        "unary:FINISH_REASON_LENGTH",
        "unary:FINISH_REASON_STOP",
    }, tally
    e2e = [r.final.e2e_s for r in records if r.final.finish_reason != pb.FINISH_REASON_CANCELLED]
    return Quarter(e2e, server.cpu_seconds() - cpu0, server.rss_bytes(), tally, probe, probe_cpu)


async def test_soak_has_no_leak_and_flat_memory_and_latency(tiny_llama):
    server = ServerProcess.cli(
        tiny_llama, "--max-model-len", "256", "--kv-pool-size", str(256 * 8192)
    )
    try:
        server.wait_ready()
        async with server.aio_channel() as channel:
            stub = pb_grpc.SloserveStub(channel)
            warm = await _phase(server, stub, 0, WARMUP)
            quarters = []
            for q in range(4):
                quarters.append(await _phase(server, stub, WARMUP + q * TOTAL // 4, TOTAL // 4))
        stats = server.info().stats
        assert server.health(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()
    # NOTE: the baseline is the second quarter: the first still settles (one clean-clone run measured
    # medians of 11.6, 27.8, 27.0, 28.2 ms -- a fast start, then flat), and a drift shows after it too.
    baseline, last = quarters[1], quarters[-1]
    per_req = [q.cpu_s / (TOTAL // 4) for q in quarters]
    print(
        f"\nsoak: {WARMUP} warm-up + {TOTAL} requests; "
        f"outcomes {dict(sum((q.outcomes for q in quarters), Counter()))}\n"
        f"  median e2e per quarter (ms): {[round(q.median_e2e * 1e3, 1) for q in quarters]}\n"
        f"  steady probe p10 e2e after each quarter (ms): {[round(q.probe * 1e3, 2) for q in quarters]}\n"
        f"  steady probe server CPU ms/request: {[round(q.probe_cpu * 1e3, 2) for q in quarters]}\n"
        f"  server CPU ms/request per quarter: {[round(c * 1e3, 2) for c in per_req]}\n"
        f"  RSS MiB: after warm-up {warm.rss / 2**20:.1f}, per quarter {[round(q.rss / 2**20, 1) for q in quarters]}\n"
        f"  end: {describe(stats)}"
    )
    assert last.rss <= warm.rss * 1.05, f"RSS grew {last.rss / warm.rss - 1:.1%} after warm-up"
    assert last.median_e2e <= baseline.median_e2e * LATENCY_BOUND, (
        f"median latency grew {last.median_e2e / baseline.median_e2e - 1:.1%} from the second quarter to the last"
    )
