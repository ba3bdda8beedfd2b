"""The front end without any transport: plain requests in, plain events out, failures as FailureCodes."""

from __future__ import annotations

import asyncio
import time

import pytest
from sloserve.config import ServerConfig, SloserveConfig
from sloserve.engine.outputs import RequestOutput
from sloserve.engine.stream import RequestStream
from sloserve.frontend import (
    Failure,
    FailureCode,
    Finished,
    Frontend,
    Metrics,
    ParsedRequest,
    RequestFailed,
    RequestHandle,
    Tokens,
)
from sloserve.sampling_params import SamplingParams
from sloserve.testing.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(30)


async def _started(engine: FakeEngine | None = None, **server_kw) -> Frontend:
    engine = engine or FakeEngine(step_s=0.001)
    await engine.start()
    return Frontend(engine, SloserveConfig(server=ServerConfig(**server_kw)), Metrics(engine.stats))


async def _events(frontend: Frontend, parsed: ParsedRequest, engine_id: str = "r") -> list:
    frontend.check(parsed)
    return [e async for e in frontend.run(RequestHandle(engine_id, time.monotonic()), parsed)]


async def test_a_request_yields_tokens_then_one_finished_and_is_accounted():
    frontend = await _started()
    events = await _events(frontend, ParsedRequest("abc", SamplingParams(max_tokens=3)))
    assert [type(e) for e in events] == [Tokens, Tokens, Tokens, Finished]
    done = events[-1]
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == ("length", 3, 3)
    assert events[0].time_s == done.ttft_s and events[-2].time_s == done.e2e_s
    assert frontend.inflight == 0 and not frontend.engine.reqs


@pytest.mark.parametrize(
    ("parsed", "needle"),
    [
        (ParsedRequest("", SamplingParams()), "prompt is empty"),
        (ParsedRequest([], SamplingParams()), "prompt is empty"),
        (ParsedRequest("hi", SamplingParams(max_tokens=5000)), "limit of 4096"),
        (
            ParsedRequest([1, 2, 3, 4, 5], SamplingParams()),
            "5 tokens, over this server's limit of 4",
        ),
    ],
)
async def test_checks_run_once_before_tokenizing(parsed, needle):
    frontend = await _started(max_prompt_tokens=4)
    with pytest.raises(Exception) as info:
        frontend.check(parsed)
    failure = frontend.failure(info.value)
    assert failure.code == FailureCode.INVALID_ARGUMENT and needle in failure.message


async def test_not_ready_and_draining_are_unavailable():
    engine = FakeEngine()
    frontend = Frontend(engine, SloserveConfig())
    with pytest.raises(RequestFailed) as info:
        frontend.check(ParsedRequest("hi", SamplingParams()))
    assert (info.value.code, info.value.reason) == (FailureCode.UNAVAILABLE, "not_ready")
    await engine.start()
    frontend.start_draining()
    with pytest.raises(RequestFailed) as info:
        frontend.check(ParsedRequest("hi", SamplingParams()))
    assert info.value.reason == "draining"


class _ErrorEngine(FakeEngine):
    """Answers every request with one final 'error' output, as an engine process reports refusals."""

    def __init__(self, out: RequestOutput) -> None:
        super().__init__()
        self.out = out

    def add_request(self, new):
        stream = RequestStream(new.request_id, asyncio.get_running_loop())
        stream.put(self.out)
        return stream


@pytest.mark.parametrize(
    ("out", "code", "reason"),
    [
        (
            RequestOutput(
                "r",
                [],
                "",
                True,
                "error",
                "token id 99999 is outside the vocabulary",
                error_kind="invalid",
            ),
            FailureCode.INVALID_ARGUMENT,
            "invalid_argument",
        ),
        (
            RequestOutput(
                "r",
                [],
                "",
                True,
                "error",
                "queue is full",
                refusal_reason="queue_full",
                error_kind="refused",
            ),
            FailureCode.RESOURCE_EXHAUSTED,
            "queue_full",
        ),
        (
            RequestOutput(
                "r",
                [],
                "",
                True,
                "error",
                "too late",
                refusal_reason="deadline_passed",
                error_kind="refused",
            ),
            FailureCode.DEADLINE_EXCEEDED,
            "deadline_passed",
        ),
        (RequestOutput("r", [], "", True, "error", "CUDA error"), FailureCode.INTERNAL, "internal"),
    ],
)
async def test_an_asynchronous_refusal_is_the_same_failure_as_a_raised_one(out, code, reason):
    frontend = await _started(_ErrorEngine(out))
    (event,) = await _events(frontend, ParsedRequest([1, 2], SamplingParams(max_tokens=2)))
    assert isinstance(event, Failure) and (event.code, event.reason) == (code, reason)
    assert frontend.inflight == 0


async def test_a_raised_refusal_is_resource_exhausted():
    frontend = await _started(FakeEngine(max_running=0))
    (event,) = await _events(frontend, ParsedRequest([1, 2], SamplingParams(max_tokens=2)))
    assert (event.code, event.reason) == (FailureCode.RESOURCE_EXHAUSTED, "queue_full")
    assert frontend.inflight == 0


async def test_closing_the_events_early_aborts_the_request_in_the_engine():
    engine = FakeEngine(step_s=0.01)
    frontend = await _started(engine)
    events = frontend.run(
        RequestHandle("x", time.monotonic()), ParsedRequest("hi", SamplingParams(max_tokens=50))
    )
    assert isinstance(await anext(events), Tokens)
    assert frontend.inflight == 1 and "x" in engine.reqs
    await events.aclose()
    assert frontend.inflight == 0 and "x" not in engine.reqs
