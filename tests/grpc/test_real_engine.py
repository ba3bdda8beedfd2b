"""The service over the real AsyncEngine (scheduler, block manager, loop thread) with the toy runner."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sloserve.config import CacheConfig, SchedulerConfig, ServerConfig, SloserveConfig
from sloserve.engine import AsyncEngine
from sloserve.grpc.server import SERVICE_NAME, SloserveServer
from sloserve.new_request import NewRequest
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.sampling_params import SamplingParams
from sloserve.testing.live_server import Transcript, cancel, gen, read_until, wait_for

from tests.engine.fakes import FakeRunner, reference_tokens

pytestmark = pytest.mark.timeout(60)


class SlowRunner(FakeRunner):
    """The toy runner with a pause per step, so requests are still running when we cancel."""

    step_s = 0.003

    def execute(self, out):
        time.sleep(self.step_s)
        return super().execute(out)


@pytest.fixture
async def served():
    runner = SlowRunner(num_blocks=128, block_size=4, max_model_len=256)
    runner.vocab_size = 260
    config = SloserveConfig(
        cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(max_batch=16, admission_control=False),
        server=ServerConfig(port=0, metrics_port=None),
    )
    engine = AsyncEngine(config, runner=runner)
    server = SloserveServer(config, engine, watchdog_interval_s=0.02)
    await server.start()
    await wait_for(lambda: engine.ready)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield runner, engine, server, pb_grpc.SloserveStub(channel)
    finally:
        await channel.close()
        await server.stop(grace_s=0)


async def test_multiplexed_outputs_match_the_model(served):
    runner, _, _, stub = served
    prompts = {f"r{i}": "abcdefgh"[: i + 2] * 3 for i in range(6)}
    call = stub.Stream()
    for rid, text in prompts.items():
        await call.write(
            gen(rid, text=text, max_tokens=12, sampling=pb.SamplingParams(ignore_eos=True))
        )
    transcript = Transcript()
    await read_until(call, transcript, set(prompts))
    await call.done_writing()
    for rid, text in prompts.items():
        want = reference_tokens(runner, list(text.encode()), 12)
        assert transcript.tokens(rid) == want
        final = transcript.terminal(rid).final
        assert (final.finish_reason, final.completion_tokens, final.prompt_tokens) == (
            pb.FINISH_REASON_LENGTH,
            12,
            len(text),
        )
        assert final.e2e_s >= final.ttft_s >= final.queue_s >= 0
    owners = [m.chunk.request_id for m in transcript.messages if m.WhichOneof("kind") == "chunk"]
    assert sum(a != b for a, b in zip(owners, owners[1:], strict=False)) > len(prompts)


async def test_text_prompts_tokenized_by_the_service_stream_what_the_engine_makes_of_the_text(
    served,
):
    """The service hands the engine token ids; text, tokens and prompt_tokens match the engine given text."""
    _, engine, _, stub = served
    text = "caf\u00e9 \u00e9t\u00e9"  # multi-byte characters: more tokens than characters
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    direct = [
        out
        async for out in engine.generate(
            NewRequest("direct", engine.tokenizer.encode(text), params)
        )
    ]
    call = stub.Stream()
    await call.write(
        gen("svc", text=text, max_tokens=10, sampling=pb.SamplingParams(ignore_eos=True))
    )
    transcript = Transcript()
    await read_until(call, transcript, {"svc"})
    await call.done_writing()
    final = transcript.terminal("svc").final
    assert final.prompt_tokens == direct[-1].num_prompt_tokens == len(text.encode())
    assert transcript.tokens("svc") == [t for out in direct for t in out.new_token_ids]
    assert "".join(c.text for c in transcript.chunks("svc")) == "".join(
        out.new_text for out in direct
    )


async def test_cancel_and_disconnect_free_every_block(served):
    _, engine, server, stub = served
    before = (await stub.Info(pb.InfoRequest())).stats
    call = stub.Stream()
    for rid in ("a", "b", "c"):
        await call.write(
            gen(rid, text=rid * 9, max_tokens=200, sampling=pb.SamplingParams(ignore_eos=True))
        )
    transcript = Transcript()
    while not all(transcript.chunks(r) for r in ("a", "b", "c")):
        transcript.messages.append(await call.read())
    busy = (await stub.Info(pb.InfoRequest())).stats
    assert busy.running == 3 and busy.kv_blocks_free < before.kv_blocks_free
    await call.write(cancel("b"))
    while not transcript.terminals("b"):
        transcript.messages.append(await call.read())
    assert transcript.terminal("b").final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert not transcript.terminals("a") and not transcript.terminals("c")  # the others go on
    call.cancel()  # the client goes away with two requests running
    await wait_for(lambda: engine.stats().running == 0 and engine.stats().waiting == 0)
    after = (await stub.Info(pb.InfoRequest())).stats
    assert after.kv_blocks_free == before.kv_blocks_free == after.kv_blocks_total
    await wait_for(lambda: server.frontend.inflight == 0)


async def test_engine_errors_reach_the_client(served):
    runner, _, _, stub = served
    call = stub.Stream()
    await call.write(
        pb.ClientMessage(
            generate=pb.GenerateRequest(request_id="oov", token_ids=pb.TokenIds(ids=[1, 2, 10**6]))
        )
    )
    await call.write(gen("long", text="z" * 300))
    await call.write(
        gen("ok", text="fine", max_tokens=3, sampling=pb.SamplingParams(ignore_eos=True))
    )
    transcript = Transcript()
    await read_until(call, transcript, {"long", "ok", "oov"})
    await call.done_writing()
    long = transcript.terminal("long").error
    assert (
        long.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        and "maximum context length is 256" in long.message
    ), long
    oov = transcript.terminal("oov").error
    assert (
        oov.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        and "outside the vocabulary" in oov.message
    )
    assert transcript.tokens("ok") == reference_tokens(runner, list(b"fine"), 3)


class BlockingRunner(FakeRunner):
    """Blocks inside execute() until `release` is set: a hung device."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.release = threading.Event()
        self.release.set()

    def execute(self, out):
        self.release.wait()
        return super().execute(out)


async def test_health_reacts_to_a_stuck_engine_loop():
    runner = BlockingRunner(num_blocks=64, block_size=4)
    config = SloserveConfig(
        cache=CacheConfig(block_size=4), server=ServerConfig(port=0, metrics_port=None)
    )
    engine = AsyncEngine(config, runner=runner, stuck_after_s=0.2)
    server = SloserveServer(config, engine, watchdog_interval_s=0.02)
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)

        async def ready() -> int:
            return (await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))).status

        try:
            await wait_for(lambda: engine.ready)
            await wait_status(ready, health_pb2.HealthCheckResponse.SERVING)
            runner.release.clear()  # the next step hangs
            call = pb_grpc.SloserveStub(channel).Stream()
            await call.write(gen("hang", max_tokens=4, sampling=pb.SamplingParams(ignore_eos=True)))
            await wait_status(ready, health_pb2.HealthCheckResponse.NOT_SERVING)
            runner.release.set()  # the device recovers
            await wait_status(ready, health_pb2.HealthCheckResponse.SERVING)
            transcript = Transcript()
            await read_until(call, transcript, {"hang"})
            assert transcript.terminal("hang").final.completion_tokens == 4
            await call.done_writing()
        finally:
            runner.release.set()
            await server.stop(grace_s=0)


async def wait_status(check, want: int) -> None:
    async def poll() -> None:
        while await check() != want:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), 10)
