"""One bidirectional Stream call: reads client commands, runs one task per live request."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from sloserve.config import GrpcConfig
from sloserve.errors import InvalidRequestError
from sloserve.frontend import Failure, FailureCode, Frontend, ParsedRequest, RequestHandle, Tokens
from sloserve.grpc import limits
from sloserve.grpc.convert import chunk_pb, error_pb, final_pb, from_pb
from sloserve.grpc.handlers import Undecodable
from sloserve.pb import serving_pb2 as pb

log = logging.getLogger(__name__)

_RECENT_IDS = 1024  # finished ids per stream whose late cancels are ignored, not errors


@dataclass(slots=True)
class _Live:
    """A request accepted on this stream: being tokenized, or (admitted) running in the engine."""

    handle: RequestHandle
    task: asyncio.Task | None = None


class StreamSession:
    """The state of one Stream call, over the front end (it knows nothing of the servicer).

    Invariants: every accepted request id gets exactly one terminal message (Final or
    RequestError) on `out`; a message that starts no request (a duplicate live id, a cancel of an
    unknown id, an empty ClientMessage) is answered with a RequestError whose request_id is
    empty, so it never reads as a second terminal of a live id. `None` on `out` means the stream
    is done; a `Failure` on `out` means the stream itself is broken (bytes that do not parse):
    the live requests get a RequestError each and the call ends with that failure's status. A
    request id is live from the moment its GenerateRequest is read (so a reused id is refused at
    once), although its text prompt is tokenized in a worker thread before it reaches the engine.
    Its arrival is stamped when its message is read; all its times count from that stamp.

    At most one TokenChunk per request waits on `out`: tokens that arrive while the stream is
    still writing earlier messages join that waiting chunk (its time_s stays the first token's),
    so a slow client or a flood costs fewer, larger writes instead of an ever longer queue.

    Bounded memory: `out` holds at most `stream_queue` messages that answer the client's own
    messages (errors) plus one chunk and one terminal per live request (at most
    `max_requests_per_stream`): while it is full the reader reads nothing more, so HTTP/2 flow
    control stops the client's writes. A stream whose client stops reading then ends when its
    blocked write times out (the servicer's `--grpc-stream-stall-timeout`).
    """

    def __init__(
        self,
        frontend: Frontend,
        context: grpc.aio.ServicerContext,
        config: GrpcConfig | None = None,
    ) -> None:
        self.frontend = frontend
        self.context = context
        self.config = config or GrpcConfig()
        self.prefix = uuid.uuid4().hex
        self.out: asyncio.Queue[pb.ServerMessage | Failure | None] = asyncio.Queue()
        self._room = asyncio.Event()  # set while `out` has room for another message
        self._room.set()
        self.last_read = time.monotonic()  # when the client's last message was read
        self.ending: asyncio.Task | None = None  # the task that ends a stalled stream
        # client id -> its chunk queued on `out`
        self._waiting_chunks: dict[str, pb.ServerMessage] = {}
        self.live: dict[str, _Live] = {}  # client id -> its state
        self.recent: collections.OrderedDict[str, None] = collections.OrderedDict()

    async def read(self, request_iterator: AsyncIterator[pb.ClientMessage | Undecodable]) -> None:
        try:
            async for msg in request_iterator:
                # the one arrival stamp of a request read now
                arrival = self.last_read = time.monotonic()
                if isinstance(msg, Undecodable):
                    self.out.put_nowait(
                        Failure(FailureCode.INVALID_ARGUMENT, "undecodable", msg.message)
                    )
                    return
                kind = msg.WhichOneof("kind")
                if kind == "generate":
                    self.generate(msg.generate, arrival)
                elif kind == "cancel":
                    self.cancel(msg.cancel.request_id)
                else:
                    self.reject(
                        "", InvalidRequestError("empty ClientMessage: set generate or cancel")
                    )
                # back-pressure: read on once it drains
                if self.out.qsize() >= self.config.stream_queue:
                    self._room.clear()
                    await self._room.wait()
            # The client half-closed: let the live requests finish, then end the stream.
            while self.live:
                await asyncio.gather(
                    *(entry.task for entry in list(self.live.values()) if entry.task),
                    return_exceptions=True,
                )
        except asyncio.CancelledError:
            raise
        # registered without the lenient parsers of sloserve.grpc.handlers
        except DecodeError as exc:
            self.out.put_nowait(
                Failure(
                    FailureCode.INVALID_ARGUMENT,
                    "undecodable",
                    Undecodable(pb.ClientMessage.DESCRIPTOR.full_name, str(exc)).message,
                )
            )
            return
        except Exception as exc:  # noqa: BLE001 - a broken read ends the stream, not the server
            log.info("stream read ended: %s", exc)
        self.out.put_nowait(None)

    def generate(self, req: pb.GenerateRequest, arrival: float) -> None:
        """Check at once (id, reused id, stream and request limits); tokenize and admit in its task."""
        try:
            limits.check_request_id(req.request_id, self.config)
        except Exception as exc:  # noqa: BLE001 - answered without the id: it is not one to echo
            self.reject("", exc)
            return
        if req.request_id in self.live:
            self.reject(
                "",
                InvalidRequestError(
                    f"request_id {req.request_id!r} is already live on this stream; that request goes on "
                    "unaffected; use a new id"
                ),
                reason="duplicate_id",
            )
            return
        if len(self.live) >= self.config.max_requests_per_stream:
            self.reject(req.request_id, limits.too_many_requests(self.config))
            return
        try:
            parsed = from_pb(
                req,
                default_max_tokens=self.frontend.default_max_tokens,
                time_remaining=self.context.time_remaining(),
            )
            self.frontend.check(parsed)
        except Exception as exc:  # noqa: BLE001
            self.reject(req.request_id, exc)
            return
        self.recent.pop(req.request_id, None)
        entry = _Live(RequestHandle(f"{self.prefix}:{req.request_id}", arrival))
        self.live[req.request_id] = entry
        entry.task = asyncio.create_task(self._run(req.request_id, parsed, entry))

    def cancel(self, request_id: str) -> None:
        try:
            limits.check_request_id(request_id, self.config)
        except Exception as exc:  # noqa: BLE001 - answered without the id: it is not one to echo
            self.reject("", exc)
            return
        entry = self.live.get(request_id)
        if entry is not None:
            self.frontend.cancel(entry.handle)  # its task sends the Final
        elif request_id not in self.recent:
            self.reject(
                "",
                InvalidRequestError(
                    f"cannot cancel {request_id!r}: no live request has that id on this stream"
                ),
                reason="unknown_id",
            )

    def reject(self, request_id: str, exc: BaseException, reason: str | None = None) -> None:
        self.out.put_nowait(error_pb(request_id, self.frontend.failure(exc, reason)))

    async def _run(self, request_id: str, parsed: ParsedRequest, entry: _Live) -> None:
        """Forward the front end's events; the terminal one goes out after the id is no longer live."""
        terminal: pb.ServerMessage | None = None
        try:
            async with contextlib.aclosing(self.frontend.run(entry.handle, parsed)) as events:
                async for event in events:
                    if isinstance(event, Tokens):
                        self._put_tokens(request_id, event)
                    elif isinstance(event, Failure):
                        terminal = error_pb(request_id, event)
                    else:
                        terminal = final_pb(request_id, event)
        finally:
            if self.live.get(request_id) is entry:
                del self.live[request_id]
            self.recent[request_id] = None
            if len(self.recent) > _RECENT_IDS:
                self.recent.popitem(last=False)
            self._waiting_chunks.pop(request_id, None)  # a reused id must not join this chunk
            if terminal is not None:
                self.out.put_nowait(terminal)

    def _put_tokens(self, request_id: str, tokens: Tokens) -> None:
        waiting = self._waiting_chunks.get(request_id)
        if waiting is not None:
            waiting.chunk.token_ids.extend(tokens.token_ids)
            waiting.chunk.text += tokens.text
            return
        msg = chunk_pb(request_id, tokens)
        self._waiting_chunks[request_id] = msg
        self.out.put_nowait(msg)

    async def next_message(self) -> pb.ServerMessage | Failure | None:
        """The next message to write (a chunk taken here no longer accepts tokens); an idle Failure when
        the stream had no live request and no message for `stream_idle_s`."""
        msg = await self._next_or_idle()
        if self.out.qsize() < self.config.stream_queue:
            self._room.set()
        if isinstance(msg, pb.ServerMessage) and msg.HasField("chunk"):
            rid = msg.chunk.request_id
            if self._waiting_chunks.get(rid) is msg:
                del self._waiting_chunks[rid]
        return msg

    async def _next_or_idle(self) -> pb.ServerMessage | Failure | None:
        idle_s = self.config.stream_idle_s
        while idle_s > 0 and not self.live and self.out.empty():
            remaining = self.last_read + idle_s - time.monotonic()
            if remaining <= 0:
                return limits.idle(self.config)
            try:
                async with asyncio.timeout(remaining):
                    return await self.out.get()
            except TimeoutError:
                continue  # idle, or a request went live meanwhile: the loop's test tells which
        return await self.out.get()

    def drop_queued(self) -> None:
        """Forget every message not yet written (the stream is ending without writing them)."""
        while not self.out.empty():
            self.out.get_nowait()
        self._waiting_chunks.clear()

    def fail_live(self, failure: Failure) -> list[pb.ServerMessage]:
        """Stop every live request (the stream broke, or shutdown); returns one RequestError for each."""
        errors = []
        for request_id in list(self.live):
            self._stop(self.live.pop(request_id), counted=True)
            self.frontend.count_failure(failure)
            errors.append(error_pb(request_id, failure))
        return errors

    def abort_all(self) -> None:
        """The client is gone: abort every live request (frees its blocks) and stop its task."""
        for request_id in list(self.live):
            self._stop(self.live.pop(request_id), counted=False)

    def _stop(self, entry: _Live, *, counted: bool) -> None:
        if counted:
            self.frontend.stop(entry.handle)
        else:
            self.frontend.cancel(entry.handle)
        if entry.task is not None:
            entry.task.cancel()
