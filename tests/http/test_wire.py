"""Objectives from headers and body, chat templates from a checkpoint or a file (no server)."""

from __future__ import annotations

import json

import pytest
from sloserve.errors import InvalidRequestError
from sloserve.frontend import RequestFailed
from sloserve.frontend.chat import ChatTemplate
from sloserve.frontend.chat_files import template_from_checkpoint, template_from_file
from sloserve.http.errors import HttpError, retry_headers
from sloserve.http.schemas import parse_chat, parse_completion
from sloserve.http.slo import slo_from_wire
from sloserve.sampling_params import SLO
from sloserve.testing.fake_engine import FakeEngine

from tests.http.test_lifecycle import edges


def test_headers_are_milliseconds_and_win_over_the_body():
    slo = slo_from_wire(
        {"x-slo-ttft-ms": "250", "x-slo-tpot-ms": "20"}, {"slo": {"ttft_s": 9, "e2e_s": 4}}
    )
    assert slo == SLO(ttft_s=0.25, tpot_s=0.02, e2e_s=4)


def test_the_request_timeout_bounds_e2e_unless_given():
    assert slo_from_wire({"x-stainless-timeout": "30"}, {}) == SLO(e2e_s=30.0)
    assert slo_from_wire({"x-stainless-timeout": "30", "x-slo-e2e-ms": "500"}, {}) == SLO(e2e_s=0.5)
    assert slo_from_wire({}, {}) is None
    with pytest.raises(RequestFailed):
        slo_from_wire({"x-request-timeout": "0"}, {})


@pytest.mark.parametrize(
    ("headers", "body", "param"),
    [
        ({"x-slo-ttft-ms": "soon"}, {}, "x-slo-ttft-ms"),
        ({"x-slo-tpot-ms": "-5"}, {}, "x-slo-tpot-ms"),
        ({}, {"slo": 3}, "slo"),
        ({}, {"slo": {"e2e_s": "inf"}}, "slo.e2e_s"),
    ],
)
def test_bad_objectives_name_their_field(headers, body, param):
    with pytest.raises(HttpError) as err:
        slo_from_wire(headers, body)
    assert err.value.status == 400 and err.value.param == param


def test_parsing_maps_openai_fields_onto_sampling_params():
    req = parse_completion(
        {
            "prompt": ["hi"],
            "max_completion_tokens": 5,
            "max_tokens": 9,
            "top_k": -1,
            "stop": "x",
            "seed": 3,
            "priority": -2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        model="m",
        default_max_tokens=64,
        slo=None,
    )
    p = req.parsed.params
    assert (req.parsed.prompt, p.max_tokens, p.top_k, p.stop, p.seed, p.temperature) == (
        "hi",
        5,
        0,
        ["x"],
        3,
        1.0,
    )
    assert req.parsed.priority == -2 and req.stream and req.include_usage
    chat = parse_chat(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        },
        lambda ms, **_: ms[0]["content"],
        model="m",
        default_max_tokens=64,
        slo=None,
    )
    assert chat.parsed.prompt == "ab" and chat.parsed.add_special_tokens is False


def test_the_checkpoint_template_renders_with_its_special_tokens(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>"},
                "eos_token": "</s>",
                "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}"
                "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}",
            }
        )
    )
    template = template_from_checkpoint(str(tmp_path))
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>[user] hi</s>[assistant] "


def test_no_template_is_none_and_a_raising_template_is_the_requests_fault(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert template_from_checkpoint(str(tmp_path)) is None
    strict = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}",
        origin="test",
    )
    with pytest.raises(InvalidRequestError, match="user first"):
        strict.render([{"role": "assistant", "content": "x"}])
    (tmp_path / "bad.jinja").write_text("{% for %}")
    with pytest.raises(ValueError, match="not valid Jinja"):
        template_from_file(str(tmp_path / "bad.jinja"))


async def test_chat_without_any_template_is_a_400_that_says_so():
    async with edges(FakeEngine()) as (_, client):
        reply = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["code"] == "no_chat_template" and "--chat-template" in error["message"]


@pytest.mark.parametrize(
    ("status", "code", "headers"),
    [
        (429, "queue_full", {"Retry-After": "1", "retry-after-ms": "1000"}),
        (503, "draining", {"Retry-After": "1", "retry-after-ms": "1000"}),
        (429, "slo_unattainable", {"x-should-retry": "false"}),
        (504, "deadline_passed", {"x-should-retry": "false"}),
        (400, "context_length_exceeded", {"x-should-retry": "false"}),
        (401, None, {"WWW-Authenticate": "Bearer", "x-should-retry": "false"}),
        (500, "internal", {}),
    ],
)
def test_retry_headers_say_whether_and_when(status, code, headers):
    assert retry_headers(status, code) == headers
