"""Hypothesis-generated client messages against a live server: every one is answered, none crashes it.

Each example is one Stream of 1-8 messages (random and missing fields, huge, negative and
non-finite numbers where the types allow, odd unicode, oversized prompts, reused ids, cancels
of unknown ids, empty messages). Invariant: every GenerateRequest gets exactly one answer (the
terminal message of its id, or, when it reuses a live id, a duplicate_id error with an empty
request_id, so no id ever gets two terminals for one request), errors carry a client-side
status code and a message, the stream ends OK, and the
server stays healthy and leak-free. A second test sends undecodable bytes.
"""

from __future__ import annotations

import collections

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.server_process import SERVICE_NAME, describe, quiescent

from tests.reliability.harness import FULL, count

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FUZZ = settings(
    max_examples=count(60, 600),
    deadline=None,
    derandomize=not FULL,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Codes a client may legitimately get for a bad or unlucky request; INTERNAL/UNKNOWN never.
CLIENT_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT.value[0],
    grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
    grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
}

odd_text = st.text(
    alphabet=st.characters(exclude_categories=("Cs",)), max_size=60
) | st.sampled_from(
    [
        "\x00",
        "\u202e\u2066abc",
        "e\u0301\u0301\u0301",
        "\U0001f9d1\u200d\U0001f680" * 20,
        "\ufeff",
        "\uffff",
        "\n\r\t",
        "a" * 5000,
    ]
)
request_ids = st.sampled_from(["a", "b", "", "é", "a" * 300]) | odd_text
uint32 = st.integers(0, 2**32 - 1)
uint64 = st.integers(0, 2**64 - 1)
float32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
float64 = st.floats(allow_nan=True, allow_infinity=True) | st.floats(0.001, 5.0)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    if draw(st.integers(0, 9)):  # mostly present
        req.request_id = draw(request_ids)
    kind = draw(
        st.sampled_from(["text", "text", "ids", "ids", "none", "empty_text", "empty_ids", "huge"])
    )
    if kind == "text":
        req.text = draw(odd_text)
    elif kind == "ids":
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, 300) | uint32, max_size=40)))
    elif kind == "empty_text":
        req.text = ""
    elif kind == "empty_ids":
        req.token_ids.SetInParent()
    elif kind == "huge":
        req.text = "z" * draw(st.integers(255, 300_000))
    if draw(st.booleans()):
        req.max_tokens = draw(st.integers(0, 24) | uint32)
    if draw(st.booleans()):
        s = req.sampling
        for name, strategy in (
            ("temperature", float32),
            ("top_p", float32),
            ("top_k", uint32),
            ("seed", uint64),
            ("ignore_eos", st.booleans()),
        ):
            if draw(st.booleans()):
                setattr(s, name, draw(strategy))
        s.stop_token_ids.extend(draw(st.lists(st.integers(0, 300) | uint32, max_size=3)))
        s.stop.extend(draw(st.lists(odd_text, max_size=3)))
    if draw(st.booleans()):
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            if draw(st.booleans()):
                setattr(req.slo, name, draw(float64))
    return req


@st.composite
def client_messages(draw) -> pb.ClientMessage:
    choice = draw(st.integers(0, 9))
    if choice < 7:
        return pb.ClientMessage(generate=draw(generate_requests()))
    if choice < 9:
        return pb.ClientMessage(cancel=pb.CancelRequest(request_id=draw(request_ids)))
    return pb.ClientMessage()  # neither generate nor cancel


@pytest.fixture(scope="module")
def fuzz_stub(small_pool_server):
    with small_pool_server.sync_channel() as channel:
        yield pb_grpc.SloserveStub(channel)


@pytest.fixture(scope="module")
def tally(small_pool_server):
    """Outcome counts of this module's fuzz tests; 'log_mark' is where this module's server logs begin."""
    return collections.Counter(log_mark=len(small_pool_server.logs))


def _echoable(request_id: str) -> bool:
    """An id the server echoes: at most --grpc-max-request-id-length (256) printable ASCII characters."""
    return len(request_id) <= 256 and request_id.isascii() and request_id.isprintable()


def _expected_terminals(messages: list[pb.ClientMessage]) -> collections.Counter[str]:
    want: collections.Counter[str] = collections.Counter()
    for msg in messages:
        kind = msg.WhichOneof("kind")
        if kind == "generate":  # a refused id is answered without it
            want[msg.generate.request_id if _echoable(msg.generate.request_id) else ""] += 1
        elif kind is None:
            want[""] += 1  # answered with an error whose request_id is empty
        elif kind == "cancel" and not _echoable(msg.cancel.request_id):
            # its id is refused (request_id_length / request_id_charset), without the id
            want[""] += 1
    return want


@given(messages=st.lists(client_messages(), min_size=1, max_size=8))
@FUZZ
def test_fuzzed_streams_are_answered(fuzz_stub, tally, messages):
    replies = list(fuzz_stub.Stream(iter(messages), timeout=120))  # raises if the stream fails
    got: collections.Counter[str] = collections.Counter()
    duplicates = 0
    generated = {m.generate.request_id for m in messages if m.WhichOneof("kind") == "generate"}
    for reply in replies:
        kind = reply.WhichOneof("kind")
        body = getattr(reply, kind)
        assert body.request_id in generated or kind == "error", reply
        if kind == "final":
            got[body.request_id] += 1
            tally[f"final:{pb.FinishReason.Name(body.finish_reason)}"] += 1
        elif kind == "error":
            assert body.code in CLIENT_CODES, f"status {body.code} for {messages}: {body}"
            assert body.message, body
            tally[f"error:{grpc.StatusCode(_code(body.code)).name}:{body.reason}"] += 1
            if body.reason == "duplicate_id":  # a reused live id: answered without that id
                assert body.request_id == "", reply
                duplicates += 1
            elif body.reason == "unknown_id":  # a cancel of an id that is not live
                assert body.request_id == "", reply
            else:
                got[body.request_id] += 1
    want = _expected_terminals(messages)
    assert set(got) == set(want) and all(got[rid] <= want[rid] for rid in want), (messages, replies)
    assert sum(got.values()) + duplicates == sum(want.values()), (messages, replies)
    tally["streams"] += 1
    tally["messages"] += len(messages)


def _code(number: int) -> tuple:
    return next(c.value for c in grpc.StatusCode if c.value[0] == number)


@given(payloads=st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=4))
@settings(FUZZ, max_examples=count(30, 300))
def test_undecodable_bytes_end_only_their_stream(small_pool_server, tally, payloads):
    with small_pool_server.sync_channel() as channel:
        raw = channel.stream_stream(
            "/sloserve.v1.Sloserve/Stream",
            request_serializer=lambda b: b,
            response_deserializer=pb.ServerMessage.FromString,
        )
        try:
            replies = list(raw(iter(payloads), timeout=60))
            tally["raw:ok"] += 1
        except grpc.RpcError as exc:
            assert exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the server hung on bad bytes"
            tally[f"raw:{exc.code().name}"] += 1
            replies = []
    for reply in replies:  # bytes that happen to parse are ordinary messages, answered as such
        assert reply.WhichOneof("kind") in ("chunk", "final", "error")


def test_server_survives_the_fuzzing(small_pool_server, tally):
    """Runs after the fuzz tests in this module: health SERVING, nothing left allocated."""
    stats = small_pool_server.wait_quiescent(timeout=60)
    mark = tally.pop("log_mark")
    print(f"\nfuzz: {dict(sorted(tally.items()))}\n  after: {describe(stats)}")
    assert tally["streams"] > 0, "run with the fuzz tests of this module"
    assert quiescent(stats), describe(stats)
    assert small_pool_server.health() == health_pb2.HealthCheckResponse.SERVING
    assert small_pool_server.health(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    assert small_pool_server.proc.poll() is None
    internal = [e for e in small_pool_server.logs[mark:] if e.get("level") == "error"]
    assert not internal, internal[:3]


def test_corrupt_bytes_mid_stream_are_not_dropped_silently(small_pool_server):
    """A message that cannot be parsed must not make the live requests on the stream vanish."""
    valid = pb.ClientMessage(
        generate=pb.GenerateRequest(request_id="live", text="hello", max_tokens=250)
    )
    valid.generate.sampling.ignore_eos = True
    with small_pool_server.sync_channel() as channel:
        raw = channel.stream_stream(
            "/sloserve.v1.Sloserve/Stream",
            request_serializer=lambda b: b,
            response_deserializer=pb.ServerMessage.FromString,
        )
        call = raw(iter([valid.SerializeToString(), b"\xff\xff\xff"]), timeout=60)
        terminals = []
        try:
            terminals = [m for m in call if m.WhichOneof("kind") in ("final", "error")]
        except grpc.RpcError:
            pass
        assert terminals or call.code() == grpc.StatusCode.INVALID_ARGUMENT, (
            f"the live request vanished: stream ended {call.code()} with no terminal for it"
        )


def test_corrupt_generate_request_is_invalid_argument(small_pool_server):
    """An undecodable GenerateRequest is the client's fault: INVALID_ARGUMENT, not UNKNOWN."""
    with small_pool_server.sync_channel() as channel:
        raw = channel.unary_stream(
            "/sloserve.v1.Sloserve/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pb.ServerMessage.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(raw(b"\xff\xff\xff", timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
