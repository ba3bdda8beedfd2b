"""Run one checked completion over the front end: one JSON response, or an SSE stream of chunks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from sloserve.frontend import Failure, FailureCode, Frontend, RequestHandle, Tokens
from sloserve.http import sse
from sloserve.http.choices import respond_n
from sloserve.http.errors import STATUS, error_body, failure_response
from sloserve.http.responses import Shape
from sloserve.http.schemas import CompletionRequest
from sloserve.logs import Throttled
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

log = logging.getLogger(__name__)
_notices = Throttled(log)

SHUTDOWN = Failure(
    FailureCode.UNAVAILABLE,
    "shutdown",
    "the server shut down before this request finished "
    "(drain grace period over); retry it on another replica",
)


class Completions:
    """Requests of the HTTP edge in flight: each is aborted in the engine the moment its client goes.

    Invariants: every request gets exactly one outcome (a status with a JSON body, or a 200
    stream that ends in a finish chunk or an error event, then `data: [DONE]`); a stream's
    status line is sent only once its first token is there, so refusals (429, 504) keep their
    status. `live` holds every running request's handle until its response ends.
    """

    def __init__(self, frontend: Frontend, stall_s: float = 30.0) -> None:
        self.frontend = frontend
        self.stall_s = stall_s  # a stream whose client read nothing this long is aborted
        self.streams: set[sse.EventStream] = set()  # live event streams, watched for stalls
        self._stall_watch: asyncio.Task | None = None
        self.live: dict[str, RequestHandle] = {}  # engine id -> handle
        self.shutting_down = False

    def shut_down(self) -> None:
        """Grace is over: end every live request (each answers 503 'shutdown')."""
        self.shutting_down = True
        for handle in list(self.live.values()):
            self.frontend.cancel(handle)

    async def respond(
        self, request: Request, handle: RequestHandle, req: CompletionRequest, shape: Shape
    ) -> Response:
        if req.parsed.n > 1 or req.prompts:
            return await respond_n(
                self,
                handle,
                req,
                shape,
                shutdown=SHUTDOWN,
                watch=lambda cancel: asyncio.create_task(_disconnected(request.receive, cancel)),
            )
        events = self.frontend.run(handle, req.parsed)
        self.live[handle.engine_id] = handle
        watcher = asyncio.create_task(
            _disconnected(request.receive, lambda: self.frontend.cancel(handle))
        )
        streaming = False
        try:
            first = await anext(events)
            if isinstance(first, Failure):
                return failure_response(first, chat=shape.chat)
            if req.stream and isinstance(first, Tokens):
                streaming = True  # the stream owns the events and the watcher from here

                # the client went away: the front end aborts it in the engine
                async def close() -> None:
                    self.streams.discard(stream)
                    await events.aclose()
                    self.live.pop(handle.engine_id, None)

                stream = sse.EventStream(
                    self._stream(events, first, req, shape),
                    watcher,
                    close,
                    functools.partial(self._stalled, handle.engine_id),
                )
                self._watch(stream)
                return stream
            return await self._whole(events, first, req, shape)
        finally:
            if not streaming:
                watcher.cancel()
                await events.aclose()
                self.live.pop(handle.engine_id, None)

    def _watch(self, stream: sse.EventStream) -> None:
        """Watch a stream for a send blocked past the stall limit (one watcher task while any stream is live)."""
        self.streams.add(stream)
        if self._stall_watch is None or self._stall_watch.done():
            self._stall_watch = asyncio.create_task(self._watch_stalls())

    async def _watch_stalls(self) -> None:
        period = min(self.stall_s / 4, 1.0)
        while self.streams:
            await asyncio.sleep(period)
            now = time.monotonic()
            for stream in list(self.streams):
                since = stream.sending_since
                if since is not None and now - since > self.stall_s:
                    stream.stall()

    def _stalled(self, engine_id: str) -> None:
        _notices.log(
            logging.WARNING,
            "stall",
            "aborted request %s: its client read none of its stream for "
            "%g s (--http-stream-stall-timeout)",
            engine_id,
            self.stall_s,
        )
        if self.frontend.metrics is not None:
            self.frontend.metrics.limit_refused("http_stream_stall")

    async def _whole(
        self, events: AsyncIterator[Any], event: Any, req: CompletionRequest, shape: Shape
    ) -> Response:
        """Collect a request's tokens into one response (or a stream that ended before its first token)."""
        texts, ids, logprobs, prompt = [], [], [], None
        while isinstance(event, Tokens):
            texts.append(event.text)
            ids += event.token_ids
            logprobs += event.logprobs or ()
            if event.prompt_logprobs is not None:
                prompt = event
            event = await anext(events)
        if isinstance(event, Failure):
            return failure_response(event, chat=shape.chat)
        if self.shutting_down and event.finish_reason == "cancelled":
            return failure_response(SHUTDOWN)
        if req.stream:  # finished without a token (e.g. a stop token first)
            return StreamingResponse(
                _replay(shape, event, req), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS
            )
        return _json(
            shape.full("".join(texts), ids, event, logprobs if req.logprobs else None, prompt)
        )

    async def _stream(
        self, events: AsyncIterator[Any], first: Tokens, req: CompletionRequest, shape: Shape
    ) -> AsyncIterator[bytes]:
        opening = shape.first()
        head = sse.event(opening) if opening is not None else b""
        yield head + sse.event(shape.delta(first.text, first.token_ids, first))
        async for event in events:
            if isinstance(event, Tokens):
                yield sse.event(shape.delta(event.text, event.token_ids, event))
            elif isinstance(event, Failure):
                yield _error_event(event) + sse.DONE
            elif self.shutting_down and event.finish_reason == "cancelled":
                yield _error_event(SHUTDOWN) + sse.DONE
            else:
                tail = sse.event(shape.last(event))
                if req.include_usage:
                    tail += sse.event(shape.usage_chunk(event))
                yield tail + sse.DONE


async def _replay(shape: Shape, done: Any, req: CompletionRequest) -> AsyncIterator[bytes]:
    opening = shape.first()
    out = (sse.event(opening) if opening is not None else b"") + sse.event(shape.last(done))
    if req.include_usage:
        out += sse.event(shape.usage_chunk(done))
    yield out + sse.DONE


def _error_event(failure: Failure) -> bytes:
    return sse.event(error_body(STATUS[failure.code], failure.message, code=failure.reason))


def _json(payload: dict) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


def watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> asyncio.Task:
    """A task that calls on_disconnect if the client closes the connection (cancel it when answered)."""
    return asyncio.create_task(_disconnected(request.receive, on_disconnect))


async def _disconnected(receive: Callable, on_disconnect: Callable[[], None]) -> None:
    """Call on_disconnect when the client closes the connection before its response is sent."""
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return
