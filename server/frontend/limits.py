"""The server's limits on one request, checked once, before and after tokenizing."""

from __future__ import annotations

from sloserve.errors import InvalidRequestError
from sloserve.frontend.failures import LimitExceeded
from sloserve.frontend.requests import ParsedRequest

MAX_CHARS_PER_TOKEN = 16  # no tokenizer averages more: longer texts are refused before tokenizing
# the reason (error code) clients look for to trim history
CONTEXT_LENGTH = "context_length_exceeded"


class Limits:
    """max_tokens, prompt tokens and characters, top logprobs, choices, prompts per request and stop
    strings; `max_model_len` 0 means not known yet."""

    def __init__(
        self,
        *,
        max_tokens_limit: int,
        max_prompt_tokens: int | None,
        max_logprobs: int = 20,
        max_n: int = 16,
        max_prompts: int = 64,
        max_stop_strings: int = 16,
        max_stop_string_chars: int = 256,
        max_stop_token_ids: int = 64,
    ) -> None:
        self.max_tokens_limit = max_tokens_limit
        self.max_prompt_tokens = max_prompt_tokens
        self.max_logprobs = max_logprobs
        self.max_n = max_n
        self.max_prompts = max_prompts
        self.max_stop_strings = max_stop_strings
        self.max_stop_string_chars = max_stop_string_chars
        self.max_stop_token_ids = max_stop_token_ids

    def check_request(self, parsed: ParsedRequest, max_model_len: int) -> None:
        """Cheap checks before any tokenizing: a prompt, max_tokens, characters or token ids."""
        prompt = parsed.prompt
        if not prompt:
            raise InvalidRequestError("prompt is empty: send some text or token ids")
        if parsed.params.max_tokens > self.max_tokens_limit:
            raise LimitExceeded(
                "max_tokens",
                f"max_tokens {parsed.params.max_tokens} is over this server's "
                f"limit of {self.max_tokens_limit}; ask for fewer",
                reason="invalid_argument",
            )
        for name in ("logprobs", "prompt_logprobs"):
            wanted = getattr(parsed.params, name)
            if wanted is not None and wanted > self.max_logprobs:
                raise LimitExceeded(
                    "max_logprobs",
                    f"{name} asks for {wanted} top log-probabilities, over this "
                    f"server's limit of {self.max_logprobs} (--max-logprobs); ask for fewer",
                    reason="invalid_argument",
                )
        if parsed.n > self.max_n:
            raise LimitExceeded(
                "max_n",
                f"n {parsed.n} is over this server's limit of {self.max_n} choices "
                "(--max-n); ask for fewer",
                reason="invalid_argument",
            )
        self.check_stop_strings(parsed.params.stop)
        if len(parsed.params.stop_token_ids) > self.max_stop_token_ids:
            raise LimitExceeded(
                "max_stop_token_ids",
                f"stop_token_ids has {len(parsed.params.stop_token_ids)} ids, "
                f"over this server's limit of {self.max_stop_token_ids} (--max-stop-token-ids); "
                "send fewer",
                reason="invalid_argument",
            )
        if isinstance(prompt, list):
            self.check_tokens(len(prompt), max_model_len)
        elif max_model_len and len(prompt) > max_model_len * MAX_CHARS_PER_TOKEN:
            raise LimitExceeded(
                "prompt_chars",
                f"prompt has {len(prompt)} characters, over this server's limit of "
                f"{max_model_len * MAX_CHARS_PER_TOKEN} ({MAX_CHARS_PER_TOKEN} per token of the model's "
                f"{max_model_len}-token context). This model's maximum context length is {max_model_len} "
                "tokens; please reduce the length of the prompt or messages",
                reason=CONTEXT_LENGTH,
            )

    def check_stop_strings(self, stop: list[str]) -> None:
        """The stop strings' number and length against --max-stop-strings / --max-stop-string-chars."""
        if len(stop) > self.max_stop_strings:
            raise LimitExceeded(
                "max_stop_strings",
                f"stop has {len(stop)} strings, over this server's limit of "
                f"{self.max_stop_strings} (--max-stop-strings); send fewer",
                reason="invalid_argument",
            )
        longest = max(map(len, stop), default=0)
        if longest > self.max_stop_string_chars:
            raise LimitExceeded(
                "max_stop_string_chars",
                f"a stop string has {longest} characters, over this "
                f"server's limit of {self.max_stop_string_chars} (--max-stop-string-chars); shorten it",
                reason="invalid_argument",
            )

    def check_prompts(self, count: int) -> None:
        """A batch's number of prompts against --max-prompts-per-request."""
        if count > self.max_prompts:
            raise LimitExceeded(
                "max_prompts_per_request",
                f"prompt holds {count} prompts, over this server's "
                f"limit of {self.max_prompts} (--max-prompts-per-request); send fewer per request",
                reason="invalid_argument",
            )

    def check_tokens(self, n: int, max_model_len: int = 0) -> None:
        """The prompt's token count against --max-prompt-tokens and the context (room for one output token)."""
        limit = self.max_prompt_tokens
        if limit is not None and n > limit:
            raise LimitExceeded(
                "prompt_tokens",
                f"prompt has {n} tokens, over this server's limit of {limit} (--max-prompt-tokens). "
                f"This model's maximum context length is {limit} tokens for a prompt here; please reduce the "
                "length of the prompt or messages",
                reason=CONTEXT_LENGTH,
            )
        if max_model_len and n >= max_model_len:
            raise LimitExceeded(
                "context_length",
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt has {n} tokens, which leaves no room for the completion. Please reduce the length of the "
                "prompt or messages",
                reason=CONTEXT_LENGTH,
            )
