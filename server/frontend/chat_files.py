"""Where a checkpoint keeps its chat template, read in transformers' order of precedence.

1. `chat_template.jinja` (transformers >= 4.43 saves it there), with named extras in
   `additional_chat_templates/*.jinja` (`tool_use` serves requests that carry tools);
2. `chat_template.json` (`{"chat_template": ...}`, the processor's file);
3. `tokenizer_config.json`'s `chat_template`: a string, or a list of `{name, template}`.
`--chat-template FILE` overrides all three; the special tokens come from the checkpoint either way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sloserve.frontend.chat import ChatTemplate

SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
EXTRA_DIR = "additional_chat_templates"


def template_from_checkpoint(folder: str) -> ChatTemplate | None:
    """The folder's chat template, or None when it has none."""
    root = Path(folder)
    tokens = special_tokens(folder)
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        tool_use = root / EXTRA_DIR / "tool_use.jinja"
        return ChatTemplate(
            _read(jinja),
            origin=str(jinja),
            special_tokens=tokens,
            tool_use=_read(tool_use) if tool_use.is_file() else None,
        )
    for name in ("chat_template.json", "tokenizer_config.json"):
        named = _named(_json(root / name).get("chat_template"))
        if named.get("default"):
            return ChatTemplate(
                named["default"],
                origin=str(root / name),
                special_tokens=tokens,
                tool_use=named.get("tool_use"),
            )
    return None


def template_from_file(path: str, model_folder: str | None = None) -> ChatTemplate:
    """--chat-template FILE: a Jinja file, or a JSON file with a 'chat_template' field."""
    try:
        source = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"cannot read --chat-template {path!r}: {getattr(exc, 'strerror', exc)}"
        ) from None
    if path.endswith(".json"):
        try:
            named = _named(json.loads(source).get("chat_template"))
        except (json.JSONDecodeError, AttributeError):
            named = {}
        if not named.get("default"):
            raise ValueError(f"--chat-template {path!r} is JSON without a 'chat_template' string")
        source = named["default"]
    tokens = special_tokens(model_folder) if model_folder else {}
    return ChatTemplate(source, origin=path, special_tokens=tokens)


def special_tokens(folder: str) -> dict[str, str]:
    """bos_token, eos_token, ... from tokenizer_config.json, else the legacy special_tokens_map.json."""
    root = Path(folder)
    config, legacy = _json(root / "tokenizer_config.json"), _json(root / "special_tokens_map.json")
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = _token(config.get(name)) or _token(legacy.get(name))
        if value:
            tokens[name] = value
    return tokens


def _named(value: Any) -> dict[str, str]:
    """A template string, or a list of {name, template}, as {name: template} ('default' for a string)."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {
            t["name"]: t["template"]
            for t in value
            if isinstance(t, dict)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str)
        }
    return {}


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the chat template {path}: {exc}") from None


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _token(value: object) -> str:
    """Special tokens are stored as strings or as {'content': ...} objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
