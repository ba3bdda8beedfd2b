"""Chat templates rendered as transformers renders them (its apply_chat_template is the oracle), found
wherever a checkpoint keeps one, and the request's chat fields passed through (no server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sloserve.errors import InvalidRequestError
from sloserve.frontend.chat_files import template_from_checkpoint, template_from_file
from sloserve.http.errors import HttpError
from sloserve.http.schemas import parse_chat
from sloserve.models.default import CHAT_TEMPLATE, TRAINED_DIR
from sloserve.tokenizer import save_byte_level_tokenizer

transformers = pytest.importorskip("transformers")

# Uses what Hub templates use: tojson with its keyword arguments, the generation tag, namespace,
# loop controls, raise_exception, tool calls and tool results, and a kwarg of the caller.
TOOLS_TEMPLATE = """{{- bos_token -}}
{%- if tools %}<tools>{{ tools | tojson(ensure_ascii=False, separators=(',', ':'), sort_keys=True) }}</tools>
{% endif -%}
{%- set ns = namespace(turns=0) -%}
{%- for message in messages -%}
{%- if message.role == 'system' and not loop.first %}{{ raise_exception('system must come first') }}{% endif -%}
{%- set ns.turns = ns.turns + 1 -%}
<|{{ message.role }}|>
{%- if message.role == 'assistant' -%}
{%- generation %}{{ message.content | default('', true) }}{% endgeneration -%}
{%- for call in message.tool_calls | default([]) -%}
<call>{{ call.function.name }}{{ call.function.arguments | tojson(indent=1) }}</call>
{%- endfor -%}
{%- elif message.role == 'tool' -%}
[{{ message.tool_call_id }}] {{ message.content }}
{%- else -%}
{{ message.content }}
{%- endif %}
{% if loop.index > 50 %}{% break %}{% endif -%}
{%- endfor -%}
{%- if enable_thinking is defined and not enable_thinking %}<no_think>{% endif -%}
{%- if add_generation_prompt %}<|assistant|>{% endif -%}
"""

CONVERSATION = [
    {"role": "system", "content": "tu es bref — «ok»"},
    {"role": "user", "content": "météo à Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": {"city": "Zürich"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12°C"},
    {"role": "assistant", "content": "Il fait 12°C"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "météo",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def checkpoint(folder: Path, template: str, where: str = "chat_template.jinja") -> Path:
    """A byte-level tokenizer folder that transformers loads, its chat template kept in `where`."""
    folder.mkdir(parents=True, exist_ok=True)
    save_byte_level_tokenizer(folder, 256)
    if where == "chat_template.jinja":
        (folder / where).write_text(template)
    elif where == "chat_template.json":
        (folder / where).write_text(json.dumps({"chat_template": template}))
    else:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(
            json.dumps({**config, "chat_template": template})
        )
    return folder


def oracle(folder: Path, messages: list[dict], **kw) -> str:
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    return tok.apply_chat_template(messages, tokenize=False, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        {"add_generation_prompt": True},
        {"add_generation_prompt": False, "tools": TOOLS},
        {"add_generation_prompt": True, "tools": TOOLS, "enable_thinking": False},
        {"add_generation_prompt": False, "continue_final_message": True},
    ],
    ids=["generation-prompt", "tools", "template-kwargs", "continue-final"],
)
def test_rendering_equals_transformers(tmp_path, kw):
    folder = checkpoint(tmp_path, TOOLS_TEMPLATE)
    expected = oracle(folder, CONVERSATION, **kw)
    mine = template_from_checkpoint(str(folder))
    extra = {
        k: v
        for k, v in kw.items()
        if k not in ("add_generation_prompt", "continue_final_message", "tools")
    }
    got = mine.render(
        CONVERSATION,
        add_generation_prompt=kw["add_generation_prompt"],
        continue_final_message=kw.get("continue_final_message", False),
        tools=kw.get("tools"),
        template_kwargs=extra,
    )
    assert got == expected
    assert "Zürich" in got and "12°C" in got  # tojson(ensure_ascii=False) keeps the text as it is


def test_the_built_in_template_equals_transformers_and_matches_the_training_format():
    conversation = [
        {"role": "user", "content": "12\n34"},
        {"role": "assistant", "content": "21\n43\n"},
        {"role": "user", "content": "Input:\n56\n78\nOutput:\n"},
    ]
    rendered = template_from_checkpoint(str(TRAINED_DIR)).render(conversation)
    assert rendered == oracle(TRAINED_DIR, conversation, add_generation_prompt=True)
    # tools/train_default.py: <s>, pairs "Input:\n<grid>Output:\n<grid>" a blank line apart, then the query
    assert rendered == "<s>Input:\n12\n34\nOutput:\n21\n43\n\nInput:\n56\n78\nOutput:\n"
    assert (TRAINED_DIR / "chat_template.jinja").read_text() == CHAT_TEMPLATE


@pytest.mark.parametrize(
    "where", ["chat_template.jinja", "chat_template.json", "tokenizer_config.json"]
)
def test_every_place_a_checkpoint_keeps_its_template(tmp_path, where):
    folder = checkpoint(tmp_path, "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}", where)
    assert (
        template_from_checkpoint(str(folder)).render([{"role": "user", "content": "x"}])
        == "<s>x</s>"
    )
    # the processor's file: AutoTokenizer does not read it, AutoProcessor does
    if where != "chat_template.json":
        assert oracle(folder, [{"role": "user", "content": "x"}]) == "<s>x</s>"


def test_the_jinja_file_wins_and_tool_use_serves_requests_with_tools(tmp_path):
    folder = checkpoint(tmp_path, "old", "tokenizer_config.json")
    (folder / "chat_template.jinja").write_text("new")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(
        "tools:{{ tools | length }}"
    )
    template = template_from_checkpoint(str(folder))
    assert template.render([{"role": "user", "content": "x"}]) == "new"
    assert template.render([{"role": "user", "content": "x"}], tools=TOOLS) == "tools:1"


def test_chat_template_flag_takes_jinja_or_json_with_the_checkpoints_tokens(tmp_path):
    folder = checkpoint(tmp_path / "ckpt", "unused")
    (tmp_path / "t.jinja").write_text("{{ eos_token }}{{ messages | length }}")
    (tmp_path / "t.json").write_text(json.dumps({"chat_template": "{{ bos_token }}json"}))
    assert (
        template_from_file(str(tmp_path / "t.jinja"), str(folder)).render([{"role": "user"}])
        == "</s>1"
    )
    assert template_from_file(str(tmp_path / "t.json"), str(folder)).render([]) == "<s>json"
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="without a 'chat_template'"):
        template_from_file(str(tmp_path / "bad.json"))


def test_continue_final_message_and_generation_prompt_exclude_each_other(tmp_path):
    template = template_from_checkpoint(str(checkpoint(tmp_path, TOOLS_TEMPLATE)))
    with pytest.raises(InvalidRequestError, match="cannot both be true"):
        template.render(CONVERSATION, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs cannot set messages"):
        template.render(CONVERSATION, template_kwargs={"messages": []})


def test_parse_chat_passes_the_chat_fields_and_tool_messages_through():
    seen = {}

    def render(messages, **options):
        seen.update(options, messages=messages)
        return "prompt"

    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    req = parse_chat(body, render, model="m", default_max_tokens=4096, slo=None)
    assert seen["continue_final_message"] is True and seen["add_generation_prompt"] is False
    assert seen["template_kwargs"] == {"enable_thinking": False}
    assert seen["messages"][1]["tool_calls"][0]["function"]["arguments"] == {
        "a": 1
    }  # JSON text -> object
    assert seen["messages"][2]["tool_call_id"] == "c1"
    assert req.parsed.params.max_tokens == 4096 and req.parsed.add_special_tokens is False
    bad = {
        "messages": [
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}
        ]
    }
    with pytest.raises(HttpError) as err:
        parse_chat(bad, render, model="m", default_max_tokens=1, slo=None)
    assert err.value.param == "messages[0].tool_calls[0].function.arguments"
    with pytest.raises(HttpError) as err:
        parse_chat(
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]},
            render,
            model="m",
            default_max_tokens=1,
            slo=None,
        )
    assert err.value.param == "chat_template_kwargs"
