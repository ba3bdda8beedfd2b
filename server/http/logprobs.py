"""Logprobs in OpenAI's two shapes: chat's `content` list and completions' parallel lists."""

from __future__ import annotations

from collections.abc import Callable

from sloserve.logprobs import Logprob


class LogprobFormat:
    """Renders Logprob entries with each token's text (decoded alone, special tokens kept)."""

    def __init__(self, decode: Callable[..., str]) -> None:
        self._decode = decode
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id], skip_special_tokens=False)
        return text

    def chat(self, entries: list[Logprob]) -> dict:
        """{"content": [{token, logprob, bytes, top_logprobs}, ...]} of chat completions."""
        return {
            "content": [
                {
                    **self._chat_entry(e.token_id, e.logprob),
                    "top_logprobs": [self._chat_entry(t, v) for t, v in e.top],
                }
                for e in entries
            ]
        }

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def completion(self, entries: list[Logprob | None], token_ids: list[int], offset: int) -> dict:
        """{tokens, token_logprobs, top_logprobs, text_offset} of completions, the text starting at
        `offset`; an entry None (a prompt's first token) has null logprobs. Each top_logprobs holds
        the chosen token and the top ones (as vLLM's)."""
        tokens, logprobs, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self.text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if entry is None:
                logprobs.append(None)
                tops.append(None)
                continue
            logprobs.append(entry.logprob)
            top = {self.text(t): v for t, v in entry.top}
            top.setdefault(text, entry.logprob)
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
