"""Server-sent events as the OpenAI API frames them: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable

import orjson

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of tokens
MEDIA_TYPE = "text/event-stream"
_RAW_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                *((k.lower().encode(), v.encode()) for k, v in HEADERS.items())]


def event(payload: dict) -> bytes:
    """One SSE event carrying one JSON object (orjson: compact, no newline inside)."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class EventStream:
    """A 200 event stream as a bare ASGI response: each chunk is sent as soon as it is made.

    NOTE: not Starlette's StreamingResponse, which starts a task group and a second `receive`
    listener per response; `watcher` (already watching this request's `receive` for the
    disconnect, which aborts the request) goes on doing that until the stream ends.
    """

    def __init__(self, body: AsyncGenerator[bytes, None], watcher: asyncio.Task,
                 close: Callable[[], Awaitable[None]]) -> None:
        self.body = body
        self.watcher = watcher
        self.close = close  # runs once the stream ends, however it ends (even before it started)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _RAW_HEADERS})
            async for chunk in self.body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-write: the watcher has aborted the request
            pass
        finally:
            self.watcher.cancel()
            with contextlib.suppress(Exception):
                await self.body.aclose()
            await self.close()
