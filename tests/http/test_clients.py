"""What clients of an OpenAI-compatible server expect, against a real `sloserve serve` of the built-in
model: chat with its shipped template (the official `openai` client and LangChain's ChatOpenAI),
retries observed through a counting transport, request ids, context-length errors, /tokenize."""

from __future__ import annotations

import importlib

import httpx
import openai
import pytest
from sloserve.models.default import TRAINED_DIR

from tests.http.conftest import start

pytestmark = pytest.mark.timeout(180)
GRID = "Input:\n12\n34\nOutput:\n"
# the HTTP library the installed openai client is built on (httpx, or httpx2 in its later releases)
httpx_of_openai = importlib.import_module(
    openai.DefaultHttpxClient.__mro__[1].__module__.split(".")[0]
)


class CountingTransport(httpx_of_openai.HTTPTransport):
    """The real transport, counting what the client sends (its retries included)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []

    def handle_request(self, request):
        self.sent.append(request.url.path)
        return super().handle_request(request)


@pytest.fixture(scope="module")
def server():
    proc = start("default", None)  # the built-in model: its chat template ships with it
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def raw(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_chat_on_the_built_in_model_answers_a_grid_without_max_tokens(client):
    reply = client.chat.completions.create(
        model="default", temperature=0, messages=[{"role": "user", "content": "12\n34"}]
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # ended by end-of-sequence, not by a 64-token default cap
    rows = choice.message.content.splitlines()
    assert rows and rows[0].isdigit(), choice.message.content  # a grid (the 3M model is no solver)
    # the template's prompt: <s> + "Input:\n12\n34\nOutput:\n" (byte tokens)
    assert reply.usage.prompt_tokens == 1 + len(GRID)
    streamed = client.chat.completions.create(
        model="default",
        temperature=0,
        stream=True,
        messages=[{"role": "user", "content": GRID}],
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == choice.message.content
    )
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens > 0


def test_continue_final_message_extends_the_assistants_text(client):
    whole = client.chat.completions.create(
        model="default", temperature=0, max_tokens=4, messages=[{"role": "user", "content": GRID}]
    )
    start_text = whole.choices[0].message.content[:2]
    cont = client.chat.completions.create(
        model="default",
        temperature=0,
        max_tokens=2,
        messages=[{"role": "user", "content": GRID}, {"role": "assistant", "content": start_text}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert start_text + cont.choices[0].message.content == whole.choices[0].message.content[:4]


def test_langchain_chat_openai_invokes_and_streams(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key="none",
        model="default",
        temperature=0,
        max_retries=0,
        timeout=60,
    )
    answer = llm.invoke([("system", "solve it"), ("human", "12\n34")])
    assert answer.content.splitlines()[0].isdigit(), answer.content
    assert "".join(chunk.content for chunk in llm.stream([("human", "12\n34")])) == answer.content


def test_refusals_a_retry_cannot_fix_are_sent_once(server):
    transport = CountingTransport()
    with openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key="none",
        max_retries=2,
        timeout=60,
        http_client=httpx_of_openai.Client(transport=transport),
    ) as c:
        with pytest.raises(openai.APIStatusError) as refused:  # an objective no server can meet
            c.completions.create(
                model="default", prompt=GRID, max_tokens=4, extra_headers={"x-slo-ttft-ms": "0.001"}
            )
        # 429 slo_unattainable, or 504 deadline_passed when the microsecond is gone before admission
        assert refused.value.body["code"] in ("slo_unattainable", "deadline_passed")
        assert refused.value.response.headers["x-should-retry"] == "false"
        assert transport.sent == ["/v1/completions"]  # not re-sent with its clock restarted
        with pytest.raises(openai.BadRequestError) as bad:
            c.completions.create(model="default", prompt=GRID, max_tokens=0)
        assert bad.value.response.headers["x-should-retry"] == "false"
        assert len(transport.sent) == 2


def test_request_ids_are_echoed_or_made(raw):
    mine = raw.get("/v1/models", headers={"x-request-id": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42"
    made = raw.post("/v1/completions", json={"prompt": GRID, "max_tokens": 1})
    assert len(made.headers["x-request-id"]) == 32
    assert made.headers["x-request-id"] != raw.get("/health").headers["x-request-id"]


def test_context_length_errors_say_what_clients_look_for(client, raw):
    too_long = "7" * 300  # the fixture serves a 256-token context
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": too_long}]
        )
    body = err.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "messages"
    assert "This model's maximum context length is 256 tokens" in body["message"]
    reply = raw.post("/v1/completions", json={"prompt": too_long})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    assert reply.json()["error"]["code"] == "context_length_exceeded"


def test_error_messages_name_a_field_once(raw):
    error = raw.post("/v1/completions", json={"prompt": "x", "suffix": "y"}).json()["error"]
    assert error["param"] == "suffix" and not error["message"].startswith("suffix suffix")


def test_tokenize_and_detokenize_in_vllms_shapes(raw):
    text = raw.post("/tokenize", json={"prompt": "ab", "return_token_strs": True}).json()
    assert text == {
        "count": 3,
        "max_model_len": 256,
        "tokens": [256, 97, 98],
        "token_strs": ["<s>", "a", "b"],
    }
    chat = raw.post(
        "/tokenize", json={"model": "default", "messages": [{"role": "user", "content": "1"}]}
    ).json()
    assert (
        chat["tokens"] == [256, *GRID.replace("12\n34", "1").encode()]
        and chat["token_strs"] is None
    )
    assert raw.post("/detokenize", json={"tokens": chat["tokens"]}).json() == {
        "prompt": "<s>Input:\n1\nOutput:\n"
    }
    assert raw.post("/detokenize", json={"tokens": [99999]}).json()["error"]["param"] == "tokens"
    assert raw.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_one_model_by_id(client):
    assert client.models.retrieve("default").id == "default"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_the_built_in_folder_ships_its_template():
    assert (TRAINED_DIR / "chat_template.jinja").is_file()
