"""Chat messages -> one prompt, rendered with the checkpoint's Jinja chat template (as transformers does)."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from sloserve.errors import InvalidRequestError

NO_TEMPLATE = ("this model has no chat template: its tokenizer_config.json has no 'chat_template'; "
               "start the server with --chat-template FILE, or use /v1/completions with a prompt")


class ChatTemplate:
    """A compiled chat template with the special tokens it may refer to (bos_token, eos_token)."""

    def __init__(self, source: str, *, origin: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: date.today().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template from {origin} is not valid Jinja: {exc}") from None
        self.origin = origin
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_file(cls, path: str, model_folder: str | None = None) -> ChatTemplate:
        """--chat-template FILE (special tokens from the checkpoint's tokenizer_config.json if given)."""
        try:
            source = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read --chat-template {path!r}: {exc.strerror}") from None
        config = _tokenizer_config(model_folder) if model_folder else {}
        return cls(source, origin=path, bos_token=_token(config.get("bos_token")),
                   eos_token=_token(config.get("eos_token")))

    @classmethod
    def from_checkpoint(cls, model_folder: str) -> ChatTemplate | None:
        """The 'chat_template' of the folder's tokenizer_config.json; None when it has none."""
        config = _tokenizer_config(model_folder)
        source = config.get("chat_template")
        if isinstance(source, list):  # several named templates: the default one
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if not isinstance(source, str) or not source:
            return None
        return cls(source, origin=f"{model_folder}/tokenizer_config.json",
                   bos_token=_token(config.get("bos_token")), eos_token=_token(config.get("eos_token")))

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text; a template that raises (e.g. roles out of order) is the request's fault."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except _TemplateError as exc:
            raise InvalidRequestError(f"messages: the chat template refused them: {exc}") from None
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"messages: the chat template failed on them: {exc}") from None


class _TemplateError(Exception):
    pass


def _raise(message: str) -> None:
    raise _TemplateError(message)


def _tokenizer_config(folder: str) -> dict:
    path = Path(folder) / "tokenizer_config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _token(value: object) -> str:
    """tokenizer_config stores special tokens as strings or as {'content': ...} objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
