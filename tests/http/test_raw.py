"""Raw HTTP against a real `sloserve serve`: SSE framing byte for byte, every error status provoked,
a client that disconnects frees its KV blocks, a flood at 10x capacity is answered in full."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest
from sloserve.testing.server_process import describe, quiescent

from tests.http.conftest import AUTH, SLOW, TOKEN

pytestmark = pytest.mark.timeout(120)
META = [("authorization", f"Bearer {TOKEN}")]


@pytest.fixture(scope="module")
def http(http_server) -> httpx.Client:
    with httpx.Client(base_url=http_server.url, headers=AUTH, timeout=60) as c:
        yield c


def _events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n"), raw[-40:]
    return raw[:-2].split(b"\n\n")


def test_sse_framing_byte_for_byte(http, tiny_llama):
    body = {
        "prompt": "abc",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        assert reply.headers["cache-control"] == "no-cache"
        raw = b"".join(reply.iter_raw())
    events = _events(raw)
    assert events[-1] == b"data: [DONE]" and all(e.startswith(b"data: {") for e in events[:-1])
    chunks = [orjson.loads(e[len(b"data: ") :]) for e in events[:-1]]
    head = {
        "id": chunks[0]["id"],
        "object": "text_completion",
        "created": chunks[0]["created"],
        "model": str(tiny_llama),
    }
    texts = [c["choices"][0]["text"] for c in chunks[:-2]]
    usage = chunks[-1]["usage"]
    # include_usage: every chunk carries `usage`, null until the last one (as OpenAI's API streams)
    expected = [
        {
            **head,
            "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": None}],
            "usage": None,
        }
        for t in texts
    ]
    expected.append(
        {
            **head,
            "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
            "usage": None,
        }
    )
    expected.append(
        {
            **head,
            "choices": [],
            "usage": {
                "prompt_tokens": 4,
                "completion_tokens": 5,
                "total_tokens": 9,
                "prompt_tokens_details": {
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]
                },
            },
        }
    )
    assert (
        raw
        == b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in expected) + b"data: [DONE]\n\n"
    )


def test_chat_sse_opens_with_the_role_and_closes_with_the_finish_reason(http):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    raw = http.post("/v1/chat/completions", json=body).content
    events = _events(raw)
    chunks = [orjson.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert events[-1] == b"data: [DONE]"
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage


BAD = [  # (body, status, param or code the error names)
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 17}, 400, "invalid_argument"),  # over --max-n
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**6}, 400, "invalid_argument"),  # over --max-tokens-limit
    ({"prompt": "x", "stop": 5}, 400, "stop"),
    ({"prompt": "x", "seed": "s"}, 400, "seed"),
    ({"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ({"prompt": "x", "logprobs": 21}, 400, "invalid_argument"),  # over --max-logprobs
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 4}, 400, "min_tokens"),
    ({"prompt": "x", "priority": "high"}, 400, "priority"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "slo": {"ttft_s": -1}}, 400, "slo.ttft_s"),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": ""}, 400, "invalid_argument"),
    ({"prompt": [1, -2]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a", ""]}, 400, "prompt[1]"),
    ({"prompt": ["a", [1, "b"]]}, 400, "prompt[1]"),
    ({"prompt": ["a"] * 65}, 400, "invalid_argument"),  # over --max-prompts-per-request
    ({"prompt": "x", "max_tokens": 0, "logprobs": 1}, 400, "max_tokens"),  # 0 only with echo
    ({"prompt": "x", "max_completion_tokens": 0, "echo": False}, 400, "max_completion_tokens"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "model": "other"}, 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "names"), BAD, ids=[str(b)[:50] for b, _, _ in BAD])
def test_a_bad_field_is_an_openai_error_naming_it(http, body, status, names):
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert names in (error["param"], error["code"]), error
    assert error["message"] and error["type"] == (
        "invalid_request_error" if status == 400 else "not_found_error"
    )


def test_unknown_fields_are_ignored(http):
    body = {
        "prompt": "x",
        "max_tokens": 2,
        "echo": False,
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "return_hidden_states": False,
        "n": 1,
        "min_tokens": 0,
        "priority": 3,
        "something_new": {"a": 1},
    }
    assert http.post("/v1/completions", json=body).status_code == 200


def test_chat_errors(http, http_server):
    assert (
        http.post("/v1/chat/completions", json={"messages": []}).json()["error"]["param"]
        == "messages"
    )
    bad_part = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert (
        http.post("/v1/chat/completions", json=bad_part).json()["error"]["param"]
        == "messages[0].content[0]"
    )
    assert (
        http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        ).json()["error"]["param"]
        == "top_logprobs"
    )


def test_not_json_missing_and_wrong_tokens(http_server):
    url = f"{http_server.url}/v1/completions"
    assert httpx.post(url, content=b"{nope", headers=AUTH).status_code == 400
    missing = httpx.post(url, json={"prompt": "x"})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_token"
    wrong = httpx.post(url, json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{http_server.url}/v1/models").status_code == 401
    # probes and scrapes need no token
    assert httpx.get(f"{http_server.url}/health").json() == {"status": "serving"}
    assert b"sloserve_requests_total" in httpx.get(f"{http_server.url}/metrics").content
    assert httpx.get(f"{http_server.url}/version").json()["version"]
    assert httpx.get(f"{http_server.url}/nowhere").status_code == 404


def test_a_passed_deadline_is_504(http):
    late = http.post("/v1/completions", json={"prompt": "x"}, headers={"x-slo-ttft-ms": "0.001"})
    assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_passed"
    gone = http.post("/v1/completions", json={"prompt": "x"}, headers={"x-request-timeout": "0"})
    assert gone.status_code == 504


def _stats(server):
    return server.info(metadata=META).stats


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_a_client_that_disconnects_frees_every_kv_block(http_server, stream):
    """240 tokens at >= 10 ms a step take >= 2.4 s: the client leaves long before that."""
    before = _stats(http_server)
    body = {
        "prompt": "a long story",
        "max_tokens": 240,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    headers = {**AUTH, "x-request-id": f"{SLOW}-{stream}"}
    if stream:
        with httpx.Client(base_url=http_server.url, headers=headers, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                # NOTE: keep the iterator: a dropped one is closed at once, and closing it closes the
                # connection, so the request was cancelled before the check below (flaky on a busy core).
                chunks = reply.iter_raw()
                next(chunks)  # the first token is out: the request holds KV blocks
                assert _stats(http_server).kv_blocks_free < before.kv_blocks_total
                del chunks
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{http_server.url}/v1/completions", json=body, headers=headers, timeout=0.3)
    after = http_server.wait_quiescent(30, metadata=META)
    assert quiescent(after), describe(after)
    assert after.generated_tokens_total - before.generated_tokens_total < 240, (
        "it ran to the end instead"
    )


async def test_a_flood_at_10x_capacity_is_refused_with_429_and_nothing_is_lost(http_server):
    """--max-batch 4: 40 requests at once, each with a first-token objective the queue cannot meet.

    At ~0.3-0.6 ms a decode step the 40th request's first token comes ~85-170 ms in (9 rounds of
    32 steps), the 9th's ~10-20 ms: a 20 ms objective keeps the flood far past capacity on a fast
    machine. With 150 ms, once the decode step got faster, all 40 were sometimes admitted (2 of 5
    runs), and with 50 ms once in a quiet full-suite run (all 40 served in 0.1 s): the test failed
    on "nothing refused".
    """
    async with httpx.AsyncClient(
        base_url=http_server.url, headers=AUTH, timeout=60, limits=httpx.Limits(max_connections=64)
    ) as c:
        await c.post(
            "/v1/completions", json={"prompt": "warm", "max_tokens": 8, "ignore_eos": True}
        )
        body = {"prompt": "flood", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        headers = {"x-slo-ttft-ms": "20"}
        t0 = time.monotonic()
        replies = await asyncio.gather(
            *(c.post("/v1/completions", json=body, headers=headers) for _ in range(40))
        )
        took = time.monotonic() - t0
    codes = [r.status_code for r in replies]
    # NOTE: a request whose objective passed while it queued is refused with 504 (deadline_passed,
    # gRPC DEADLINE_EXCEEDED): seen on a loaded machine
    assert len(replies) == 40 and set(codes) <= {200, 429, 504}, codes
    refused = [r for r in replies if r.status_code in (429, 504)]
    assert refused, f"nothing refused in {took:.1f}s: {codes}"
    for r in refused:
        code = r.json()["error"]["code"]
        assert code == "deadline_passed" if r.status_code == 504 else code != "deadline_passed"
        assert code in ("slo_unattainable", "queue_full", "deadline_passed")
        # a retry later may find room; an objective that cannot be met stays so
        if code == "queue_full":
            assert r.headers["retry-after"].isdigit() and r.headers["retry-after-ms"].isdigit()
        else:
            assert r.headers["x-should-retry"] == "false"
    for r in replies:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 32
    after = http_server.wait_quiescent(30, metadata=META)
    assert quiescent(after), describe(after)
