"""OpenAI `response_format` and vLLM's `structured_outputs` (and its older `guided_*` fields) -> one grammar.

At most one of them may constrain a request; each names its field in a 400 when it is wrong
(a malformed schema, one the grammar library rejects, a regex that can match nothing).
"""

from __future__ import annotations

from typing import Any

from sloserve.errors import InvalidRequestError
from sloserve.http.errors import HttpError
from sloserve.structured import grammar_for

# vLLM's structured_outputs keys (and the older top-level guided_* names) -> sloserve.structured kinds
_OUTPUT_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_grammar(body: dict) -> tuple[str, str] | None:
    """(the field that asked, its checked grammar), or None when the output is free text."""
    specs = []  # (field, kind, value)
    fmt = body.get("response_format")
    if fmt not in (None, {}):
        spec = _response_format(fmt)
        if spec is not None:
            specs.append(spec)
    outputs = body.get("structured_outputs")
    if outputs is not None:
        specs += _structured_outputs(outputs)
    specs += [
        (name, kind, body[name]) for name, kind in _GUIDED.items() if body.get(name) is not None
    ]
    if body.get("guided_json_object"):
        specs.append(("guided_json_object", "json_object", None))
    if not specs:
        return None
    if len(specs) > 1:
        raise HttpError(
            400,
            f"{', '.join(s[0] for s in specs)} each constrain the output: give only one of them",
            param=specs[1][0],
        )
    field, kind, value = specs[0]
    return field, grammar_in(field, kind, value)


def grammar_in(field: str, kind: str, value: Any) -> str:
    """grammar_for, its error a 400 naming `field`."""
    try:
        return grammar_for(kind, value)
    except InvalidRequestError as exc:
        raise HttpError(400, f"{field}: {exc}", param=field) from None


def _response_format(fmt: Any) -> tuple[str, str, Any] | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise _bad(
            "response_format", "must be an object with a type: text, json_object or json_schema"
        )
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", "json_object", None
    if kind != "json_schema":
        raise _bad(
            "response_format.type", f"must be text, json_object or json_schema, got {kind!r}"
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad(
            "response_format.json_schema",
            'is required with type json_schema: {"name": ..., "schema": {...}, "strict": true}',
        )
    schema = spec.get("schema", {"type": "object"})  # OpenAI: without a schema, any JSON object
    return "response_format.json_schema.schema", "json_schema", schema


def _structured_outputs(outputs: Any) -> list[tuple[str, str, Any]]:
    if not isinstance(outputs, dict):
        raise _bad(
            "structured_outputs",
            "must be an object with one of json, regex, choice, grammar, json_object",
        )
    known = {
        *_OUTPUT_KINDS,
        "json_object",
        "disable_any_whitespace",
        "disable_fallback",
        "disable_additional_properties",
        "whitespace_pattern",
        "structural_tag",
    }
    unknown = sorted(set(outputs) - known)
    if unknown:
        raise _bad(
            f"structured_outputs.{unknown[0]}",
            "is not supported; use json, regex, choice, grammar or json_object",
        )
    if outputs.get("structural_tag") is not None:
        raise _bad(
            "structured_outputs.structural_tag",
            "is not supported; use json, regex, choice or grammar",
        )
    specs = [
        (f"structured_outputs.{key}", kind, outputs[key])
        for key, kind in _OUTPUT_KINDS.items()
        if outputs.get(key) is not None
    ]
    if outputs.get("json_object"):
        specs.append(("structured_outputs.json_object", "json_object", None))
    if not specs:
        raise _bad(
            "structured_outputs",
            "names no constraint: give one of json, regex, choice, grammar, json_object",
        )
    return specs


def _bad(field: str, why: str) -> HttpError:
    return HttpError(400, f"{field} {why}", param=field)
