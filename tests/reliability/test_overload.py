"""Offered load 10x what the server sustains: the excess is refused fast, memory stays bounded,
and the admitted requests keep their SLO.

A short closed-loop run (no SLOs, so admission control cannot shape it) measures the
sustainable request rate of this workload on this machine; then an open loop offers 10x that
rate for 15 s (60 s with SLOSERVE_FULL=1). Every offered request carries a first-token SLO,
which is what admission control protects. The run happens once; the tests below each check one
property of it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.quantile import quantile
from sloserve.testing.server_process import SERVICE_NAME, ServerProcess, describe, quiescent

from tests.reliability.client import Record, StreamClient, generate, outcomes
from tests.reliability.harness import count
from tests.reliability.load import LoopLag, RssSampler, closed_loop, open_loop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

# 1,024 KV pages of the tiny llama (8 MiB); the swap pool is at most as big
POOL_BYTES = 1024 * 8192
FIXED_OVERHEAD = 256 * 2**20  # allocator slack, gRPC buffers, Python objects of queued requests
TTFT_SLO_S = 1.0
REFUSAL_P99_S = 0.1
DURATION_S = count(15, 60)
STREAMS = 4
CONCURRENCY = 32  # closed-loop clients while measuring capacity (half of --max-batch 64)


def _request(rid: str, slo: bool = True) -> pb.ClientMessage:
    return generate(
        rid,
        text=f"{rid} overload test prompt, a few dozen bytes long.",
        max_tokens=32,
        slo=pb.Slo(ttft_s=TTFT_SLO_S) if slo else None,
    )


def _no_slo(rid: str) -> pb.ClientMessage:
    return _request(rid, slo=False)


@pytest.fixture(scope="module")
def server(tiny_llama):
    server = ServerProcess.cli(
        tiny_llama, "--max-model-len", "256", "--kv-pool-size", str(POOL_BYTES)
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


async def test_light_load_prefill_is_not_refused(server):
    """One request decoding alone, then a 200-token prompt whose SLO is 150 decode steps plus twice
    what the same prompt took on an idle engine: admitted.

    (Regression: a tokens/s estimate taken from 1-token decode steps priced the prompt at ~200 steps
    and refused it; at admission's 60% margin 150 steps still catch that wherever a decode step is
    a noticeable part of a prefill. Not 50: with runs of decode steps a step is a quarter of a run,
    and 50 of them came within the fixed delays a newcomer sees -- the run in flight, the hop to the
    engine and back. Those delays and the prefill itself are measured, not assumed: on a quiet fast
    machine a decode step took 0.03 ms, 150 of them less than the prefill, and an SLO built from
    decode steps alone was rightly refused.)
    """
    async with server.aio_channel() as channel:
        client = StreamClient(pb_grpc.SloserveStub(channel))
        # Another 200-token prompt (no shared prefix) alone: the prefill's cost plus the fixed delays.
        alone = await client.send(generate("alone-prefill", text="q" * 199, max_tokens=1))
        assert await client.wait_terminals(60) and alone.final is not None
        alone_s = alone.first_chunk_at - alone.sent_at
        decoder = await client.send(generate("alone", text="decode alone", max_tokens=230))
        while decoder.tokens < 150 and decoder.final is None:  # only 1-token steps in recent memory
            await asyncio.sleep(0.005)
        step_s = server.info().stats.step_time_s
        slo = pb.Slo(ttft_s=150 * step_s + 2 * alone_s)
        probe = await client.send(generate("long-prompt", text="p" * 199, max_tokens=4, slo=slo))
        assert await client.wait_terminals(60)
        await client.close()
    print(
        f"\nlight load: decode step {step_s * 1e3:.2f} ms, prompt alone {alone_s * 1e3:.1f} ms, "
        f"SLO {slo.ttft_s * 1e3:.0f} ms"
        f" -> {probe.outcome} {probe.error.message if probe.error else f'ttft {probe.final.ttft_s * 1e3:.0f} ms'}"
    )
    assert probe.final is not None, f"refused at light load: {probe.error.message}"
    assert probe.final.ttft_s <= slo.ttft_s


@dataclass
class OverloadRun:
    sustainable: float  # requests/s
    rate: float  # offered requests/s
    offered: list[Record]
    rss_before: int
    rss_peak: int
    after: pb.EngineStats

    @property
    def completed(self) -> list[Record]:
        return [r for r in self.offered if r.final is not None]

    @property
    def refused(self) -> list[Record]:
        return [r for r in self.offered if r.error is not None]

    @property
    def attainment(self) -> float:
        return sum(r.final.ttft_s <= TTFT_SLO_S for r in self.completed) / max(
            1, len(self.completed)
        )


@pytest.fixture(scope="module")
def run(server) -> OverloadRun:
    return asyncio.run(_overload(server))


async def _overload(server: ServerProcess) -> OverloadRun:
    async with server.aio_channel() as channel:
        stub = pb_grpc.SloserveStub(channel)
        clients = [StreamClient(stub) for _ in range(STREAMS)]
        await closed_loop(clients, _no_slo, concurrency=8, duration_s=2.0, prefix="warm")
        t0 = time.monotonic()
        measured = await closed_loop(
            clients, _no_slo, concurrency=CONCURRENCY, duration_s=4.0, prefix="sus"
        )
        sustainable = len(measured) / (time.monotonic() - t0)
        assert all(r.final is not None for r in measured), outcomes(measured)
        rss_before = server.rss_bytes()
        rate = 10 * sustainable
        async with LoopLag() as lag:
            with RssSampler(server.rss_bytes) as rss:
                t1 = time.monotonic()
                offered = await open_loop(clients, _request, rate=rate, duration_s=DURATION_S)
                sent_for = time.monotonic() - t1
                for client in clients:
                    assert await client.wait_terminals(120), (
                        f"no terminal for {client.pending()[:5]}"
                    )
        for client in clients:
            await client.close()
            assert client.status == grpc.StatusCode.OK, (client.status, client.details)
    result = OverloadRun(sustainable, rate, offered, rss_before, rss.peak, server.wait_quiescent())
    refused, completed = result.refused, result.completed
    refusal_s = [r.done_at - r.sent_at for r in refused]
    ttft = [r.final.ttft_s for r in completed]
    e2e = [r.final.e2e_s for r in completed]
    print(
        f"\noverload: sustainable {sustainable:.1f} req/s (closed loop, {CONCURRENCY} clients), offered "
        f"{rate:.0f} req/s for {DURATION_S}s ({len(offered)} sent, {len(offered) / sent_for:.0f}/s achieved)\n"
        f"  outcomes {dict(outcomes(offered))}; refusal reasons {dict(Counter(r.error.reason for r in refused))}\n"
        f"  refusal latency p50 {quantile(refusal_s, 0.5) * 1e3:.1f} ms p99 {quantile(refusal_s, 0.99) * 1e3:.1f} ms"
        f" max {max(refusal_s, default=0) * 1e3:.1f} ms\n"
        f"  admitted: TTFT p50 {quantile(ttft, 0.5):.3f}s p99 {quantile(ttft, 0.99):.3f}s; attainment "
        f"{result.attainment:.1%} of {len(completed)}; "
        f"e2e p50 {quantile(e2e, 0.5):.3f}s p99 {quantile(e2e, 0.99):.3f}s\n"
        f"  client loop lag p50 {quantile(lag.lags, 0.5) * 1e3:.1f} ms p99 {quantile(lag.lags, 0.99) * 1e3:.1f} ms\n"
        f"  RSS before {rss_before / 2**20:.0f} MiB, peak {rss.peak / 2**20:.0f} MiB\n"
        f"  after: {describe(result.after)}"
    )
    return result


async def test_overload_excess_is_refused_fast_and_nothing_is_lost(server, run):
    by_outcome = outcomes(run.offered)
    assert set(by_outcome) <= {"final:FINISH_REASON_LENGTH", "error:RESOURCE_EXHAUSTED"}, by_outcome
    assert all(r.extra_terminals == 0 for r in run.offered)
    assert run.refused, "10x the sustainable load was all admitted: admission control did nothing"
    assert quiescent(run.after), describe(run.after)
    assert server.health(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING


# NOTE: not strict: whether these two pass depends on how the 10x rate compares with what 2 cores can
# parse, the load generator included. With the engine in its own process the sustainable rate rose
# to 230-580 req/s (chunks merged when the stream is busy), so the flood is 2,300-5,800 req/s; a
# 2,000 req/s flood is refused in p50 30 ms / p99 171 ms, 5,800 req/s in p50 2.2 s (loaded machine).
@pytest.mark.xfail(
    strict=False,
    reason="front end (grpc/, frontend/): above ~2,000 req/s offered on 2 shared cores "
    "the gRPC front end cannot parse and answer every request in time; the refusal p99 grows "
    "to seconds. Needs cheaper per-request front-end work or front-end load shedding",
)
async def test_overload_refusals_are_fast(run):
    """The engine runs in its own process, so refusing the excess never waits for a step's GIL."""
    refusal_s = [r.done_at - r.sent_at for r in run.refused]
    assert quantile(refusal_s, 0.99) < REFUSAL_P99_S, (
        f"refusal p99 {quantile(refusal_s, 0.99) * 1e3:.0f} ms: refusals must come long before the SLO would pass"
    )


@pytest.mark.xfail(
    strict=False,
    reason="with all of the server on one core (taskset -c 0) the flooded front end "
    "takes the engine's CPU: 217 req/s completed vs 287 sustainable (76%); on 2 cores 490 vs 478",
)
async def test_overload_keeps_doing_useful_work(run):
    goodput = len(run.completed) / DURATION_S
    assert goodput >= 0.8 * run.sustainable, (
        f"{goodput:.1f} req/s completed vs {run.sustainable:.1f} sustainable"
    )


async def test_overload_memory_stays_bounded(run):
    """RSS stays within what it was at steady load plus the pools (KV + swap) and a fixed overhead."""
    assert run.rss_peak <= run.rss_before + 2 * POOL_BYTES + FIXED_OVERHEAD, (
        run.rss_before,
        run.rss_peak,
    )


@pytest.mark.xfail(
    strict=False,
    reason="admission (sched/slo/admission.py) learns the front end's backlog only from "
    "the first tokens the front end hands out; a front end that cannot even parse the flood in time "
    "(see above) stamps arrivals late and reports late (86.7% attainment at 5,800 req/s offered "
    "once; it passed in the last four suite runs, one of them before the backlog was priced)",
)
async def test_overload_admitted_requests_keep_their_slo(run):
    assert run.attainment >= 0.95, (
        f"admitted requests met their TTFT SLO only {run.attainment:.1%} of the time"
    )
