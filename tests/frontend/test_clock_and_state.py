"""One clock (every time counts from the arrival stamp), Info's server state, failure codes at the edge."""

from __future__ import annotations

import time

import grpc
import pytest
from sloserve.frontend import FailureCode
from sloserve.grpc.convert import STATUS
from sloserve.pb import serving_pb2 as pb
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.live_server import Transcript, gen, live_server, read_until, wait_for
from sloserve.testing.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(60)
SLOW_S = 0.2


class SlowTokenizer(ByteTokenizer):
    """Tokenizing takes SLOW_S (in the front end's worker thread)."""

    def encode(self, text: str) -> list[int]:
        time.sleep(SLOW_S)
        return super().encode(text)


class TimedEngine(FakeEngine):
    """Records when each request reached add_request."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.added: dict[str, float] = {}

    def add_request(self, new):
        self.added[new.request_id] = time.monotonic()
        return super().add_request(new)


async def test_stream_times_count_from_the_arrival_stamp_not_from_admission():
    engine = TimedEngine(step_s=0.002)
    engine.tokenizer = SlowTokenizer()
    async with live_server(engine, metrics_port=0) as (server, stub, _):
        call = stub.Stream()
        await call.write(gen("slow", text="tokenize slowly", max_tokens=4))
        transcript = Transcript()
        await read_until(call, transcript, {"slow"})
        await call.done_writing()
        final = transcript.terminal("slow").final
        chunks = transcript.chunks("slow")
        # the engine got the edge's stamp, taken before tokenizing: deadlines count from it too
        (engine_id,) = engine.added
        assert engine.added[engine_id] - engine.arrivals[engine_id] >= SLOW_S
        # every time includes the tokenizing, and no chunk is later than the Final's end
        assert SLOW_S <= final.queue_s <= final.ttft_s <= final.e2e_s
        assert chunks[0].time_s == pytest.approx(final.ttft_s, abs=1e-9)
        assert chunks[-1].time_s <= final.e2e_s
        assert [c.time_s for c in chunks] == sorted(c.time_s for c in chunks)
        e2e = {
            s.name: s.value
            for m in server.metrics.registry.collect()
            if m.name == "sloserve_e2e_seconds"
            for s in m.samples
        }
        assert e2e["sloserve_e2e_seconds_count"] == 1 and e2e["sloserve_e2e_seconds_sum"] >= SLOW_S


async def test_generate_times_count_from_the_arrival_stamp():
    engine = TimedEngine(step_s=0.002)
    engine.tokenizer = SlowTokenizer()
    async with live_server(engine) as (_, stub, _):
        msgs = [
            m
            async for m in stub.Generate(
                pb.GenerateRequest(request_id="g", text="slow", max_tokens=3)
            )
        ]
        chunks, final = [m.chunk for m in msgs[:-1]], msgs[-1].final
        assert len(chunks) == 3 and SLOW_S <= final.ttft_s <= final.e2e_s
        assert chunks[-1].time_s <= final.e2e_s
        (engine_id,) = engine.added
        assert engine.added[engine_id] - engine.arrivals[engine_id] >= SLOW_S


async def test_the_slo_deadline_counts_from_arrival():
    engine = TimedEngine(step_s=0.002)
    engine.tokenizer = SlowTokenizer()
    async with live_server(engine) as (_, stub, _):
        before = time.monotonic()
        msgs = [
            m
            async for m in stub.Generate(
                pb.GenerateRequest(request_id="d", text="x", max_tokens=1), timeout=30
            )
        ]
        assert msgs[-1].final.completion_tokens == 1
    (engine_id,) = engine.added
    # e2e = the time left on the call when it arrived, anchored at that same arrival stamp
    assert before <= engine.arrivals[engine_id] <= engine.added[engine_id] - SLOW_S
    # gRPC rounds timeouts up; its clock is coarse under load
    assert 25 < engine.slos[engine_id].e2e_s <= 31


async def test_info_says_loading_until_the_model_is_loaded_then_serving_then_draining():
    engine = FakeEngine(start_delay_s=0.2)
    async with live_server(engine, start_engine=False) as (server, stub, _):
        info = await stub.Info(pb.InfoRequest())
        assert info.state == pb.SERVER_STATE_LOADING
        await engine.start()
        assert (await stub.Info(pb.InfoRequest())).state == pb.SERVER_STATE_SERVING
        server.frontend.start_draining()
        assert (await stub.Info(pb.InfoRequest())).state == pb.SERVER_STATE_DRAINING
        engine.dead_reason = "loop crashed"
        await wait_for(server.dead.is_set)
        assert (await stub.Info(pb.InfoRequest())).state == pb.SERVER_STATE_ENGINE_DEAD


def test_every_failure_code_has_one_grpc_status():
    assert set(STATUS) == set(FailureCode)
    assert {code: STATUS[code] for code in FailureCode} == {
        FailureCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
        FailureCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
        FailureCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
        FailureCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
        FailureCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
        FailureCode.INTERNAL: grpc.StatusCode.INTERNAL,
    }
