"""Tool calls parsed out of answers (whole and streamed in any split), and the request fields that ask for them."""

from __future__ import annotations

import json

import pytest
from sloserve.http.errors import HttpError
from sloserve.http.structured import structured_grammar
from sloserve.http.tools import ToolStream, message_tool_fields, parse_calls, parse_tools

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_whole_answers_split_into_content_and_calls():
    content, calls = parse_calls("let me look\n" + CALL + "\n" + CALL.replace('"f"', '"g"'))
    assert content == "let me look"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1}),
        ("g", {"x": 1}),
    ]
    assert len({c["id"] for c in calls}) == 2
    assert parse_calls(CALL)[0] is None
    assert parse_calls("no calls here") == ("no calls here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_calls(broken) == (broken, [])  # not a call: it stays content


@pytest.mark.parametrize("cut", [1, 3, 7, 11, 13])
def test_streamed_answers_give_the_same_content_and_calls_in_any_split(cut):
    text = "hi <tool there " + CALL
    stream = ToolStream()
    sent = "".join(stream.feed(text[i : i + cut]) for i in range(0, len(text), cut))
    sent += stream.finish()
    assert sent == "hi <tool there "
    assert [c["function"]["name"] for c in stream.calls] == ["f"]
    plain = ToolStream()
    assert (
        "".join(plain.feed(c) for c in "a <tool_ca") + plain.finish() == "a <tool_ca"
        and not plain.calls
    )


def test_tool_choice_required_and_named_get_a_grammar_auto_and_none_do_not():
    assert parse_tools({"tools": [TOOL]}).grammar is None
    assert parse_tools({"tools": [TOOL], "tool_choice": "none"}).parses is False
    assert parse_tools({"tools": [TOOL], "tool_choice": "required"}).grammar
    named = parse_tools(
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}
    )
    assert named.choice == "f" and named.grammar
    assert parse_tools({}) is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": "f"}, "tools"),
        ({"tools": [TOOL, TOOL]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
    ],
)
def test_bad_tools_name_their_field(body, param):
    with pytest.raises(HttpError) as err:
        parse_tools(body)
    assert err.value.status == 400 and err.value.param == param


def test_past_calls_reach_the_template_with_object_arguments():
    message = {
        "role": "assistant",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
        ],
    }
    assert message_tool_fields("messages[1]", message)["tool_calls"][0]["function"][
        "arguments"
    ] == {"x": 1}
    assert message_tool_fields("messages[2]", {"role": "tool", "tool_call_id": "c1"}) == {
        "tool_call_id": "c1"
    }
    with pytest.raises(HttpError, match="messages\\[1\\].tool_calls\\[0\\].function.arguments"):
        message_tool_fields(
            "messages[1]", {"tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}
        )


def test_each_structured_field_is_read_and_text_is_free():
    assert structured_grammar({"response_format": {"type": "text"}}) is None
    assert structured_grammar({}) is None
    for body, field in [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs.json"),
        ({"guided_json": '{"type": "object"}'}, "guided_json"),
        ({"guided_grammar": 'start: "a"'}, "guided_grammar"),
        ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object"),
    ]:
        asked, grammar = structured_grammar(body)
        assert asked == field and grammar
    with pytest.raises(HttpError, match="structured_outputs.xml is not supported"):
        structured_grammar({"structured_outputs": {"xml": "<a/>"}})
