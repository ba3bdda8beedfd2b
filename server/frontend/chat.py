"""Chat messages -> one prompt, rendered with a Jinja chat template the way transformers renders it.

What a template sees is what `apply_chat_template` gives it: `messages` (keys whose value is None
dropped), `tools`, `documents`, `add_generation_prompt`, the tokenizer's named special tokens
(`bos_token`, `eos_token`, ...) and the caller's extra variables (`chat_template_kwargs`), which
win over the special tokens. The environment matches too: a sandbox with trim_blocks and
lstrip_blocks, loop controls, `tojson(x, ensure_ascii=False, indent, separators, sort_keys)`,
`raise_exception(msg)`, `strftime_now(fmt)` and the `{% generation %}` tag (rendered as its body).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from sloserve.errors import InvalidRequestError

NO_TEMPLATE = (
    "this model has no chat template (none in chat_template.jinja, chat_template.json or "
    "tokenizer_config.json); start the server with --chat-template FILE, or use /v1/completions "
    "with a prompt"
)
# set by the request's fields
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# marks where the final message ends in the rendered text
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplate:
    """A compiled chat template with the special tokens it may refer to; `tool_use` for requests with tools."""

    def __init__(
        self,
        source: str,
        *,
        origin: str,
        special_tokens: dict[str, str] | None = None,
        tool_use: str | None = None,
    ) -> None:
        self.origin = origin
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile(source, origin)
        self._tool_use = _compile(tool_use, origin) if tool_use else None

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text; a template that raises (e.g. roles out of order) is the request's fault."""
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true: "
                "continue the last message, or start a new assistant one"
            )
        extra = template_kwargs or {}
        if clash := RESERVED & extra.keys():
            raise InvalidRequestError(
                f"chat_template_kwargs cannot set {', '.join(sorted(clash))}: "
                "use the request's own fields"
            )
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        final = None
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str):
                raise InvalidRequestError(
                    "continue_final_message needs a final message with text content"
                )
            messages[-1] = {**messages[-1], "content": final + _CONTINUE_TAG}
        template = self._tool_use if tools and self._tool_use is not None else self._template
        try:
            text = template.render(
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **extra},
            )
        except _TemplateRaised as exc:
            raise InvalidRequestError(f"messages: the chat template refused them: {exc}") from None
        except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError) as exc:
            raise InvalidRequestError(
                f"messages: the chat template failed on them: {exc}"
            ) from None
        return text if final is None else _cut_at_tag(text, final)


def _cut_at_tag(text: str, final: str) -> str:
    """The rendered text up to the end of the final message (the template's closing tokens cut off)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise InvalidRequestError(
            "continue_final_message: this chat template does not render the final "
            "message's content as it is, so it cannot be continued"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


class _TemplateRaised(jinja2.TemplateError):
    """raise_exception() called by the template."""


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} marks assistant text for training masks: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: plain json.dumps (no HTML escaping), its keyword arguments exposed."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile(source: str, origin: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template from {origin} is not valid Jinja: {exc}") from None
