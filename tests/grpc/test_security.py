"""Bearer-token auth and TLS, each on and off."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc
from sloserve.testing.live_server import Transcript, gen, live_server, read_until
from sloserve.testing.pki import self_signed

pytestmark = pytest.mark.timeout(60)
TOKEN = "s3cret-token"


async def test_auth_off_needs_no_token():
    async with live_server() as (_, stub, _):
        assert (await stub.Info(pb.InfoRequest())).model == "default"


@pytest.mark.parametrize(
    ("metadata", "needle"),
    [
        (None, "missing bearer token"),
        ((("authorization", "Bearer wrong"),), "wrong bearer token"),
        ((("authorization", TOKEN),), "wrong bearer token"),  # the scheme is required
    ],
)
async def test_auth_on_rejects_every_call_without_the_token(metadata, needle):
    async with live_server(auth_token=TOKEN) as (_, stub, channel):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Info(pb.InfoRequest(), metadata=metadata)
        assert (
            info.value.code() == grpc.StatusCode.UNAUTHENTICATED and needle in info.value.details()
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(
                pb.GenerateRequest(request_id="g", text="hi"), metadata=metadata
            ):
                pass
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        call = stub.Stream(metadata=metadata)
        # NOTE: the server may end the call before the client's write goes out; then the write
        # itself fails (grpc core reports INTERNAL for it) and the call's status tells why.
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await call.write(gen("s"))
        assert await call.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health probes are exempt: Kubernetes gRPC probes cannot send metadata.
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), metadata=metadata
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_auth_on_accepts_the_token():
    md = (("authorization", f"Bearer {TOKEN}"),)
    async with live_server(auth_token=TOKEN) as (_, stub, _):
        assert (await stub.Info(pb.InfoRequest(), metadata=md)).model == "default"
        call = stub.Stream(metadata=md)
        await call.write(gen("s", max_tokens=3))
        transcript = Transcript()
        await read_until(call, transcript, {"s"})
        assert transcript.terminal("s").final.completion_tokens == 3
        await call.done_writing()


async def test_tls_on(tmp_path):
    cert, key = self_signed(tmp_path)
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    async with live_server(tls_cert=str(cert), tls_key=str(key), credentials=creds) as (
        server,
        stub,
        _,
    ):
        msgs = [
            m
            async for m in stub.Generate(
                pb.GenerateRequest(request_id="t", text="hi", max_tokens=2)
            )
        ]
        assert msgs[-1].final.completion_tokens == 2
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await serving_pb2_grpc.SloserveStub(plain).Info(pb.InfoRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_tls_and_auth_together(tmp_path):
    cert, key = self_signed(tmp_path)
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    async with live_server(
        tls_cert=str(cert), tls_key=str(key), auth_token=TOKEN, credentials=creds
    ) as (_, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Info(pb.InfoRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info_ok = await stub.Info(
            pb.InfoRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
        assert info_ok.stats.kv_blocks_total > 0


async def test_unreadable_tls_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read --tls-key file"):
        async with live_server(tls_cert=str(tmp_path / "c.pem"), tls_key=str(tmp_path / "k.pem")):
            pass
