"""Bytes that are not a valid request message: INVALID_ARGUMENT saying so, never UNKNOWN or a silent end."""

from __future__ import annotations

import grpc
import pytest
from sloserve.grpc.handlers import SERVICE, Undecodable, lenient_parser, method_handlers
from sloserve.pb import serving_pb2 as pb
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.live_server import gen, live_server, wait_for

pytestmark = pytest.mark.timeout(60)

GARBAGE = b"\xff\xff\xff"  # a field number 0 / truncated varint: never a valid message


def test_lenient_parser_returns_the_message_or_an_undecodable():
    parse = lenient_parser(pb.GenerateRequest)
    good = pb.GenerateRequest(request_id="x", text="hi")
    assert parse(good.SerializeToString()) == good
    bad = parse(GARBAGE)
    assert isinstance(bad, Undecodable) and bad.type_name == "sloserve.v1.GenerateRequest"
    assert bad.message.startswith("could not parse sloserve.v1.GenerateRequest: ")


def test_every_method_of_the_service_gets_a_handler_of_its_kind():
    class Servicer:
        async def Stream(self, it, context): ...
        async def Generate(self, request, context): ...
        async def Info(self, request, context): ...
        async def Score(self, request, context): ...
        async def LoadAdapter(self, request, context): ...
        async def UnloadAdapter(self, request, context): ...

    handlers = method_handlers(Servicer())
    assert set(handlers) == {m.name for m in SERVICE.methods}
    for method in SERVICE.methods:
        handler = handlers[method.name]
        assert (handler.request_streaming, handler.response_streaming) == (
            method.client_streaming,
            method.server_streaming,
        )
        assert isinstance(handler.request_deserializer(GARBAGE), Undecodable)


async def test_undecodable_generate_request_is_invalid_argument():
    async with live_server() as (_, _, channel):
        raw = channel.unary_stream(
            "/sloserve.v1.Sloserve/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pb.ServerMessage.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in raw(GARBAGE):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "could not parse sloserve.v1.GenerateRequest" in info.value.details()


async def test_undecodable_info_request_is_invalid_argument():
    async with live_server() as (_, _, channel):
        raw = channel.unary_unary(
            "/sloserve.v1.Sloserve/Info",
            request_serializer=lambda b: b,
            response_deserializer=pb.InfoResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(GARBAGE)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "could not parse sloserve.v1.InfoRequest" in info.value.details()


async def test_undecodable_bytes_mid_stream_end_live_requests_then_the_stream():
    engine = FakeEngine(step_s=0.005)
    async with live_server(engine) as (server, stub, channel):
        raw = channel.stream_stream(
            "/sloserve.v1.Sloserve/Stream",
            request_serializer=lambda b: b,
            response_deserializer=pb.ServerMessage.FromString,
        )
        call = raw()
        await call.write(gen("live", max_tokens=200).SerializeToString())
        first = await call.read()
        assert first.WhichOneof("kind") == "chunk" and first.chunk.request_id == "live"
        await call.write(GARBAGE)
        messages = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while (msg := await call.read()) is not grpc.aio.EOF:
                messages.append(msg)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "could not parse sloserve.v1.ClientMessage" in info.value.details()
        terminals = [m for m in messages if m.WhichOneof("kind") in ("final", "error")]
        assert len(terminals) == 1 and terminals[0].error.request_id == "live"
        assert terminals[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "stream broke" in terminals[0].error.message
        # its blocks are free
        await wait_for(lambda: not engine.reqs and server.frontend.inflight == 0)
        assert engine.stats().kv_blocks_free == engine.num_blocks
        # the server goes on serving other calls
        info_after = await stub.Info(pb.InfoRequest())
        assert info_after.stats.running == 0


async def test_undecodable_first_message_ends_the_stream_at_once():
    async with live_server() as (_, _, channel):
        raw = channel.stream_stream(
            "/sloserve.v1.Sloserve/Stream",
            request_serializer=lambda b: b,
            response_deserializer=pb.ServerMessage.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in raw(iter([GARBAGE])):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
