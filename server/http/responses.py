"""The front end's events -> OpenAI completion and chat completion objects (and stream chunks)."""

from __future__ import annotations

import time
import uuid

from sloserve.frontend import Finished
from sloserve.http.tools import ToolStream, parse_calls

_FINISH = {"stop": "stop", "length": "length"}  # anything else ('cancelled') has no OpenAI name


class Shape:
    """How one request's responses look: completions (`text`) or chat (`message` / `delta`)."""

    def __init__(self, chat: bool, model: str, token_ids: bool = False, tools: bool = False) -> None:
        self.chat = chat
        self.tools = ToolStream() if tools else None  # chat with tools: `<tool_call>` blocks become tool_calls
        self.token_ids = token_ids  # vLLM's `return_token_ids` extension: each choice carries its ids
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def full(self, text: str, token_ids: list[int], done: Finished) -> dict:
        """The whole response of a request that was not streamed."""
        if self.chat:
            message = {"role": "assistant", "content": text}
            reason = finish_reason(done)
            if self.tools is not None:
                message["content"], calls = parse_calls(text)
                if calls:
                    message["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(done)}
        if self.token_ids:
            choice["token_ids"] = token_ids
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(done)}

    def first(self) -> dict | None:
        """Chat's opening chunk carries the role (completions have none)."""
        if not self.chat:
            return None
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def delta(self, text: str, token_ids: list[int]) -> dict:
        if self.tools is not None:
            text = self.tools.feed(text)
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        if self.token_ids:
            choice["token_ids"] = token_ids
        return self._chunk(choice)

    def last(self, done: Finished) -> dict:
        """The chunk with the finish reason."""
        if self.chat:
            delta, reason = {}, finish_reason(done)
            if self.tools is not None:
                rest = self.tools.finish()
                if rest:
                    delta["content"] = rest
                if self.tools.calls:
                    delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(self.tools.calls)]
                    reason = "tool_calls" if reason == "stop" else reason
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason(done)}
        return self._chunk(choice)

    def usage_chunk(self, done: Finished) -> dict:
        """stream_options.include_usage: a final chunk with no choices and the usage."""
        chunk = self._chunk(None)
        chunk["usage"] = usage(done)
        return chunk

    def _chunk(self, choice: dict | None) -> dict:
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": [] if choice is None else [choice]}


def finish_reason(done: Finished) -> str:
    return _FINISH.get(done.finish_reason, "stop")


def usage(done: Finished) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}
