"""OpenAI's `prediction` on chat and completions against a real `sloserve serve --speculation
ngram` (tiny llama): the output unchanged, usage's accepted/rejected prediction tokens, and a
400 naming what to change."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.http.conftest import TEMPLATE, start

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def http(tiny_llama, tmp_path_factory) -> Iterator[httpx.Client]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    server = start(
        tiny_llama,
        template,
        "--speculation",
        "ngram",
        "--num-speculative-tokens",
        "6",
    )
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client
    finally:
        server.stop()


def _complete(http, path: str, **extra) -> dict:
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "copy: 1 2 3 1 2 3 1 2 3"}]
    else:
        body["prompt"] = "copy: 1 2 3 1 2 3 1 2 3"
    reply = http.post(path, json={**body, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _ids(reply: dict) -> list[int]:
    choice = reply["choices"][0]
    return choice["token_ids"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prediction_changes_the_speed_not_the_output(http, path):
    plain = _complete(http, path)
    assert "completion_tokens_details" not in plain["usage"]
    answer = _ids(plain)
    exact = _complete(http, path, prediction={"type": "content", "content": answer})
    assert _ids(exact) == answer
    details = exact["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] == 0
    wrong = [t if i % 6 != 2 else (t + 1) % 256 for i, t in enumerate(answer)]
    edited = _complete(http, path, prediction={"type": "content", "content": wrong})
    assert _ids(edited) == answer
    assert edited["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] > 0
    text = _complete(
        http, path, prediction={"type": "content", "content": [{"type": "text", "text": "1 2 3"}]}
    )
    assert _ids(text) == answer


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        (
            {"max_tokens": 3, "prediction": {"type": "content", "content": [65] * 4}},
            None,
            "max_tokens",
        ),
        (
            {"max_tokens": 200, "prediction": {"type": "content", "content": [65] * 200}},
            None,
            "context",
        ),
        ({"prediction": {"type": "text", "content": "x"}}, "prediction", "type"),
        (
            {"prediction": {"type": "content", "content": 7}},
            "prediction.content",
            "expected output",
        ),
    ],
)
def test_a_prediction_that_cannot_be_used_is_a_400_naming_what_to_change(http, extra, param, says):
    body = {"prompt": "x" * 80, "temperature": 0, **extra}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert says in error["message"]
    if param is not None:
        assert error["param"] == param
