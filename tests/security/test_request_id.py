"""request_id: too long or not printable ASCII is refused INVALID_ARGUMENT, and never echoed back."""

from __future__ import annotations

import grpc
import pytest
from sloserve.config import GrpcConfig
from sloserve.pb import serving_pb2 as pb
from sloserve.testing.live_server import Transcript, gen, live_server, read_until

from tests.security.helpers import refusals

pytestmark = pytest.mark.timeout(60)

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
HUGE = "x" * (4 * 1024 * 1024)  # 4 MiB: once echoed in each of 64 chunks, 256 MiB back


async def _answer(call, message: pb.ClientMessage) -> pb.ServerMessage:
    await call.write(message)
    reply = await call.read()
    assert reply is not grpc.aio.EOF
    return reply


@pytest.mark.parametrize(
    ("request_id", "limit"),
    [
        (HUGE, "request_id_length"),
        ("x" * 257, "request_id_length"),
        ("nul\x00id", "request_id_charset"),
        ("rlo\u202eid", "request_id_charset"),  # right-to-left override
        ("tab\tid", "request_id_charset"),
        ("café", "request_id_charset"),
    ],
)
async def test_a_bad_request_id_is_refused_without_echo(request_id, limit):
    async with live_server(max_message_bytes=8 * 1024 * 1024) as (server, stub, _):
        call = stub.Stream()
        for message in (
            gen(request_id, max_tokens=64),
            pb.ClientMessage(cancel=pb.CancelRequest(request_id=request_id)),
        ):
            reply = await _answer(call, message)
            assert reply.WhichOneof("kind") == "error"
            assert reply.error.code == INVALID
            assert reply.error.request_id == ""  # not echoed, not even in the message
            assert "request_id" in reply.error.message and request_id not in reply.error.message
            assert reply.ByteSize() < 400
        assert refusals(server, limit) == 2
        transcript = Transcript()  # the stream goes on serving good ids
        await call.write(gen("x" * 256, max_tokens=2))
        await read_until(call, transcript, {"x" * 256})
        assert transcript.terminal("x" * 256).WhichOneof("kind") == "final"
        await call.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # the unary Generate checks it too
            async for _ in stub.Generate(gen(request_id).generate):
                pass
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(refused.value.details()) < 400


async def test_the_length_limit_is_a_flag():
    async with live_server(grpc_config=GrpcConfig(max_request_id_length=8)) as (_, stub, _channel):
        call = stub.Stream()
        reply = await _answer(call, gen("123456789"))
        assert reply.error.code == INVALID and "--grpc-max-request-id-length" in reply.error.message
        transcript = Transcript()
        await call.write(gen("12345678", max_tokens=1))
        await read_until(call, transcript, {"12345678"})
        assert transcript.terminal("12345678").WhichOneof("kind") == "final"
        call.cancel()
