"""A request's priority reaches the engine from both edges (gRPC Stream and Generate, HTTP), and
Info carries the new fields (kv_block_bytes, the peak-block and TTFT-prediction stats)."""

from __future__ import annotations

import contextlib

import grpc
import httpx
import pytest
from sloserve.config import CacheConfig, SchedulerConfig, ServerConfig, SloserveConfig
from sloserve.engine import AsyncEngine
from sloserve.frontend import ServerState
from sloserve.frontend.lifecycle import Lifecycle
from sloserve.grpc.convert import from_pb, info_pb, stats_pb
from sloserve.grpc.server import SloserveServer
from sloserve.http.config import HttpConfig
from sloserve.http.server import HttpServer
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.live_server import Transcript, gen, live_server, read_until, wait_for

from tests.engine.fakes import FakeRunner

pytestmark = pytest.mark.timeout(60)
BODY = {"prompt": "hello", "max_tokens": 3, "temperature": 0}


@contextlib.asynccontextmanager
async def edges(engine):
    """Both edges over one Lifecycle (as `sloserve serve` builds them): a gRPC stub and an HTTP client."""
    config = SloserveConfig(
        cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(max_batch=8, admission_control=False),
        server=ServerConfig(port=0, metrics_port=None),
    )
    lifecycle = Lifecycle(config, engine, watchdog_interval_s=0.02)
    grpc_server = SloserveServer(config, engine, lifecycle=lifecycle)
    http_server = HttpServer(lifecycle, HttpConfig(port=0))
    await grpc_server.start()
    await http_server.start()
    lifecycle.start()
    await wait_for(lambda: lifecycle.ready)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_server.port}")
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{http_server.port}", timeout=30
        ) as client:
            yield pb_grpc.SloserveStub(channel), client
    finally:
        await channel.close()
        await lifecycle.stop()


async def _send_all(stub: pb_grpc.SloserveStub, http: httpx.AsyncClient) -> None:
    """One request per way in, each with its own priority (and one leaving it out: 0)."""
    call = stub.Stream()
    await call.write(gen("stream", max_tokens=3, priority=-7))
    await call.write(gen("stream-default", max_tokens=3))
    transcript = Transcript()
    await read_until(call, transcript, {"stream", "stream-default"})
    await call.done_writing()
    assert transcript.terminal("stream").WhichOneof("kind") == "final"
    unary = [
        m
        async for m in stub.Generate(
            pb.GenerateRequest(request_id="unary", text="hi", max_tokens=2, priority=2**31 - 1)
        )
    ]
    assert unary[-1].WhichOneof("kind") == "final"
    reply = await http.post(
        "/v1/completions", json={**BODY, "priority": 5}, headers={"x-request-id": "http"}
    )
    assert reply.status_code == 200, reply.text
    reply = await http.post("/v1/completions", json=BODY, headers={"x-request-id": "http-default"})
    assert reply.status_code == 200, reply.text


EXPECTED = {"stream": -7, "stream-default": 0, "unary": 2**31 - 1, "http": 5, "http-default": 0}


async def test_priority_reaches_the_engine_client_from_every_edge():
    engine = FakeEngine()
    async with edges(engine) as (stub, http):
        await _send_all(stub, http)
    assert {rid.split(":", 1)[1]: p for rid, p in engine.priorities.items()} == EXPECTED


async def test_priority_reaches_the_schedulers_request_object():
    runner = FakeRunner(num_blocks=64, block_size=4, max_model_len=256, vocab=(97, 123))
    runner.vocab_size = 260
    config = SloserveConfig(
        cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(max_batch=8, admission_control=False),
        server=ServerConfig(port=0, metrics_port=None),
    )
    engine = AsyncEngine(config, runner=runner)
    seen: dict[str, int] = {}
    async with edges(engine) as (stub, http):
        scheduler = engine.scheduler
        add = scheduler.add_request

        def spy(*args, **kw):
            req = add(*args, **kw)
            seen[req.request_id.split(":", 1)[1]] = req.priority
            return req

        scheduler.add_request = spy
        await _send_all(stub, http)
    assert seen == EXPECTED


async def test_a_priority_outside_int32_is_refused_over_http_like_the_proto_would():
    engine = FakeEngine()
    async with edges(engine) as (_, http):
        for bad in (2**31, -(2**31) - 1, 2**70):
            reply = await http.post("/v1/completions", json={**BODY, "priority": bad})
            assert reply.status_code == 400 and "priority" in reply.json()["error"]["message"]
        reply = await http.post("/v1/completions", json={**BODY, "priority": "high"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "priority"
    assert not engine.priorities


def test_from_pb_reads_priority_and_defaults_to_zero():
    req = pb.GenerateRequest(request_id="a", text="x", priority=-3)
    assert from_pb(req, default_max_tokens=8).priority == -3
    assert from_pb(pb.GenerateRequest(request_id="a", text="x"), default_max_tokens=8).priority == 0


def test_info_carries_kv_block_bytes_and_the_new_stats():
    from sloserve.engine.outputs import EngineStats

    stats = EngineStats(
        kv_blocks_total=10,
        kv_blocks_peak=7,
        ttft_predictions=3,
        ttft_prediction_error_p50_s=-0.25,
        ttft_prediction_error_p90_s=0.5,
    )
    info = info_pb(
        "m",
        {"kv_block_bytes": 32768, "block_size": 16},
        stats,
        ServerState.SERVING,
        version="v",
        max_prompt_tokens=None,
        max_tokens_limit=64,
    )
    assert info.kv_block_bytes == 32768
    assert (info.stats.kv_blocks_peak, info.stats.ttft_predictions) == (7, 3)
    assert (info.stats.ttft_prediction_error_p50_s, info.stats.ttft_prediction_error_p90_s) == (
        -0.25,
        0.5,
    )
    assert (
        info_pb(
            "m",
            {},
            EngineStats(),
            ServerState.LOADING,
            version="v",
            max_prompt_tokens=None,
            max_tokens_limit=64,
        ).kv_block_bytes
        == 0
    )
    # every EngineStats field but the refusals map is copied by name
    names = {f for f in EngineStats.__slots__ if f != "refusals"}
    assert {f.name for f in stats_pb(stats).DESCRIPTOR.fields} - {"refusals"} == names


async def test_info_rpc_reports_kv_block_bytes_from_the_engines_model_info():
    engine = FakeEngine()
    engine.model_info["kv_block_bytes"] = 4096
    engine._stats.kv_blocks_peak = 9
    async with live_server(engine) as (_, stub, _channel):
        info = await stub.Info(pb.InfoRequest())
    assert info.kv_block_bytes == 4096 and info.stats.kv_blocks_peak == 9
