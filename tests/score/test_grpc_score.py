"""The gRPC Score call on a real `sloserve serve`: the same scores as /v1/score, bad input an
INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import pytest
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc

from tests.score.conftest import META, PROMPT, TOL
from tests.score.test_http_score import CANDIDATES, post_score


def _grpc_score(server, request):
    with server.sync_channel() as channel:
        return pb_grpc.SloserveStub(channel).Score(request, timeout=60, metadata=META)


def test_grpc_score_equals_http(server):
    reply = _grpc_score(
        server,
        pb.ScoreRequest(
            request_id="s",
            token_ids=pb.TokenIds(ids=PROMPT),
            candidates=[pb.ScoreCandidate(token_ids=pb.TokenIds(ids=c)) for c in CANDIDATES],
            top_logprobs=1,
        ),
    )
    http = post_score(
        server, {"prompt": PROMPT, "candidates": CANDIDATES, "top_logprobs": 1}
    ).json()
    assert [list(c.token_ids) for c in reply.candidates] == CANDIDATES
    for got, want in zip(reply.candidates, http["data"], strict=True):
        assert list(got.token_logprobs) == pytest.approx(want["token_logprobs"], abs=TOL)
        assert [list(t.token_ids) for t in got.top_logprobs] == [
            [e["token_id"] for e in top] for top in want["top_logprobs"]
        ]
    assert reply.prompt_tokens == len(PROMPT) and reply.cached_tokens >= 2 * 40
    with pytest.raises(grpc.RpcError) as caught:
        _grpc_score(server, pb.ScoreRequest(text="hi"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "candidates is empty" in caught.value.details()


def test_an_undecodable_score_request_is_invalid_argument(server):
    with server.sync_channel() as channel:
        raw = channel.unary_unary(
            "/sloserve.v1.Sloserve/Score",
            request_serializer=lambda b: b,
            response_deserializer=pb.ScoreResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\xff\xff\xff", timeout=30, metadata=META)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not parse sloserve.v1.ScoreRequest" in caught.value.details()
