"""SIGTERM under load: every request gets its final message or a status; the process exits 0."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc
import pytest
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc

from tests.reliability.client import StreamClient, generate
from tests.reliability.harness import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GRACE_S = 1.5
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


async def _unary(stub, rid: str, max_tokens: int) -> tuple[str, int]:
    """One Generate call: ('final:<reason>', tokens) or ('status:<CODE>', tokens)."""
    tokens = 0
    try:
        async for msg in stub.Generate(generate(rid, text=f"unary {rid}", max_tokens=max_tokens).generate):
            if msg.WhichOneof("kind") == "chunk":
                tokens += len(msg.chunk.token_ids)
            elif msg.WhichOneof("kind") == "final":
                return f"final:{pb.FinishReason.Name(msg.final.finish_reason)}", tokens
        return "status:OK-without-final", tokens
    except grpc.aio.AioRpcError as exc:
        return f"status:{exc.code().name}", tokens


async def test_sigterm_under_load_answers_every_request_and_exits_zero(tiny_llama):
    server = ServerProcess.cli(tiny_llama, "--max-model-len", "256", "--grace", str(GRACE_S))
    try:
        server.wait_ready()
        async with server.aio_channel() as channel:
            stub = pb_grpc.SloserveStub(channel)
            clients = [StreamClient(stub) for _ in range(3)]
            lengths = {}
            for c, client in enumerate(clients):
                for i in range(10):
                    rid = f"s{c}-{i}"
                    lengths[rid] = 6 if i % 2 else 240  # short ones finish in the grace period, long ones cannot
                    await client.send(generate(rid, text=f"shutdown test {rid}", max_tokens=lengths[rid]))
            unary = [asyncio.create_task(_unary(stub, f"u{i}", 6 if i % 2 else 240)) for i in range(6)]
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

    stream_outcomes: Counter[str] = Counter()
    for client in clients:
        for rid, record in client.records.items():
            if rid == "late":
                continue
            assert record.extra_terminals == 0, record
            if record.final is not None:
                assert record.final.finish_reason == pb.FINISH_REASON_LENGTH, record
                assert record.tokens == lengths[rid] == record.final.completion_tokens, record
                stream_outcomes["final"] += 1
            elif record.error is not None:
                assert record.error.code == UNAVAILABLE.value[0], record
                stream_outcomes[f"error:{record.error.reason}"] += 1
            else:  # no terminal message: then the stream itself must have said UNAVAILABLE
                assert client.status == UNAVAILABLE, (
                    f"{rid} dropped silently: no terminal message and stream status {client.status}")
                stream_outcomes["stream:UNAVAILABLE"] += 1
    print(f"\nshutdown: exit {code} after {exited_after:.2f}s (grace {GRACE_S}s); streams {dict(stream_outcomes)}"
          f" (statuses {[c.status.name if c.status else None for c in clients]}); unary {Counter(o for o, _ in unary_outcomes)};"
          f" late request: {late.outcome} {late.error.reason if late.error else ''}")
    assert code == 0
    assert late.error is not None and late.error.code == UNAVAILABLE.value[0] and late.error.reason == "draining"
    assert stream_outcomes["final"] >= 15, "the short requests should finish within the grace period"
    for (outcome, tokens), i in zip(unary_outcomes, range(6), strict=True):
        assert outcome in ("final:FINISH_REASON_LENGTH", "status:UNAVAILABLE"), (i, outcome, tokens)
    assert "stopped" in server.messages()
