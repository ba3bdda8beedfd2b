"""Stop strings from hostile clients: the limits refuse too many or too long ones at the edge
(naming the flag), and the engine's matcher gives the naive search's answer with work per token
that does not grow with the number of strings."""

from __future__ import annotations

import random

import grpc
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sloserve.config import ServerConfig, SloserveConfig
from sloserve.engine.output_processor import OutputProcessor
from sloserve.engine.stop_strings import StopMatcher
from sloserve.frontend import Frontend, Metrics, ParsedRequest
from sloserve.frontend.failures import LimitExceeded
from sloserve.frontend.lifecycle import Lifecycle
from sloserve.grpc.server import SloserveServer
from sloserve.http.config import HttpConfig
from sloserve.http.server import HttpServer
from sloserve.new_request import NewRequest
from sloserve.pb import serving_pb2 as pb
from sloserve.sampling_params import SamplingParams
from sloserve.sched.request import Request, RequestStatus
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.live_server import gen, live_server, wait_for

pytestmark = pytest.mark.timeout(60)
VOCAB = [
    "a",
    "b",
    "ab",
    "ba",
    "aab",
    "c",
    "é",
    "bca",
    "",
]  # token id -> text; multi-char and empty tokens


# ---- the limits, in the front end and at both edges -------------------------------------------
@pytest.mark.parametrize(
    ("stop", "needle"),
    [
        (["x"] * 17, "stop has 17 strings, over this server's limit of 16 (--max-stop-strings)"),
        (
            ["y" * 257],
            "a stop string has 257 characters, over this server's limit of 256 (--max-stop-string-chars)",
        ),
    ],
)
async def test_the_front_end_refuses_past_the_default_limits(stop, needle):
    engine = FakeEngine()
    await engine.start()
    frontend = Frontend(engine, SloserveConfig(server=ServerConfig()), Metrics(engine.stats))
    with pytest.raises(LimitExceeded, match=needle.replace("(", r"\(").replace(")", r"\)")):
        frontend.check(ParsedRequest("hi", SamplingParams(stop=stop)))
    # at the limit: accepted
    frontend.check(ParsedRequest("hi", SamplingParams(stop=["z" * 256] * 16)))
    await engine.stop()


async def test_the_limits_follow_the_config():
    engine = FakeEngine()
    await engine.start()
    config = SloserveConfig(server=ServerConfig(max_stop_strings=0, max_stop_string_chars=3))
    frontend = Frontend(engine, config, Metrics(engine.stats))
    frontend.check(ParsedRequest("hi", SamplingParams()))
    with pytest.raises(LimitExceeded, match="limit of 0"):
        frontend.check(ParsedRequest("hi", SamplingParams(stop=["a"])))
    frontend.limits.max_stop_strings = 1
    with pytest.raises(LimitExceeded, match="4 characters, over this server's limit of 3"):
        frontend.check(ParsedRequest("hi", SamplingParams(stop=["abcd"])))
    await engine.stop()


@pytest.mark.parametrize("bad", [{"max_stop_strings": -1}, {"max_stop_string_chars": 0}])
def test_the_config_refuses_nonsense(bad):
    with pytest.raises(ValueError, match="max stop string"):
        ServerConfig(**bad)


async def test_grpc_answers_invalid_argument_and_the_stream_goes_on():
    async with live_server(FakeEngine(step_s=0.001)) as (_, stub, _):
        call = stub.Stream()
        await call.write(
            gen("many", sampling=pb.SamplingParams(stop=[f"s{i}" for i in range(100_000)]))
        )
        err = (await call.read()).error
        assert (
            err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            and "--max-stop-strings" in err.message
        )
        await call.write(gen("ok", max_tokens=2))
        while (msg := await call.read()).WhichOneof("kind") != "final":
            assert msg.WhichOneof("kind") == "chunk"
        await call.done_writing()


async def test_http_answers_400_in_openai_shape():
    engine = FakeEngine(step_s=0.001)
    config = SloserveConfig(server=ServerConfig(port=0, metrics_port=None))
    lifecycle = Lifecycle(config, engine, watchdog_interval_s=0.02)
    grpc_server = SloserveServer(config, engine, lifecycle=lifecycle)
    http_server = HttpServer(lifecycle, HttpConfig(port=0))
    await grpc_server.start()
    await http_server.start()
    lifecycle.start(start_engine=True)
    try:
        await wait_for(lambda: lifecycle.ready)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{http_server.port}", timeout=30
        ) as client:
            body = {"prompt": "hello", "max_tokens": 2, "stop": ["q" * 300]}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 400
            assert "--max-stop-string-chars" in resp.json()["error"]["message"]
            ok = await client.post("/v1/completions", json={**body, "stop": ["q"]})
            assert ok.status_code == 200
    finally:
        await lifecycle.stop()


# ---- the matcher ------------------------------------------------------------------------------
def _naive_cut(text: str, before: int, stops: list[str]) -> int | None:
    """The search the engine did before the automaton: str.find of every stop string near the new text."""
    start = max(0, before - max(map(len, stops)) + 1)
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


class _Scheduler:
    """What the output stage asks of the scheduler: to end a request early."""

    def stop_early(
        self, req: Request, num_output_tokens: int, status: RequestStatus, error: str | None = None
    ) -> None:
        req.truncate_output(num_output_tokens)
        req.status = status


def _request(stops: list[str]) -> Request:
    return Request(NewRequest("r", [0], SamplingParams(max_tokens=10_000, stop=stops)), 0)


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text("abcé", min_size=1, max_size=5), min_size=1, max_size=6),
    tokens=st.lists(st.integers(0, len(VOCAB) - 1), max_size=40),
)
def test_the_engine_cuts_and_streams_as_the_naive_search_does(stops, tokens):
    req = _request(stops)
    processor = OutputProcessor(lambda ids: "".join(VOCAB[i] for i in ids))
    text, streamed, expected_cut = "", "", None
    for token in tokens:
        before = len(text)
        text += VOCAB[token]
        expected_cut = _naive_cut(text, before, stops)
        req.append_token(token)
        streamed += processor.process([req], _Scheduler())[0].new_text
        if expected_cut is not None:
            break
    expected = text if expected_cut is None else text[:expected_cut]
    assert (req.status == RequestStatus.FINISHED_STOPPED) == (expected_cut is not None)
    assert streamed == (
        expected
        if req.is_finished
        else expected[: max(0, len(expected) - max(map(len, stops)) + 1)]
    )
    if not req.is_finished:  # the held-back tail goes out with the last output
        req.status = RequestStatus.FINISHED_ABORTED
        streamed += processor.process([req], _Scheduler())[0].new_text
    assert streamed == expected


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text("ab", min_size=1, max_size=6), min_size=1, max_size=8),
    chunks=st.lists(st.text("abc", max_size=4), max_size=30),
)
def test_feed_reports_the_earliest_start_of_a_string_ending_in_the_chunk(stops, chunks):
    matcher, text = StopMatcher(stops), ""
    for chunk in chunks:
        before = len(text)
        text += chunk
        ends = [(i, i + len(s)) for s in stops for i in range(len(text)) if text.startswith(s, i)]
        starts = [i for i, end in ends if before < end <= len(text)]
        assert matcher.feed(chunk) == (min(starts) if starts else None)


def test_work_per_token_is_its_new_text_whatever_the_number_of_strings():
    rng = random.Random(0)
    text = "".join(rng.choice("ab") for _ in range(20_000))
    for count in (1, 16, 10_000):
        stops = [
            "".join(rng.choice("ab") for _ in range(rng.randint(30, 60))) + "c"
            for _ in range(count)
        ]
        matcher = StopMatcher(stops)
        for i in range(0, len(text), 4):
            steps = matcher.steps
            assert matcher.feed(text[i : i + 4]) is None
            # each character once, no pass over the strings
            assert matcher.steps - steps == len(text[i : i + 4])
        assert matcher.max_len == max(map(len, stops))


def test_the_piece_that_ends_a_request_reads_at_most_its_matches():
    matcher = StopMatcher(["a" * n for n in range(1, 17)])
    assert matcher.feed("b" * 100) is None and matcher.steps == 100
    # a, aa, aaa ending at 3 places
    assert matcher.feed("xaaa") == 101 and matcher.steps == 100 + 4 + 6


async def test_stop_token_ids_are_bounded_too():
    """Checked on every token like the strings: at most --max-stop-token-ids (64), counted as a limit refusal."""
    engine = FakeEngine()
    await engine.start()
    metrics = Metrics(engine.stats)
    frontend = Frontend(engine, SloserveConfig(server=ServerConfig()), metrics)
    frontend.check(ParsedRequest("hi", SamplingParams(stop_token_ids=list(range(64)))))
    with pytest.raises(
        LimitExceeded, match=r"65 ids, over this server's limit of 64 \(--max-stop-token-ids\)"
    ) as err:
        frontend.check(ParsedRequest("hi", SamplingParams(stop_token_ids=list(range(65)))))
    assert err.value.limit == "max_stop_token_ids"
    await engine.stop()
