"""Generate, Info, health, reflection, metrics, drain and the exception interceptor."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from sloserve.grpc.interceptors import end_call
from sloserve.grpc.server import SERVICE_NAME
from sloserve.pb import serving_pb2 as pb
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.live_server import Transcript, gen, live_server, read_until, wait_for

pytestmark = pytest.mark.timeout(60)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_generate_streams_chunks_then_one_final():
    async with live_server(FakeEngine(step_s=0.001)) as (_, stub, _):
        msgs = [
            m
            async for m in stub.Generate(
                pb.GenerateRequest(request_id="g", text="abc", max_tokens=5)
            )
        ]
        kinds = [m.WhichOneof("kind") for m in msgs]
        assert kinds == ["chunk"] * 5 + ["final"]
        assert msgs[-1].final.completion_tokens == 5 and msgs[-1].final.prompt_tokens == 3
        assert msgs[-1].final.e2e_s >= msgs[-1].final.ttft_s > 0


@pytest.mark.parametrize(
    ("request_kw", "code", "needle"),
    [
        ({"text": ""}, grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        ({"text": "hi", "max_tokens": 9999}, grpc.StatusCode.INVALID_ARGUMENT, "limit of 4096"),
    ],
)
async def test_generate_errors_are_statuses(request_kw, code, needle):
    async with live_server() as (_, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(pb.GenerateRequest(request_id="g", **request_kw)):
                pass
        assert info.value.code() == code and needle in info.value.details()


async def test_generate_refused_is_resource_exhausted():
    engine = FakeEngine(max_running=1, step_s=0.01)
    async with live_server(engine) as (_, stub, _):
        first = stub.Generate(pb.GenerateRequest(request_id="a", text="hi", max_tokens=50))
        await first.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(pb.GenerateRequest(request_id="b", text="hi")):
                pass
        assert (
            info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "queue_full" in info.value.details()
        )
        first.cancel()
        await wait_for(lambda: not engine.reqs)  # the cancelled Generate freed its blocks


async def test_service_prompt_limit_is_invalid_argument():
    async with live_server(max_prompt_tokens=4) as (_, stub, _):
        call = stub.Stream()
        await call.write(gen("long", text="12345"))
        err = (await call.read()).error
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "5 tokens, over this server's limit of 4" in err.message
        await call.done_writing()


async def test_info_reports_model_limits_and_stats():
    async with live_server(FakeEngine(num_blocks=32, block_size=8, max_model_len=128)) as (
        _,
        stub,
        _,
    ):
        info = await stub.Info(pb.InfoRequest())
        assert (info.model, info.architecture, info.max_model_len, info.block_size) == (
            "default",
            "FakeForCausalLM",
            128,
            8,
        )
        assert info.max_prompt_tokens == 127 and info.max_tokens_limit == 4096 and info.version
        assert info.stats.kv_blocks_total == info.stats.kv_blocks_free == 32


async def test_exceptions_become_internal_status():
    engine = FakeEngine()

    def broken():
        raise RuntimeError("stats exploded")

    engine.stats = broken
    async with live_server(engine) as (_, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Info(pb.InfoRequest())
        assert (
            info.value.code() == grpc.StatusCode.INTERNAL
            and "stats exploded" in info.value.details()
        )


async def test_health_follows_loading_and_a_stuck_loop():
    engine = FakeEngine(start_delay_s=0.3)
    async with live_server(engine, start_engine=False) as (server, _, channel):
        health = health_pb2_grpc.HealthStub(channel)

        async def status(service: str) -> int:
            return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

        assert await status("") == SERVING
        assert await status(SERVICE_NAME) == NOT_SERVING  # not loaded yet
        loading = asyncio.create_task(engine.start())
        seen = []
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        async for resp in watch:
            seen.append(resp.status)
            if resp.status == SERVING:
                break
        watch.cancel()
        await loading
        assert seen[0] == NOT_SERVING and seen[-1] == SERVING
        engine.alive = False  # the loop stops making progress
        await wait_until_status(status, SERVICE_NAME, NOT_SERVING)
        assert await status("") == SERVING  # stuck is not dead: liveness stays up
        engine.alive = True
        await wait_until_status(status, SERVICE_NAME, SERVING)
        engine.dead_reason = "loop crashed: boom"
        await asyncio.wait_for(server.dead.wait(), 5)
        assert await status("") == NOT_SERVING and await status(SERVICE_NAME) == NOT_SERVING


async def wait_until_status(status, service: str, want: int) -> None:
    for _ in range(500):
        if await status(service) == want:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{service!r} never became {want}")


async def test_reflection_lists_the_service():
    async with live_server() as (_, _, channel):
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        resp = await call.read()
        names = {s.name for s in resp.list_services_response.service}
        assert {"sloserve.v1.Sloserve", "grpc.health.v1.Health"} <= names
        await call.write(
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="sloserve.v1.Sloserve")
        )
        resp = await call.read()
        assert resp.file_descriptor_response.file_descriptor_proto
        await call.done_writing()


async def test_metrics_page_parses_and_counts():
    async with live_server(FakeEngine(max_running=2, step_s=0.001), metrics_port=0) as (
        server,
        stub,
        _,
    ):
        call = stub.Stream()
        for rid in ("a", "b", "c"):
            await call.write(gen(rid, max_tokens=4))
        await call.write(gen("bad", text=""))
        await read_until(call, Transcript(), {"a", "b", "c", "bad"})
        await call.done_writing()
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(url, timeout=5).read().decode()
        )
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(s.labels["model_name"] == "default" for f in families.values() for s in f.samples)
    samples = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert samples[("sloserve_requests_total", (("outcome", "length"),))] == 2
    assert samples[("sloserve_requests_total", (("outcome", "resource_exhausted"),))] == 1
    assert samples[("sloserve_requests_total", (("outcome", "invalid_argument"),))] == 1
    assert samples[("sloserve_refusals_total", (("reason", "queue_full"),))] == 1
    assert samples[("sloserve_ttft_seconds_count", ())] == 2
    assert samples[("sloserve_tpot_seconds_count", ())] == 2
    assert samples[("sloserve_e2e_seconds_count", ())] == 2
    for name in (
        "sloserve_waiting_requests",
        "sloserve_running_requests",
        "sloserve_kv_blocks_in_use",
        "sloserve_prefix_hit_rate",
        "sloserve_preemptions",
    ):
        assert name in families, name
    assert samples[("sloserve_kv_blocks_in_use", ())] == 0


async def test_drain_finishes_in_flight_and_refuses_new():
    engine = FakeEngine(step_s=0.01)
    async with live_server(engine) as (server, stub, channel):
        call = stub.Stream()
        for rid in ("a", "b"):
            await call.write(gen(rid, max_tokens=30))
        transcript = Transcript(messages=[await call.read()])
        drain = asyncio.create_task(server.drain(grace_s=10))
        await wait_for(lambda: server.frontend.draining)
        health = health_pb2_grpc.HealthStub(channel)
        resp = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert resp.status == NOT_SERVING
        await call.write(gen("late", max_tokens=2))
        await read_until(call, transcript, {"a", "b", "late"})
        assert transcript.terminal("late").error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        for rid in ("a", "b"):
            assert transcript.terminal(rid).final.completion_tokens == 30
        assert await drain is True
        assert engine.stopped


async def test_drain_past_grace_cancels_the_rest():
    engine = FakeEngine(step_s=0.05)
    async with live_server(engine) as (server, stub, _):
        call = stub.Stream()
        await call.write(gen("slow", max_tokens=200))
        await call.read()
        assert await server.drain(grace_s=0.2) is False
        await wait_for(lambda: not engine.reqs)
        transcript = Transcript()
        # not dropped silently: a RequestError, then the end
        await read_until(call, transcript, {"slow"})
        err = transcript.terminal("slow").error
        assert err.code == grpc.StatusCode.UNAVAILABLE.value[0] and err.reason == "shutdown", err
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK


async def test_after_the_drain_an_idle_stream_refuses_late_requests_until_its_client_closes_it():
    engine = FakeEngine(step_s=0.002)
    async with live_server(engine) as (server, stub, _):
        call = stub.Stream()
        await call.write(gen("quick", max_tokens=2))
        transcript = Transcript()
        await read_until(call, transcript, {"quick"})
        server.frontend.start_draining()
        assert await server.frontend.wait_idle(1.0)
        closed = asyncio.create_task(server.service.wait_streams_closed(10.0))
        await call.write(gen("late", max_tokens=2))  # the stream is still open: a clear refusal
        await read_until(call, transcript, {"late"})
        assert transcript.terminal("late").error.reason == "draining"
        assert not closed.done()
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await closed is True


async def test_grpc_deadline_ends_the_call_and_frees_the_request():
    engine = FakeEngine(step_s=0.01)
    async with live_server(engine) as (_, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(
                pb.GenerateRequest(request_id="slow", text="hi", max_tokens=200), timeout=0.3
            ):
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        (slo,) = engine.slos.values()
        # The deadline became the request's e2e objective (within 10%: the server measures it on its own clock).
        assert 0 < slo.e2e_s <= 0.3 * 1.1
        await wait_for(lambda: not engine.reqs)  # and its blocks were freed when the call ended
        assert engine.stats().kv_blocks_free == engine.num_blocks


async def test_generate_failure_after_queueing_is_its_status(caplog):
    engine = FakeEngine(step_s=0.002)
    engine.late_failures = {"late": ("queue_timeout", "waited 30 s in the queue")}
    async with live_server(engine) as (server, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(pb.GenerateRequest(request_id="g", text="late")):
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details() == "waited 30 s in the queue (reason: queue_timeout)"
        counts = {
            s.labels["outcome"]: s.value
            for m in server.metrics.registry.collect()
            if m.name == "sloserve_requests"
            for s in m.samples
            if s.name.endswith("_total")
        }
        assert counts == {"resource_exhausted": 1.0}
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


class _EndedContext:
    """A servicer context whose call is already over: abort cannot send anything."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.aborts = 0

    async def abort(self, code, message):
        self.aborts += 1
        raise self.error


async def test_end_call_is_quiet_when_the_call_is_already_over():
    # what grpc raises after a passed deadline
    ended = _EndedContext(RuntimeError('Failed "execute_batch"'))
    await end_call(ended, grpc.StatusCode.DEADLINE_EXCEEDED, "too late")
    assert ended.aborts == 1
    sent = _EndedContext(grpc.aio.AbortError())  # the status went out: the handler must stop
    with pytest.raises(grpc.aio.AbortError):
        await end_call(sent, grpc.StatusCode.INVALID_ARGUMENT, "bad")
