"""Stream and connection caps, requests per stream, idle Streams: each refuses with its documented status."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from sloserve.config import GrpcConfig
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.live_server import Transcript, gen, live_server, read_until

from tests.security.helpers import open_stream, refusals, status

pytestmark = pytest.mark.timeout(60)


async def test_streams_past_the_cap_are_refused_resource_exhausted(caplog):
    async with live_server(grpc_config=GrpcConfig(max_streams=3)) as (server, stub, _):
        calls = [await open_stream(stub) for _ in range(3)]
        for _ in range(20):
            code, details = await status(stub.Stream())
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--grpc-max-streams" in details
        # Generate calls count in the same cap
        with pytest.raises(grpc.aio.AioRpcError) as generate:
            async for _ in stub.Generate(gen("g").generate):
                pass
        assert generate.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refusals(server, "grpc_max_streams") == 21
        warnings = [r for r in caplog.records if "--grpc-max-streams" in r.getMessage()]
        assert len(warnings) == 1, "a refusal a client can repeat is a rate-limited warning"
        await calls[0].done_writing()  # one closes: a new Stream is served again
        assert (await status(calls[0]))[0] == grpc.StatusCode.OK
        calls[0] = await open_stream(stub)
        for call in calls:
            call.cancel()


async def test_requests_past_the_per_stream_cap_are_refused_and_the_others_go_on():
    engine = FakeEngine(step_s=0.02, max_running=8)
    async with live_server(engine, grpc_config=GrpcConfig(max_requests_per_stream=2)) as (
        server,
        stub,
        _,
    ):
        call = stub.Stream()
        for rid in ("a", "b", "c"):
            await call.write(gen(rid, max_tokens=20))
        transcript = Transcript()
        await read_until(call, transcript, {"a", "b", "c"})
        refused = transcript.terminal("c")
        assert refused.WhichOneof("kind") == "error"
        assert refused.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert refused.error.reason == "grpc_max_requests_per_stream"
        assert "--grpc-max-requests-per-stream" in refused.error.message
        for rid in ("a", "b"):
            assert transcript.terminal(rid).WhichOneof("kind") == "final"
        assert refusals(server, "grpc_max_requests_per_stream") == 1
        await call.done_writing()


async def test_connections_past_the_cap_are_closed_at_accept():
    async with live_server(grpc_config=GrpcConfig(max_connections=2)) as (
        server,
        _,
        helper_channel,
    ):
        await helper_channel.close()  # the helper's connection would count as one
        own = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel, not one shared
        channels = [
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=own) for _ in range(3)
        ]
        try:
            calls = [await open_stream(pb_grpc.SloserveStub(channel)) for channel in channels[:2]]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.SloserveStub(channels[2]).Info(pb.InfoRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            for call in calls:  # the connections inside the cap are unaffected
                await call.write(gen("still-served", max_tokens=2))
                transcript = Transcript()
                await read_until(call, transcript, {"still-served"})
                assert transcript.terminal("still-served").WhichOneof("kind") == "final"
                call.cancel()
        finally:
            for channel in channels:
                await channel.close()


async def test_streams_past_the_per_connection_cap_wait_for_a_free_slot():
    async with live_server(grpc_config=GrpcConfig(max_streams_per_connection=2)) as (
        _,
        stub,
        _channel,
    ):
        calls = [await open_stream(stub) for _ in range(2)]
        third = stub.Stream()
        writing = asyncio.ensure_future(third.write(gen("third", max_tokens=1)))
        first = asyncio.ensure_future(third.read())
        done, _ = await asyncio.wait({first}, timeout=0.5)
        assert not done, "HTTP/2 holds the third Stream in the client until a slot frees"
        await calls[0].done_writing()
        await status(calls[0])
        await asyncio.wait_for(writing, 10)
        transcript = Transcript([await asyncio.wait_for(first, 10)])
        await read_until(third, transcript, {"third"})
        assert transcript.terminal("third").WhichOneof("kind") == "final"
        for call in (calls[1], third):
            call.cancel()


async def test_a_client_pinging_too_often_is_sent_goaway():
    pings = [
        ("grpc.keepalive_time_ms", 50),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.use_local_subchannel_pool", 1),
    ]
    async with live_server(grpc_config=GrpcConfig(min_ping_interval_s=5.0)) as (
        server,
        _,
        _channel,
    ):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=pings) as channel:
            call = await open_stream(pb_grpc.SloserveStub(channel))
            code, details = await status(call, timeout=20)
            assert code == grpc.StatusCode.UNAVAILABLE, (code, details)


async def test_an_idle_stream_ends_unavailable_naming_the_flag():
    async with live_server(grpc_config=GrpcConfig(stream_idle_s=0.3)) as (server, stub, _):
        call = stub.Stream()
        code, details = await status(call)
        assert code == grpc.StatusCode.UNAVAILABLE
        assert "--grpc-stream-idle-timeout" in details
        assert refusals(server, "grpc_stream_idle") == 1
        busy = stub.Stream()  # a live request keeps its stream open past the idle limit
        await busy.write(gen("slow", max_tokens=40))
        transcript = Transcript()
        await read_until(busy, transcript, {"slow"})
        assert transcript.terminal("slow").WhichOneof("kind") == "final"
        busy.cancel()
