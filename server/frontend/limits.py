"""The server's limits on one request, checked once, before and after tokenizing."""

from __future__ import annotations

from sloserve.errors import InvalidRequestError
from sloserve.frontend.requests import ParsedRequest

MAX_CHARS_PER_TOKEN = 16  # no tokenizer averages more: longer texts are refused before tokenizing


class Limits:
    """max_tokens, prompt tokens and characters, top logprobs, choices and prompts per request;
    `max_model_len` 0: not known yet."""

    def __init__(self, *, max_tokens_limit: int, max_prompt_tokens: int | None, max_logprobs: int = 20,
                 max_n: int = 16, max_prompts: int = 64) -> None:
        self.max_tokens_limit = max_tokens_limit
        self.max_prompt_tokens = max_prompt_tokens
        self.max_logprobs = max_logprobs
        self.max_n = max_n
        self.max_prompts = max_prompts

    def check_request(self, parsed: ParsedRequest, max_model_len: int) -> None:
        """Cheap checks before any tokenizing: a prompt, max_tokens, characters or token ids."""
        prompt = parsed.prompt
        if not prompt:
            raise InvalidRequestError("prompt is empty: send some text or token ids")
        if parsed.params.max_tokens > self.max_tokens_limit:
            raise InvalidRequestError(f"max_tokens {parsed.params.max_tokens} is over this server's limit of "
                                      f"{self.max_tokens_limit}; ask for fewer")
        for name in ("logprobs", "prompt_logprobs"):
            wanted = getattr(parsed.params, name)
            if wanted is not None and wanted > self.max_logprobs:
                raise InvalidRequestError(f"{name} asks for {wanted} top log-probabilities, over this server's "
                                          f"limit of {self.max_logprobs} (--max-logprobs); ask for fewer")
        if parsed.n > self.max_n:
            raise InvalidRequestError(f"n {parsed.n} is over this server's limit of {self.max_n} choices (--max-n); "
                                      "ask for fewer")
        if isinstance(prompt, list):
            self.check_tokens(len(prompt))
        elif max_model_len and len(prompt) > max_model_len * MAX_CHARS_PER_TOKEN:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} characters, over this server's limit of "
                f"{max_model_len * MAX_CHARS_PER_TOKEN} ({MAX_CHARS_PER_TOKEN} per token of the model's "
                f"{max_model_len}-token context); shorten it")

    def check_prompts(self, count: int) -> None:
        """A batch's number of prompts against --max-prompts-per-request."""
        if count > self.max_prompts:
            raise InvalidRequestError(f"prompt holds {count} prompts, over this server's limit of {self.max_prompts} "
                                      "(--max-prompts-per-request); send fewer per request")

    def check_tokens(self, n: int) -> None:
        """The prompt's token count against --max-prompt-tokens."""
        limit = self.max_prompt_tokens
        if limit is not None and n > limit:
            raise InvalidRequestError(f"prompt has {n} tokens, over this server's limit of {limit}; shorten it")
