"""A client that vanishes mid-stream is an info-level event counted as `cancelled`: no ERROR line, no traceback."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from sloserve.config import GrpcConfig
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.live_server import gen, live_server, wait_for

pytestmark = pytest.mark.timeout(60)
# a connection of its own, so closing it is a disconnect
OWN = [("grpc.use_local_subchannel_pool", 1)]


def _cancelled(server) -> float:
    return (
        server.metrics.registry.get_sample_value(
            "sloserve_requests_total",
            {"model_name": server.metrics.model_name, "outcome": "cancelled"},
        )
        or 0.0
    )


@pytest.mark.parametrize("how", ["close_channel", "cancel_call", "close_while_not_reading"])
async def test_a_disconnect_mid_stream_logs_no_error_and_counts_cancelled(how, caplog):
    caplog.set_level(logging.INFO)
    engine = FakeEngine(step_s=0.005, max_running=8)
    async with live_server(engine, grpc_config=GrpcConfig(stream_stall_s=30.0)) as (
        server,
        _,
        _channel,
    ):
        for trial in range(3):
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=OWN)
            call = pb_grpc.SloserveStub(channel).Stream()
            ids = [f"{how}-{trial}-{i}" for i in range(4)]
            for rid in ids:
                await call.write(gen(rid, text="x" * 32, max_tokens=150))
            # answers pile up behind a client that reads nothing
            if how == "close_while_not_reading":
                for i in range(300):
                    await call.write(
                        pb.ClientMessage(cancel=pb.CancelRequest(request_id=f"{i:0100d}"))
                    )
                await asyncio.sleep(0.1)
            else:
                first = await call.read()
                assert first.WhichOneof("kind") == "chunk"
            if how == "cancel_call":
                call.cancel()
            await channel.close()
        await wait_for(lambda: _cancelled(server) >= 12 and not engine.stats().running, timeout=20)
        await wait_for(lambda: not server.service._sessions, timeout=20)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert not [r for r in caplog.records if r.exc_info], "a disconnect logged a traceback"


async def test_a_disconnect_mid_generate_logs_no_error(caplog):
    caplog.set_level(logging.INFO)
    engine = FakeEngine(step_s=0.005, max_running=8)
    async with live_server(engine) as (server, _, _channel):
        for trial in range(3):
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=OWN)
            call = pb_grpc.SloserveStub(channel).Generate(
                gen(f"g{trial}", text="x" * 32, max_tokens=150).generate
            )
            first = await call.read()
            assert first.WhichOneof("kind") == "chunk"
            if trial == 1:
                call.cancel()
            await channel.close()
        await wait_for(lambda: _cancelled(server) >= 3 and not engine.stats().running, timeout=20)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
