"""Structured-output specs -> llguidance grammars: the text `SamplingParams.grammar` carries.

A spec is one of KINDS with its value (a JSON schema, a regex, a list of choices, a Lark or
GBNF grammar). `grammar_for` turns it into llguidance's grammar text and checks it once against
a byte-level tokenizer: a grammar that matches no byte string matches no token string either,
so a spec that compiles here never fails in the engine for want of a match. Checked grammars are
cached by spec, so a repeated schema costs one dictionary look-up.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance
from llguidance import LLMatcher
from sloserve.errors import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

# NOTE: compact separators with one space, as Python's json.dumps writes them: flexible whitespace
# lets a weak model wander through newlines forever; this form is what instruction-tuned models write.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

GRAMMAR_CHECK_CACHE = 256  # checked specs kept (each holds only its grammar text)


def grammar_for(kind: str, value: Any) -> str:
    """The checked llguidance grammar of one spec; InvalidRequestError says what is wrong with it."""
    if kind not in KINDS:
        raise InvalidRequestError(
            f"unknown structured output kind {kind!r}; use one of {', '.join(KINDS)}"
        )
    if kind == "json_object":
        value = {"type": "object"}
    if kind in ("json_schema", "json_object"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(value, dict | bool):
            raise InvalidRequestError(
                f"a JSON schema must be an object, got {type(value).__name__}"
            )
        # key order kept: properties are written in the order the schema lists them
        text = json.dumps(value)
    elif kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
        text = json.dumps(value)
    else:
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"a {kind} must be a non-empty string")
        text = value
    return _checked(kind, text)


@functools.lru_cache(maxsize=GRAMMAR_CHECK_CACHE)
def _checked(kind: str, text: str) -> str:
    if kind in ("json_schema", "json_object"):
        try:
            grammar = LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidRequestError(f"the JSON schema cannot be used: {exc}") from None
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(text)
    elif kind == "choice":
        grammar = LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in json.loads(text))
        )
    else:
        try:
            grammar = llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
        except ValueError as exc:
            raise InvalidRequestError(f"the grammar cannot be used: {exc}") from None
    check_grammar(grammar, what=_WHAT[kind])
    return grammar


_WHAT = {
    "json_schema": "the JSON schema",
    "json_object": "the JSON schema",
    "regex": "the regex",
    "choice": "the choices",
    "grammar": "the grammar",
}


def check_grammar(grammar: str, what: str = "the grammar") -> None:
    """Raise InvalidRequestError unless `grammar` compiles and can match at least one string."""
    matcher = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(f"{what} cannot be used: {_one_line(matcher.get_error())}")
    matcher.compute_bitmask()  # an empty language shows on its first mask
    if matcher.is_error():
        raise InvalidRequestError(f"{what} can match no text at all: no output could satisfy it")


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    from sloserve.tokenizer import byte_level_tokenizer

    return llguidance.LLTokenizer(byte_level_tokenizer().to_str(), n_vocab=259, eos_token=257)


def _one_line(message: str) -> str:
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return text[:400] or "rejected by the grammar compiler"


ARC_GRID_MAX_SIDE = 30  # ARC grids are 1x1 to 30x30


def arc_grid_lark(max_side: int = ARC_GRID_MAX_SIDE) -> str:
    """A Lark grammar of one ARC grid as the built-in model writes it: rows of digits, all one width, each
    ending in a newline (then EOS): one alternative per width, since a width must repeat exactly."""
    widths = " | ".join(f"/(?:[0-9]{{{k}}}\\n){{1,{max_side}}}/" for k in range(1, max_side + 1))
    return f"start: {widths}\n"


def arc_grid_grammar() -> str:
    """The checked llguidance grammar of one ARC grid (--arc-grid-grammar)."""
    return grammar_for("grammar", arc_grid_lark())
