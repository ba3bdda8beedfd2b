"""A live SloserveServer on 127.0.0.1:0 (over a FakeEngine by default) and the helpers of a Stream client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from sloserve.config import GrpcConfig, ServerConfig, SloserveConfig
from sloserve.grpc.server import SloserveServer
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.fake_engine import FakeEngine


@contextlib.asynccontextmanager
async def live_server(
    engine: FakeEngine | None = None,
    *,
    start_engine: bool = True,
    credentials: grpc.ChannelCredentials | None = None,
    grpc_config: GrpcConfig | None = None,
    **server_kw,
) -> AsyncIterator[tuple[SloserveServer, pb_grpc.SloserveStub, grpc.aio.Channel]]:
    """A SloserveServer on an ephemeral port with a connected channel; stopped on exit."""
    engine = engine or FakeEngine()
    server_kw.setdefault("metrics_port", None)  # the metrics test turns it on
    config = SloserveConfig(
        server=ServerConfig(host="127.0.0.1", port=0, **server_kw), grpc=grpc_config or GrpcConfig()
    )
    server = SloserveServer(config, engine, watchdog_interval_s=0.02)
    await server.start(start_engine=start_engine)
    if start_engine:
        await wait_for(lambda: engine.ready)
    target = f"127.0.0.1:{server.port}"
    if credentials is not None:
        channel = grpc.aio.secure_channel(
            target, credentials, options=[("grpc.ssl_target_name_override", "localhost")]
        )
    else:
        channel = grpc.aio.insecure_channel(target)
    try:
        yield server, pb_grpc.SloserveStub(channel), channel
    finally:
        await channel.close()
        await server.stop(grace_s=0)


async def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01) -> None:
    """Poll until predicate() is true (a bounded wait, not a timing assertion)."""

    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(interval)

    await asyncio.wait_for(poll(), timeout)


def gen(request_id: str, text: str = "hello", max_tokens: int = 8, **kw) -> pb.ClientMessage:
    sampling = kw.pop("sampling", None)
    slo = kw.pop("slo", None)
    req = pb.GenerateRequest(request_id=request_id, text=text, max_tokens=max_tokens, **kw)
    if sampling is not None:
        req.sampling.CopyFrom(sampling)
    if slo is not None:
        req.slo.CopyFrom(slo)
    return pb.ClientMessage(generate=req)


def cancel(request_id: str) -> pb.ClientMessage:
    return pb.ClientMessage(cancel=pb.CancelRequest(request_id=request_id))


@dataclass
class Transcript:
    """Everything one stream received, in order."""

    messages: list[pb.ServerMessage] = field(default_factory=list)

    def chunks(self, rid: str) -> list[pb.TokenChunk]:
        return [
            m.chunk
            for m in self.messages
            if m.WhichOneof("kind") == "chunk" and m.chunk.request_id == rid
        ]

    def terminals(self, rid: str) -> list[pb.ServerMessage]:
        return [
            m
            for m in self.messages
            if m.WhichOneof("kind") in ("final", "error")
            and getattr(m, m.WhichOneof("kind")).request_id == rid
        ]

    def terminal(self, rid: str) -> pb.ServerMessage:
        found = self.terminals(rid)
        assert len(found) == 1, f"{rid}: expected exactly one terminal message, got {found}"
        return found[0]

    def tokens(self, rid: str) -> list[int]:
        ids = [t for c in self.chunks(rid) for t in c.token_ids]
        return ids


async def read_until(call, transcript: Transcript, done: set[str]) -> None:
    """Read messages until every id in `done` has its terminal message."""
    pending = set(done)
    while pending:
        msg = await call.read()
        assert msg is not grpc.aio.EOF, f"stream ended before terminals of {pending}"
        transcript.messages.append(msg)
        kind = msg.WhichOneof("kind")
        if kind in ("final", "error"):
            pending.discard(getattr(msg, kind).request_id)
