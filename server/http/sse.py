"""Server-sent events as the OpenAI API frames them: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

import orjson

DONE = b"data: [DONE]\n\n"
# scope["extensions"] key: drops the connection now (http/guard.py)
ABORT_EXTENSION = "sloserve.abort"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of tokens
MEDIA_TYPE = "text/event-stream"
_RAW_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    *((k.lower().encode(), v.encode()) for k, v in HEADERS.items()),
]


def event(payload: dict) -> bytes:
    """One SSE event carrying one JSON object (orjson: compact, no newline inside)."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class EventStream:
    """A 200 event stream as a bare ASGI response: each chunk is sent as soon as it is made.

    NOTE: not Starlette's StreamingResponse, which starts a task group and a second `receive`
    listener per response; `watcher` (already watching this request's `receive` for the
    disconnect, which aborts the request) goes on doing that until the stream ends.
    Back-pressure: the next chunk is made only once the last one was handed to the transport,
    which blocks while its buffer is full. `sending_since` says since when a send is blocked; the
    owner calls `stall()` past its limit (a client that stopped reading): the connection is
    dropped, the stream ends and `close` aborts the request. (No timer per send: one costs
    ~5 us, per token.)
    """

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        watcher: asyncio.Task,
        close: Callable[[], Awaitable[None]],
        on_stall: Callable[[], None] = lambda: None,
    ) -> None:
        self.body = body
        self.watcher = watcher
        self.close = close  # runs once the stream ends, however it ends (even before it started)
        self.on_stall = on_stall
        self.sending_since: float | None = None  # time.monotonic() when the send in progress began
        self.stalled = False
        self._scope: dict = {}
        self._task: asyncio.Task | None = None

    async def __call__(self, scope, receive, send) -> None:
        self._scope, self._task = scope, asyncio.current_task()
        try:
            await self._send(
                send, {"type": "http.response.start", "status": 200, "headers": _RAW_HEADERS}
            )
            async for chunk in self.body:
                await self._send(
                    send, {"type": "http.response.body", "body": chunk, "more_body": True}
                )
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except (OSError, _Stalled):  # the client went away mid-write, or stopped reading
            pass
        finally:
            self.watcher.cancel()
            with contextlib.suppress(Exception):
                await self.body.aclose()
            await self.close()

    async def _send(self, send: Callable[[dict], Awaitable[None]], message: dict) -> None:
        self.sending_since = time.monotonic()
        await send(message)
        self.sending_since = None
        if self.stalled:
            raise _Stalled

    def stall(self) -> None:
        """The client read nothing for too long: say why, drop its connection (the blocked send returns), end."""
        if self.stalled:
            return
        self.stalled = True
        self.on_stall()
        abort = self._scope.get("extensions", {}).get(ABORT_EXTENSION)
        if abort is not None:
            abort()
        elif self._task is not None:  # a server without the hook: end the response's task
            self._task.cancel()


class _Stalled(Exception):
    """The stream was stalled: end it."""
