"""The server's limits on one request, checked once, before and after tokenizing."""

from __future__ import annotations

from sloserve.errors import InvalidRequestError
from sloserve.frontend.failures import LimitExceeded
from sloserve.frontend.requests import ParsedRequest

MAX_CHARS_PER_TOKEN = 16  # no tokenizer averages more: longer texts are refused before tokenizing


class Limits:
    """max_tokens, prompt tokens and prompt characters; `max_model_len` 0 means not known yet."""

    def __init__(self, *, max_tokens_limit: int, max_prompt_tokens: int | None) -> None:
        self.max_tokens_limit = max_tokens_limit
        self.max_prompt_tokens = max_prompt_tokens

    def check_request(self, parsed: ParsedRequest, max_model_len: int) -> None:
        """Cheap checks before any tokenizing: a prompt, max_tokens, characters or token ids."""
        prompt = parsed.prompt
        if not prompt:
            raise InvalidRequestError("prompt is empty: send some text or token ids")
        if parsed.params.max_tokens > self.max_tokens_limit:
            raise LimitExceeded("max_tokens", f"max_tokens {parsed.params.max_tokens} is over this server's "
                                f"limit of {self.max_tokens_limit}; ask for fewer", reason="invalid_argument")
        if isinstance(prompt, list):
            self.check_tokens(len(prompt))
        elif max_model_len and len(prompt) > max_model_len * MAX_CHARS_PER_TOKEN:
            raise LimitExceeded(
                "prompt_chars", f"prompt has {len(prompt)} characters, over this server's limit of "
                f"{max_model_len * MAX_CHARS_PER_TOKEN} ({MAX_CHARS_PER_TOKEN} per token of the model's "
                f"{max_model_len}-token context); shorten it", reason="invalid_argument")

    def check_tokens(self, n: int) -> None:
        """The prompt's token count against --max-prompt-tokens."""
        limit = self.max_prompt_tokens
        if limit is not None and n > limit:
            raise LimitExceeded("prompt_tokens", f"prompt has {n} tokens, over this server's limit of {limit}; "
                                "shorten it", reason="invalid_argument")
