"""POST /v1/score on a real `sloserve serve` (tiny llama, CPU): scores equal transformers', the
prompt's blocks are shared, and bad bodies get a 400 naming the field."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from sloserve.testing.server_process import WITH_FAULTS, quiescent

from tests.checkpoints import hf_log_softmax
from tests.http.conftest import AUTH, start
from tests.score.conftest import META, PROMPT, TOL

pytestmark = pytest.mark.timeout(180)
CANDIDATES = [[(i * 11) % 250 for i in range(5)], [119, 111, 114], [61]]


def post_score(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/score", json=body, headers=AUTH, timeout=60)


def test_scores_equal_transformers_and_share_the_prompt(server, tiny_llama):
    reply = post_score(
        server, {"model": "m", "prompt": PROMPT, "candidates": CANDIDATES, "top_logprobs": 2}
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "score" and [d["index"] for d in body["data"]] == [0, 1, 2]
    for item, c in zip(body["data"], CANDIDATES, strict=True):
        ref = hf_log_softmax(tiny_llama, tuple(PROMPT + c))
        want = [ref[len(PROMPT) + i - 1, t].item() for i, t in enumerate(c)]
        assert item["tokens"] == c
        assert item["token_logprobs"] == pytest.approx(want, abs=TOL)
        assert item["sum_logprob"] == pytest.approx(sum(want), abs=len(c) * TOL)
        assert [len(top) for top in item["top_logprobs"]] == [2] * len(c)
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(PROMPT)
    assert usage["candidate_tokens"] == sum(map(len, CANDIDATES))
    # two of three candidates reuse the prompt's full blocks before its last row (40 tokens)
    assert usage["cached_tokens"] >= 2 * 40
    assert quiescent(server.wait_quiescent(30, metadata=META))


def test_text_prompt_and_candidates(server):
    reply = post_score(server, {"prompt": "hello there", "candidates": [" world", "!"]})
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    assert len(data) == 2 and all(d["sum_logprob"] < 0 for d in data)
    assert "top_logprobs" not in data[0]


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"prompt": PROMPT, "candidates": []}, "candidates", "non-empty list"),
        ({"prompt": PROMPT}, "candidates", "non-empty list"),
        ({"prompt": PROMPT, "candidates": [[1], []]}, "candidates", r"candidates\[1\]"),
        ({"prompt": PROMPT, "candidates": [[1]] * 4}, "candidates", "--max-score-candidates"),
        ({"prompt": PROMPT, "candidates": [[1] * 220]}, "candidates", "model takes at most 255"),
        ({"prompt": [], "candidates": [[1]]}, "prompt", "prompt must be"),
        (
            {"prompt": PROMPT, "candidates": [[1]], "top_logprobs": -1},
            "top_logprobs",
            "top_logprobs",
        ),
    ],
)
def test_bad_bodies_get_a_400_naming_the_field(server, body, param, match):
    reply = post_score(server, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert re.search(match, error["message"]), error["message"]


def test_a_client_that_goes_away_aborts_every_candidate(tiny_llama):
    """Steps with the call's requests take 4 s more: the client leaves during the first (which
    computes the prompt and one candidate); the others are aborted, never computed."""
    server = start(
        tiny_llama,
        None,
        "--block-size",
        "4",
        "--inject-faults",
        "slow-step:slowscore=4",
        command=WITH_FAULTS,
    )
    try:
        candidates = [[(i * 7 + j) % 250 for j in range(40)] for i in range(3)]
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{server.url}/v1/score",
                json={"prompt": PROMPT, "candidates": candidates},
                headers={"x-request-id": "slowscore"},
                timeout=1.0,
            )
        # the engine's stats are as of its last step: wait for the first one's
        deadline = time.monotonic() + 30
        while server.info().stats.steps_total < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        stats = server.wait_quiescent(30)
        assert quiescent(stats)
        # only the first step's candidate was ever scheduled (the others waited for its blocks)
        assert stats.prompt_tokens_total == len(PROMPT) + 40
        assert stats.steps_total == 1
    finally:
        server.stop()
