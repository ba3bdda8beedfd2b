"""The official `openai` client against a real `sloserve serve`: response_format, structured_outputs,
the tool-calling loop (tool_choice required, named, auto), and clear 400s that leave nothing behind."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.http.conftest import start
from tests.metrics_text import sample

pytestmark = pytest.mark.timeout(180)

# Hermes / Qwen2.5 style: tools in the system turn, calls and results as tagged turns
TOOL_TEMPLATE = """{%- if tools %}<|system|>You may call these functions:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|assistant|>
{%- for call in m.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}
{% elif m.role == "tool" %}<|tool|>{{ m.content }}
{% else %}<|{{ m.role }}|>{{ m.content }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    template = tmp_path_factory.mktemp("tools") / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    server = start(tiny_llama, template, "--max-model-len", "1024")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_json_schema_answers_parse_and_validate(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    for seed in range(6):
        reply = client.chat.completions.create(
            model=model,
            messages=USER,
            max_tokens=150,
            temperature=1.0,
            seed=seed,
            response_format=fmt,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_and_streamed_schema_answers_parse(client, model):
    reply = client.chat.completions.create(
        model=model,
        messages=USER,
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].message.content.startswith("{")
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    chunks = client.chat.completions.create(
        model=model,
        messages=USER,
        max_tokens=150,
        temperature=1.0,
        seed=4,
        response_format=fmt,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ({"structured_outputs": {"regex": r"[0-9]{2}:[0-9]{2}"}}, r"[0-9]{2}:[0-9]{2}"),
        ({"structured_outputs": {"choice": ["red", "green"]}}, r"red|green"),
        ({"guided_choice": ["left", "right"]}, r"left|right"),
        ({"structured_outputs": {"grammar": 'root ::= "a" [0-9] [0-9]'}}, r"a[0-9]{2}"),
    ],
)
def test_vllm_structured_outputs_on_completions(client, model, extra, pattern):
    reply = client.completions.create(
        model=model, prompt="pick:", max_tokens=20, temperature=1.0, seed=1, extra_body=extra
    )
    assert re.fullmatch(pattern, reply.choices[0].text), reply.choices[0].text


def test_tool_calling_loop_required_then_answer(client, model):
    messages = list(USER)
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=300,
        temperature=1.0,
        seed=2,
        parallel_tool_calls=False,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21"},
    ]
    final = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str)


def test_named_tool_choice_calls_that_function_streamed_and_not(client, model):
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(
        model=model,
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        max_tokens=100,
        temperature=1.0,
        seed=5,
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=USER,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            max_tokens=100,
            temperature=1.0,
            seed=5,
            stream=True,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_time", call.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


def test_auto_tool_choice_answers_free_text(client, model):
    reply = client.chat.completions.create(
        model=model,
        messages=USER,
        tools=[WEATHER],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    message = reply.choices[0].message
    assert message.tool_calls is None and len(message.content) > 0


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
            "Invalid type",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "integer", "minimum": 3, "maximum": 1}},
                            "required": ["a"],
                        },
                    },
                }
            },
            "response_format.json_schema.schema",
            "nsatisfiable",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        (
            {"structured_outputs": {"regex": r"[^\s\S]"}},
            "structured_outputs.regex",
            "can match no text",
        ),
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex", "unclosed group"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
            "only one",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "tool_choice",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "not among the tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools[0].function.parameters",
            "cannot be used",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ],
)
def test_bad_structured_requests_are_400s_that_leave_nothing_behind(server, body, param, words):
    payload = {"messages": USER, "max_tokens": 4, **body}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert (
        "sloserve_running_requests" in metrics
        and sample(metrics, "sloserve_running_requests") == 0.0
    )
    assert (
        "sloserve_kv_blocks_in_use" in metrics
        and sample(metrics, "sloserve_kv_blocks_in_use") == 0.0
    )


def test_tools_on_a_template_that_ignores_them_are_a_400(http_server):
    from tests.http.conftest import AUTH

    payload = {"messages": USER, "max_tokens": 4, "tools": [WEATHER]}
    reply = httpx.post(
        f"{http_server.url}/v1/chat/completions", json=payload, headers=AUTH, timeout=30
    )
    assert reply.status_code == 400 and "does not render tools" in reply.json()["error"]["message"]
