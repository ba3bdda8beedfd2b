"""The front end's events -> OpenAI completion and chat completion objects (and stream chunks)."""

from __future__ import annotations

import copy
import time
import uuid

from sloserve.frontend import Finished, Tokens
from sloserve.http.logprobs import LogprobFormat
from sloserve.http.tools import ToolStream, parse_calls
from sloserve.logprobs import Logprob

_FINISH = {"stop": "stop", "length": "length"}  # anything else ('cancelled') has no OpenAI name


class Shape:
    """How one request's responses look: completions (`text`) or chat (`message` / `delta`)."""

    def __init__(
        self,
        chat: bool,
        model: str,
        token_ids: bool = False,
        logprobs: LogprobFormat | None = None,
        echo: str | list[str] | None = None,
        include_usage: bool = False,
        tools: bool = False,
    ) -> None:
        self.chat = chat
        # chat with tools: `<tool_call>` blocks become tool_calls
        self.tools = ToolStream() if tools else None
        # vLLM's `return_token_ids` extension: each choice carries its ids
        self.token_ids = token_ids
        self.logprobs = logprobs  # set when the request asked for logprobs
        # completions' echo: the prompt's text, put before the first text (a list of prompts: each one's)
        self._echoes = echo if isinstance(echo, list) else None
        self.echo = echo[0] if isinstance(echo, list) else echo
        self.include_usage = include_usage  # stream_options.include_usage: every chunk has `usage` (null till the last)
        self._offset = 0  # characters of completion text sent so far (completions' text_offset)
        self.index = 0  # the choice's index (n > 1: one Shape per choice, see for_choice)
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def full(
        self,
        text: str,
        token_ids: list[int],
        done: Finished,
        logprobs: list[Logprob] | None = None,
        prompt: Tokens | None = None,
    ) -> dict:
        """The whole response of a request that was not streamed (`prompt`: the event with its prompt
        logprobs, when echo asked for them)."""
        lp = self._logprobs(text, token_ids, logprobs, prompt)
        if self.chat:
            message = {"role": "assistant", "content": text}
            reason = finish_reason(done)
            if self.tools is not None:
                message["content"], calls = parse_calls(text)
                if calls:
                    message["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
            choice = self._choice("message", message, lp, reason)
        else:
            choice = self._choice("text", self._echoed(text), lp, finish_reason(done))
        if self.token_ids:
            choice["token_ids"] = token_ids
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(done),
        }

    def for_choice(self, index: int, prompt: int = 0) -> Shape:
        """A Shape of the same response for choice `index` of prompt `prompt` (its own echo and text offsets)."""
        shape = copy.copy(self)
        shape.index = index
        if self.tools is not None:  # each choice parses its own calls
            shape.tools = ToolStream()
        if self._echoes is not None:
            shape.echo = self._echoes[prompt]
        return shape

    def first(self) -> dict | None:
        """Chat's opening chunk carries the role (completions have none)."""
        if not self.chat:
            return None
        return self._chunk(self._choice("delta", {"role": "assistant", "content": ""}, None, None))

    def delta(self, text: str, token_ids: list[int], event: Tokens | None = None) -> dict:
        """A chunk of new text (`event`: the Tokens it came from, for its logprobs)."""
        lp = None if event is None else self._logprobs(text, token_ids, event.logprobs, event)
        if self.tools is not None:
            text = self.tools.feed(text)
        if self.chat:
            choice = self._choice("delta", {"content": text}, lp, None)
        else:
            choice = self._choice("text", self._echoed(text), lp, None)
        if self.token_ids:
            choice["token_ids"] = token_ids
        return self._chunk(choice)

    def _choice(self, key: str, body: object, lp: dict | None, reason: str | None) -> dict:
        """One entry of `choices`, its fields in OpenAI's order."""
        return {"index": self.index, key: body, "logprobs": lp, "finish_reason": reason}

    def _echoed(self, text: str) -> str:
        """The text, with echo's prompt before the first piece."""
        if self.echo is None:
            return text
        echo, self.echo = self.echo, None
        return echo + text

    def _logprobs(
        self, text: str, token_ids: list[int], logprobs: list[Logprob] | None, prompt: Tokens | None
    ) -> dict | None:
        """The choice's logprobs object for these tokens (completions: echo's prompt ones first)."""
        fmt = self.logprobs
        if fmt is None or logprobs is None:
            return None
        if self.chat:
            return fmt.chat(logprobs)
        entries, ids = list(logprobs), list(token_ids)
        if (
            prompt is not None
            and prompt.prompt_logprobs is not None
            and prompt.prompt_token_ids is not None
        ):
            entries, ids = [*prompt.prompt_logprobs, *entries], [*prompt.prompt_token_ids, *ids]
        out = fmt.completion(entries, ids, self._offset)
        self._offset += sum(len(t) for t in out["tokens"])
        return out

    def last(self, done: Finished) -> dict:
        """The chunk with the finish reason."""
        if self.chat:
            delta, reason = {}, finish_reason(done)
            if self.tools is not None:
                rest = self.tools.finish()
                if rest:
                    delta["content"] = rest
                if self.tools.calls:
                    delta["tool_calls"] = [
                        {"index": i, **call} for i, call in enumerate(self.tools.calls)
                    ]
                    reason = "tool_calls" if reason == "stop" else reason
            return self._chunk(self._choice("delta", delta, None, reason))
        return self._chunk(self._choice("text", "", None, finish_reason(done)))

    def usage_chunk(self, done: Finished) -> dict:
        """stream_options.include_usage: a final chunk with no choices and the usage."""
        chunk = self._chunk(None)
        chunk["usage"] = usage(done)
        return chunk

    def _chunk(self, choice: dict | None) -> dict:
        chunk = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [] if choice is None else [choice],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk


def finish_reason(done: Finished) -> str:
    return _FINISH.get(done.finish_reason, "stop")


def usage(done: Finished) -> dict:
    body = {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }
    if done.accepted_prediction_tokens is not None:
        body["completion_tokens_details"] = prediction_details([done])
    return body


def prediction_details(done: list[Finished]) -> dict:
    """OpenAI's completion_tokens_details of requests that sent a prediction."""
    return {
        "accepted_prediction_tokens": sum(d.accepted_prediction_tokens or 0 for d in done),
        "rejected_prediction_tokens": sum(d.rejected_prediction_tokens or 0 for d in done),
    }
