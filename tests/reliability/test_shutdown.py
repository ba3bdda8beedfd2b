"""SIGTERM under load: every request gets its final message or a status; the process exits 0."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.server_process import WITH_FAULTS, ServerProcess

from tests.reliability.client import Record, StreamClient, generate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GRACE_S = 3.0
# every step with a '-hold' request in the batch takes this much longer (--inject-faults)
HOLD_S = 0.05
LONG, SHORT = (
    240,
    6,
)  # a held long request needs >= LONG * HOLD_S = 12 s: it cannot finish within GRACE_S
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


async def _unary(stub, rid: str, max_tokens: int) -> tuple[str, int]:
    """One Generate call: ('final:<reason>', tokens) or ('status:<CODE>', tokens)."""
    tokens = 0
    try:
        async for msg in stub.Generate(
            generate(rid, text=f"unary {rid}", max_tokens=max_tokens).generate
        ):
            if msg.WhichOneof("kind") == "chunk":
                tokens += len(msg.chunk.token_ids)
            elif msg.WhichOneof("kind") == "final":
                return f"final:{pb.FinishReason.Name(msg.final.finish_reason)}", tokens
        return "status:OK-without-final", tokens
    except grpc.aio.AioRpcError as exc:
        return f"status:{exc.code().name}", tokens


@dataclass
class ShutdownRun:
    clients: list[StreamClient]
    lengths: dict[str, int]
    unary: list[tuple[str, int]]
    late: Record
    code: int
    exited_after: float
    messages: list[str]


@pytest.fixture(scope="module")
def run(tiny_llama) -> ShutdownRun:
    """30 stream requests and 6 unary calls running, then SIGTERM; collected once for the tests below."""
    return asyncio.run(_sigterm_under_load(tiny_llama))


async def _sigterm_under_load(model) -> ShutdownRun:
    server = ServerProcess.cli(
        model,
        "--max-model-len",
        "256",
        "--grace",
        str(GRACE_S),
        "--inject-faults",
        f"slow-step:-hold={HOLD_S}",
        command=WITH_FAULTS,
    )
    try:
        server.wait_ready()
        async with server.aio_channel() as channel:
            stub = pb_grpc.SloserveStub(channel)
            clients = [StreamClient(stub) for _ in range(3)]
            lengths = {}
            for c, client in enumerate(clients):
                for i in range(10):
                    # Short ones finish in the grace period; long ones are held past it by construction.
                    rid = f"s{c}-{i}" if i % 2 else f"s{c}-{i}-hold"
                    lengths[rid] = SHORT if i % 2 else LONG
                    await client.send(
                        generate(rid, text=f"shutdown test {rid}", max_tokens=lengths[rid])
                    )
            unary = [
                asyncio.create_task(
                    _unary(stub, f"u{i}" if i % 2 else f"u{i}-hold", SHORT if i % 2 else LONG)
                )
                for i in range(6)
            ]
            deadline = time.monotonic() + 60
            while not all(r.tokens for c in clients for r in c.records.values()):
                assert time.monotonic() < deadline, "requests never started"
                await asyncio.sleep(0.005)
            server.signal()
            signalled = time.monotonic()
            server.wait_log(lambda m: m.startswith("draining: "), 30)
            late = await clients[0].send(generate("late", text="after SIGTERM", max_tokens=4))
            for client in clients:
                await client.wait_terminals(60)
            unary_outcomes = await asyncio.wait_for(asyncio.gather(*unary), 60)
        code = await asyncio.to_thread(server.wait, 60)
        exited_after = time.monotonic() - signalled
    finally:
        server.kill()
    return ShutdownRun(
        clients, lengths, unary_outcomes, late, code, exited_after, server.messages()
    )


def _stream_outcomes(run: ShutdownRun) -> Counter[str]:
    tally: Counter[str] = Counter()
    for client in run.clients:
        for rid, record in client.records.items():
            if rid == "late":
                continue
            if record.final is None and record.error is None:
                tally[f"no terminal, stream {client.status.name if client.status else None}"] += 1
            else:
                tally[record.outcome] += 1
    return tally


def test_sigterm_drains_short_requests_refuses_late_ones_and_exits_zero(run):
    print(
        f"\nshutdown: exit {run.code} after {run.exited_after:.2f}s (grace {GRACE_S}s); streams "
        f"{dict(_stream_outcomes(run))} (statuses {[c.status.name if c.status else None for c in run.clients]}); "
        f"unary {dict(Counter(o for o, _ in run.unary))}; late request: {run.late.outcome} "
        f"{run.late.error.reason if run.late.error else ''}"
    )
    assert run.code == 0
    late = run.late.error
    assert late is not None and late.code == UNAVAILABLE.value[0] and late.reason == "draining", (
        run.late
    )
    for client in run.clients:
        for rid, record in client.records.items():
            assert record.extra_terminals == 0, record
            if rid == "late":
                continue
            if rid.endswith("-hold"):  # held past the grace period: cancelled with UNAVAILABLE
                assert record.final is None, record
                assert (record.error is not None and record.error.code == UNAVAILABLE.value[0]) or (
                    record.error is None and client.status == UNAVAILABLE
                ), record
            else:  # short ones finish within the grace period
                assert record.final is not None, (
                    f"{rid} did not finish within the grace period: {record}"
                )
                assert record.final.finish_reason == pb.FINISH_REASON_LENGTH, record
                assert record.tokens == SHORT == record.final.completion_tokens, record
    assert [outcome for outcome, _ in run.unary] == [
        "status:UNAVAILABLE" if i % 2 == 0 else "final:FINISH_REASON_LENGTH" for i in range(6)
    ], run.unary
    assert "stopped" in run.messages


def test_sigterm_drops_nothing_silently(run):
    """Requests still running after the grace period end with UNAVAILABLE, never with silence."""
    for client in run.clients:
        for rid, record in client.records.items():
            if record.final is None and record.error is None:
                assert client.status == UNAVAILABLE, (
                    f"{rid} dropped silently: no terminal message and stream status {client.status}"
                )
            elif record.error is not None:
                assert record.error.code == UNAVAILABLE.value[0], record
