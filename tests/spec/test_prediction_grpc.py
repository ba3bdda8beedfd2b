"""A `prediction` on the gRPC request, through the real engine and service with the toy runner:
verified as drafts, reported in Final, refused with INVALID_ARGUMENT when it cannot fit."""

from __future__ import annotations

import grpc
import pytest
from sloserve.config import CacheConfig, SchedulerConfig, ServerConfig, SloserveConfig
from sloserve.engine import AsyncEngine
from sloserve.grpc.server import SloserveServer
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.live_server import Transcript, gen, read_until, wait_for

from tests.engine.fakes import FakeRunner, reference_tokens

pytestmark = pytest.mark.timeout(60)
GREEDY = pb.SamplingParams(ignore_eos=True)


@pytest.fixture
async def served():
    runner = FakeRunner(num_blocks=128, block_size=4, max_model_len=64)
    runner.vocab_size = 260
    config = SloserveConfig(
        cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(max_batch=16, admission_control=False, num_speculative_tokens=8),
        server=ServerConfig(port=0, metrics_port=None),
    )
    engine = AsyncEngine(config, runner=runner)
    server = SloserveServer(config, engine, watchdog_interval_s=0.02)
    await server.start()
    await wait_for(lambda: engine.ready)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield runner, engine, pb_grpc.SloserveStub(channel)
    finally:
        await channel.close()
        await server.stop(grace_s=0)


async def test_a_prediction_as_token_ids_or_text_is_verified_and_reported(served):
    runner, engine, stub = served
    text = "rows 0 1 2"
    answer = reference_tokens(runner, list(text.encode()), 20)
    wrong = [t if i % 7 != 3 else 97 + (t - 96) % 26 for i, t in enumerate(answer)]
    call = stub.Stream()
    await call.write(
        gen(
            "ids",
            text=text,
            max_tokens=20,
            sampling=GREEDY,
            prediction_token_ids=pb.TokenIds(ids=answer),
        )
    )
    await call.write(
        gen(
            "text", text=text, max_tokens=20, sampling=GREEDY, prediction_text=bytes(wrong).decode()
        )
    )
    await call.write(gen("none", text=text, max_tokens=20, sampling=GREEDY))
    transcript = Transcript()
    await read_until(call, transcript, {"ids", "text", "none"})
    await call.done_writing()
    for rid in ("ids", "text", "none"):
        assert transcript.tokens(rid) == answer, rid
    exact = transcript.terminal("ids").final
    assert exact.accepted_prediction_tokens > 0 and exact.rejected_prediction_tokens == 0
    edited = transcript.terminal("text").final
    assert edited.accepted_prediction_tokens > 0 and edited.rejected_prediction_tokens > 0
    none = transcript.terminal("none").final
    assert (none.accepted_prediction_tokens, none.rejected_prediction_tokens) == (0, 0)
    assert engine.stats().spec_accepted_tokens_total == (
        exact.accepted_prediction_tokens + edited.accepted_prediction_tokens
    )


@pytest.mark.parametrize(
    ("prediction", "max_tokens", "says"),
    [([97] * 9, 8, "max_tokens"), ([97] * 50, 60, "context")],
)
async def test_a_prediction_that_cannot_fit_is_invalid_argument(
    served, prediction, max_tokens, says
):
    _, _, stub = served
    call = stub.Stream()
    await call.write(
        gen(
            "p",
            text="x" * 20,
            max_tokens=max_tokens,
            prediction_token_ids=pb.TokenIds(ids=prediction),
        )
    )
    transcript = Transcript()
    await read_until(call, transcript, {"p"})
    await call.done_writing()
    error = transcript.terminal("p").error
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert says in error.message
