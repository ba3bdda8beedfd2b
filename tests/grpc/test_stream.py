"""The bidirectional Stream: multiplexing, cancellation, disconnects, per-request errors."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from sloserve.pb import serving_pb2 as pb
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.live_server import Transcript, cancel, gen, live_server, read_until, wait_for

pytestmark = pytest.mark.timeout(60)


def expected_tokens(text: str, n: int) -> list[int]:
    base = sum(text.encode())
    return [(base + i) % 200 + 32 for i in range(n)]


async def test_many_requests_multiplexed_with_one_terminal_each():
    async with live_server(FakeEngine(max_running=16, step_s=0.005)) as (_, stub, _):
        call = stub.Stream()
        ids = [f"r{i}" for i in range(8)]
        for i, rid in enumerate(ids):
            await call.write(gen(rid, text=f"prompt {i}", max_tokens=6 + i))
        transcript = Transcript()
        await read_until(call, transcript, set(ids))
        await call.done_writing()
        # the server ends the stream after the last terminal
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        for i, rid in enumerate(ids):
            final = transcript.terminal(rid).final
            assert final.finish_reason == pb.FINISH_REASON_LENGTH
            assert final.completion_tokens == 6 + i
            assert final.prompt_tokens == len(f"prompt {i}")
            assert transcript.tokens(rid) == expected_tokens(f"prompt {i}", 6 + i)
            assert "".join(c.text for c in transcript.chunks(rid)) == "".join(
                map(chr, expected_tokens(f"prompt {i}", 6 + i))
            )
        # interleaved: the sequence of chunk owners switches far more often than once per request
        owners = [
            m.chunk.request_id for m in transcript.messages if m.WhichOneof("kind") == "chunk"
        ]
        switches = sum(a != b for a, b in zip(owners, owners[1:], strict=False))
        assert switches > 2 * len(ids)
        # nothing arrives for a request after its terminal message
        for rid in ids:
            last = max(
                i
                for i, m in enumerate(transcript.messages)
                if getattr(m, m.WhichOneof("kind")).request_id == rid
            )
            assert transcript.messages[last].WhichOneof("kind") == "final"


async def test_cancel_one_leaves_the_others():
    engine = FakeEngine(step_s=0.005)
    async with live_server(engine) as (_, stub, _):
        call = stub.Stream()
        for rid in ("a", "b", "c"):
            await call.write(gen(rid, text=rid * 3, max_tokens=40))
        transcript = Transcript()
        while not transcript.chunks("b"):
            transcript.messages.append(await call.read())
        await call.write(cancel("b"))
        await read_until(call, transcript, {"a", "b", "c"})
        assert transcript.terminal("b").final.finish_reason == pb.FINISH_REASON_CANCELLED
        assert len(transcript.tokens("b")) < 40
        for rid in ("a", "c"):
            final = transcript.terminal(rid).final
            assert final.finish_reason == pb.FINISH_REASON_LENGTH
            assert transcript.tokens(rid) == expected_tokens(rid * 3, 40)
        # a cancel arriving after the request ended is ignored, not a second terminal
        await call.write(cancel("b"))
        await call.write(gen("d", max_tokens=2))
        await read_until(call, transcript, {"d"})
        assert len(transcript.terminals("b")) == 1
        await call.done_writing()


async def test_client_disconnect_aborts_everything_and_frees_blocks():
    engine = FakeEngine(step_s=0.01)
    async with live_server(engine) as (server, stub, _):
        info = await stub.Info(pb.InfoRequest())
        total = info.stats.kv_blocks_total
        assert info.stats.kv_blocks_free == total
        call = stub.Stream()
        for i in range(4):
            await call.write(gen(f"x{i}", max_tokens=100))
        await call.read()
        busy = await stub.Info(pb.InfoRequest())
        assert busy.stats.running == 4 and busy.stats.kv_blocks_free < total
        call.cancel()
        await wait_for(lambda: not engine.reqs)
        after = await stub.Info(pb.InfoRequest())
        assert after.stats.running == 0
        assert after.stats.kv_blocks_free == total
        await wait_for(lambda: server.frontend.inflight == 0)


def _sampling(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(**kw)


@pytest.mark.parametrize(
    ("message", "code", "reason", "needle"),
    [
        (
            gen("e1", text=""),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_argument",
            "prompt is empty",
        ),
        (
            pb.ClientMessage(
                generate=pb.GenerateRequest(request_id="e2", token_ids=pb.TokenIds(ids=[]))
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_argument",
            "prompt is empty",
        ),
        (
            gen("e3", text="y" * 300),
            grpc.StatusCode.INVALID_ARGUMENT,
            "context_length_exceeded",
            "context length",
        ),
        (
            gen("e4", sampling=_sampling(temperature=-1.0)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_argument",
            "temperature",
        ),
        (
            gen("e5", sampling=_sampling(top_p=1.5)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_argument",
            "top_p",
        ),
        (
            gen("e6", sampling=_sampling(stop=[""])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_argument",
            "stop",
        ),
        (
            gen("e7", max_tokens=0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_argument",
            "max_tokens",
        ),
        (
            gen("e8", max_tokens=5000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_argument",
            "limit of 4096",
        ),
        (gen("", max_tokens=2), grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", "request_id"),
        (
            gen("e9", slo=pb.Slo(ttft_s=-1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_argument",
            "ttft_s",
        ),
        (cancel("nope"), grpc.StatusCode.INVALID_ARGUMENT, "unknown_id", "no live request"),
        (
            pb.ClientMessage(),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_argument",
            "set generate or cancel",
        ),
    ],
)
async def test_bad_input_gets_its_status_and_the_stream_goes_on(message, code, reason, needle):
    async with live_server(FakeEngine(step_s=0.001)) as (_, stub, _):
        call = stub.Stream()
        await call.write(message)
        err = (await call.read()).error
        assert (err.code, err.reason) == (code.value[0], reason), err
        assert needle in err.message
        await call.write(gen("ok", max_tokens=3))
        transcript = Transcript()
        await read_until(call, transcript, {"ok"})
        assert transcript.terminal("ok").final.completion_tokens == 3
        await call.done_writing()


async def test_duplicate_id_is_refused_without_a_second_terminal_for_that_id():
    engine = FakeEngine(step_s=0.01)
    async with live_server(engine) as (_, stub, _):
        call = stub.Stream()
        await call.write(gen("same", max_tokens=20))
        await call.write(gen("same", max_tokens=20))
        transcript = Transcript()
        while not any(m.WhichOneof("kind") == "error" for m in transcript.messages):
            transcript.messages.append(await call.read())
        err = [m.error for m in transcript.messages if m.WhichOneof("kind") == "error"][0]
        assert (
            err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and err.reason == "duplicate_id"
        )
        # the message names the id
        assert err.request_id == "" and "'same' is already live" in err.message
        await read_until(call, transcript, {"same"})
        # the live request is unaffected, and a client tracking by id sees exactly one terminal for it
        assert transcript.terminal("same").final.completion_tokens == 20
        assert len(transcript.tokens("same")) == 20
        # once it has ended, the id may be used again: a new request with its own terminal
        await call.write(gen("same", max_tokens=2))
        again = Transcript()
        await read_until(call, again, {"same"})
        assert again.terminal("same").final.completion_tokens == 2
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF


async def test_cancel_of_an_unknown_id_is_answered_without_that_id():
    async with live_server(FakeEngine(step_s=0.001)) as (_, stub, _):
        call = stub.Stream()
        await call.write(cancel("ghost"))
        err = (await call.read()).error
        assert (err.request_id, err.reason) == ("", "unknown_id") and "'ghost'" in err.message
        await call.done_writing()


async def test_refused_admission_is_resource_exhausted_with_reason():
    async with live_server(FakeEngine(max_running=2, step_s=0.01)) as (_, stub, _):
        call = stub.Stream()
        for rid in ("a", "b", "c"):
            await call.write(gen(rid, max_tokens=10))
        transcript = Transcript()
        await read_until(call, transcript, {"a", "b", "c"})
        err = transcript.terminal("c").error
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert err.reason == "queue_full" and "reason: queue_full" in err.message
        assert transcript.terminal("a").final.completion_tokens == 10
        await call.done_writing()


async def test_draining_refuses_new_requests_with_unavailable():
    engine = FakeEngine(step_s=0.01)
    async with live_server(engine) as (server, stub, _):
        call = stub.Stream()
        await call.write(gen("before", max_tokens=15))
        first = await call.read()
        assert first.chunk.request_id == "before"
        server.frontend.start_draining()
        await call.write(gen("after", max_tokens=3))
        transcript = Transcript(messages=[first])
        await read_until(call, transcript, {"before", "after"})
        err = transcript.terminal("after").error
        assert err.code == grpc.StatusCode.UNAVAILABLE.value[0] and err.reason == "draining"
        assert transcript.terminal("before").final.completion_tokens == 15
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(pb.GenerateRequest(request_id="g", text="hi")):
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        await call.done_writing()


async def test_grpc_deadline_becomes_the_e2e_slo():
    engine = FakeEngine(step_s=0.001)
    async with live_server(engine) as (_, stub, _):
        call = stub.Stream(timeout=30)
        await call.write(gen("d", max_tokens=2))
        await call.write(gen("explicit", max_tokens=2, slo=pb.Slo(e2e_s=5.0, ttft_s=1.0)))
        await read_until(call, Transcript(), {"d", "explicit"})
        await call.done_writing()
        slos = {rid.split(":", 1)[1]: slo for rid, slo in engine.slos.items()}
        # within 10%: the server measures the deadline on its own clock
        assert 0 < slos["d"].e2e_s <= 30 * 1.1 and slos["d"].ttft_s is None
        assert (slos["explicit"].e2e_s, slos["explicit"].ttft_s) == (5.0, 1.0)
        # without a deadline and without an SLO the engine gets None
        call2 = stub.Stream()
        await call2.write(gen("none", max_tokens=1))
        await read_until(call2, Transcript(), {"none"})
        await call2.done_writing()
        assert [s for r, s in engine.slos.items() if r.endswith(":none")] == [None]


async def test_same_client_ids_on_two_streams_do_not_collide():
    engine = FakeEngine(step_s=0.002)
    async with live_server(engine) as (_, stub, _):
        calls = [stub.Stream(), stub.Stream()]
        for call in calls:
            await call.write(gen("same", max_tokens=5))
        transcripts = [Transcript(), Transcript()]
        await asyncio.gather(
            *(read_until(c, t, {"same"}) for c, t in zip(calls, transcripts, strict=True))
        )
        for t in transcripts:
            assert t.terminal("same").final.completion_tokens == 5
        for call in calls:
            await call.done_writing()


async def test_requests_before_the_model_is_ready_are_unavailable():
    engine = FakeEngine()
    async with live_server(engine, start_engine=False) as (_, stub, _):
        call = stub.Stream()
        await call.write(gen("early"))
        err = (await call.read()).error
        assert err.code == grpc.StatusCode.UNAVAILABLE.value[0] and err.reason == "not_ready"
        await call.done_writing()


async def test_failures_after_queueing_map_to_statuses():
    engine = FakeEngine(step_s=0.002)
    engine.late_failures = {
        "late": ("queue_timeout", "waited 30 s in the queue"),
        "past": ("deadline_passed", "the e2e deadline passed while queued"),
        "boom": (None, "CUDA error: device-side assert"),
    }
    async with live_server(engine) as (_, stub, _):
        call = stub.Stream()
        for rid in ("late", "past", "boom"):
            await call.write(gen(rid, text=rid))
        await call.write(gen("fine", max_tokens=3))
        transcript = Transcript()
        await read_until(call, transcript, {"late", "past", "boom", "fine"})
        late, past, boom = (transcript.terminal(r).error for r in ("late", "past", "boom"))
        assert (late.code, late.reason) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
            "queue_timeout",
        )
        assert "waited 30 s" in late.message
        assert (past.code, past.reason) == (
            grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
            "deadline_passed",
        )
        assert (boom.code, boom.reason) == (grpc.StatusCode.INTERNAL.value[0], "internal")
        assert "device-side assert" in boom.message
        assert transcript.terminal("fine").final.completion_tokens == 3
        await call.done_writing()
