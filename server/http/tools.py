"""Tool calling: `tools` and `tool_choice` in, Hermes/Qwen-style `<tool_call>` JSON out as `tool_calls`.

The chat template renders the tools; the model answers each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_choice` "required" or a named function is enforced by a grammar over exactly that form
(the arguments by the function's JSON schema); "auto" leaves the model free and parses what it
wrote; "none" renders the tools but parses nothing. Text that is not a well-formed call stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from sloserve.http.errors import HttpError
from sloserve.http.structured import grammar_in
from sloserve.structured import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass(slots=True)
class ToolRequest:
    """A chat request's tools (as the template takes them), its tool_choice, and the grammar that enforces it."""

    tools: list[dict]
    choice: str  # 'auto', 'required', 'none', or the name of the function to call
    grammar: str | None = None

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools and tool_choice (None when it has no tools); a bad one is a 400 naming it."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "needs tools: give the functions in `tools`")
        return None
    if not isinstance(tools, list):
        raise _bad("tools", 'must be a list of {"type": "function", "function": {...}} objects')
    clean = [_tool(i, t) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in clean]
    if len(set(names)) != len(names):
        raise _bad("tools", "name the same function twice: each function needs its own name")
    choice = _choice(choice, names)
    request = ToolRequest(clean, choice)
    if choice in ("auto", "none"):
        return request
    chosen = [t for t in clean if choice == "required" or t["function"]["name"] == choice]
    calls = {"anyOf": [_call_schema(t["function"]) for t in chosen], "x-guidance": JSON_OPTIONS}
    several = choice == "required" and body.get("parallel_tool_calls") is not False
    repeat = ' ("\\n" call)*' if several else ""
    lark = f'start: call{repeat}\ncall: "{OPEN}\\n" %json {json.dumps(calls)} "\\n{CLOSE}"\n'
    request.grammar = grammar_in("tools", "grammar", lark)
    return request


def message_tool_fields(field: str, message: dict) -> dict:
    """The tool fields of one chat message, as templates read them: an assistant's tool_calls (arguments
    as objects) and a tool result's tool_call_id."""
    out: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise _bad(f"{field}.tool_calls", "must be a list of tool calls")
        out["tool_calls"] = [_past_call(f"{field}.tool_calls[{i}]", c) for i, c in enumerate(calls)]
    if isinstance(message.get("tool_call_id"), str):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def parse_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole answer: no calls when any block is not a well-formed call."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = [_call_object(m.group(1)) for m in _CALL.finditer(text, start)]
    if not calls or any(c is None for c in calls):
        return text, []
    content = text[:start].strip()
    return content or None, calls


class ToolStream:
    """Streams content until a `<tool_call>` begins, then holds the rest back for `finish` to parse."""

    def __init__(self) -> None:
        self._text = ""  # held back: a possible start of OPEN, or everything from OPEN on
        self._calling = False
        self.calls: list[dict] = []

    def feed(self, text: str) -> str:
        """The content of `text` that can be sent now."""
        self._text += text
        if self._calling:
            return ""
        at = self._text.find(OPEN)
        if at >= 0:
            self._calling = True
            out, self._text = self._text[:at], self._text[at:]
            return out
        keep = next(
            (
                k
                for k in range(min(len(OPEN) - 1, len(self._text)), 0, -1)
                if self._text.endswith(OPEN[:k])
            ),
            0,
        )
        cut = len(self._text) - keep
        out, self._text = self._text[:cut], self._text[cut:]
        return out

    def finish(self) -> str:
        """The content still held back (the calls, if they parse, go to `calls` instead)."""
        rest, self._text = self._text, ""
        if not self._calling:
            return rest
        content, self.calls = parse_calls(rest)
        return "" if self.calls else rest


def _call_object(raw: str) -> dict | None:
    try:
        call = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call["name"], "arguments": arguments},
    }


def _call_schema(function: dict) -> dict:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _tool(index: int, tool: Any) -> dict:
    field = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise _bad(
            field, 'must be {"type": "function", "function": {"name": ..., "parameters": {...}}}'
        )
    function = tool.get("function")
    if (
        not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
        or not function["name"]
    ):
        raise _bad(f"{field}.function.name", "is required: a non-empty string")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", function["name"]):
        raise _bad(f"{field}.function.name", "must be 1-64 letters, digits, '_', '.' or '-'")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise _bad(f"{field}.function.parameters", "must be a JSON schema object")
        grammar_in(f"{field}.function.parameters", "json_schema", parameters)
    return {"type": "function", "function": function}


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "required", "none"):
            raise _bad(
                "tool_choice", f"must be auto, required, none or a named function, got {choice!r}"
            )
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise _bad(
            "tool_choice",
            'must be auto, required, none or {"type": "function", "function": {"name": ...}}',
        )
    if name not in names:
        raise _bad(
            "tool_choice.function.name", f"{name!r} is not among the tools ({', '.join(names)})"
        )
    return name


def _past_call(field: str, call: Any) -> dict:
    """An earlier assistant tool call, its arguments decoded to an object as chat templates expect."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _bad(
            field,
            'must be {"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}',
        )
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise _bad(f"{field}.function.arguments", "must be a JSON object (as text)") from None
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def _bad(field: str, why: str) -> HttpError:
    return HttpError(400, f"{field} {why}", param=field)
