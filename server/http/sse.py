"""Server-sent events as the OpenAI API frames them: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncGenerator, Awaitable, Callable

import orjson

DONE = b"data: [DONE]\n\n"
ABORT_EXTENSION = "sloserve.abort"  # scope["extensions"] key: drops the connection now (http/guard.py)
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
    Back-pressure: the next chunk is made only once the last one was handed to the transport,
    which blocks while its buffer is full; a send blocked `stall_s` (a client that stopped reading)
    ends the stream: `on_stall` says why, the connection is dropped and `close` aborts the request.
    """

    def __init__(self, body: AsyncGenerator[bytes, None], watcher: asyncio.Task,
                 close: Callable[[], Awaitable[None]], stall_s: float = math.inf,
                 on_stall: Callable[[], None] = lambda: None) -> None:
        self.body = body
        self.watcher = watcher
        self.close = close  # runs once the stream ends, however it ends (even before it started)
        self.stall_s = stall_s
        self.on_stall = on_stall

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self._send(send, {"type": "http.response.start", "status": 200, "headers": _RAW_HEADERS})
            async for chunk in self.body:
                await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": True})
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-write: the watcher has aborted the request
            pass
        except _Stalled:
            self.on_stall()
            abort = scope.get("extensions", {}).get(ABORT_EXTENSION)
            if abort is not None:  # drop the connection and what is buffered for it
                abort()
        finally:
            self.watcher.cancel()
            with contextlib.suppress(Exception):
                await self.body.aclose()
            await self.close()

    async def _send(self, send: Callable[[dict], Awaitable[None]], message: dict) -> None:
        try:
            async with asyncio.timeout(self.stall_s if math.isfinite(self.stall_s) else None):
                await send(message)
        except TimeoutError:
            raise _Stalled from None


class _Stalled(Exception):
    """A send stayed blocked past the stall limit: the client stopped reading."""
