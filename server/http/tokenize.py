"""/tokenize and /detokenize in vLLM's shapes: a prompt or chat messages -> token ids, and back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sloserve.http.errors import HttpError
from sloserve.http.schemas import render_messages


class Tokenization:
    """Token counts a client needs before it sends a request (to trim history, to price it)."""

    def __init__(self, frontend: Any, render: Callable[..., str]) -> None:
        self.frontend = frontend
        self.render = render

    def tokenize(self, body: dict) -> dict:
        """{prompt | messages, add_special_tokens, return_token_strs, ...}
        -> {count, max_model_len, tokens, token_strs}."""
        tokenizer = self.frontend.engine.tokenizer
        # chat: rendered as /v1/chat/completions would (the template writes <s>)
        if "messages" in body:
            text, special = (
                render_messages(body, self.render),
                _flag(body, "add_special_tokens", False),
            )
        elif isinstance(body.get("prompt"), str):
            text, special = body["prompt"], _flag(body, "add_special_tokens", True)
        else:
            raise HttpError(
                400, "send 'prompt' (a string) or 'messages' (a chat) to tokenize", param="prompt"
            )
        ids = tokenizer.encode(text, special)
        strs = (
            [tokenizer.id_to_token(i) for i in ids]
            if _flag(body, "return_token_strs", False)
            else None
        )
        return {
            "count": len(ids),
            "max_model_len": self._max_model_len(),
            "tokens": ids,
            "token_strs": strs,
        }

    def detokenize(self, body: dict) -> dict:
        """{tokens: [ids]} -> {prompt: text} (special tokens kept, as vLLM answers)."""
        tokenizer = self.frontend.engine.tokenizer
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise HttpError(400, "tokens must be a list of integer token ids", param="tokens")
        bad = next((t for t in ids if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise HttpError(
                400,
                f"tokens holds {bad}, outside this model's vocabulary [0, {tokenizer.vocab_size})",
                param="tokens",
            )
        return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}

    def _max_model_len(self) -> int | None:
        return int(self.frontend.engine.model_info.get("max_model_len") or 0) or None


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HttpError(400, f"{name} must be true or false, got {value!r}", param=name)
    return value
