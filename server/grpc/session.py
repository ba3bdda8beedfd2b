"""One bidirectional Stream call: reads client commands, runs one pump task per live request."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError
from sloserve.convert import Failure, ParsedRequest, chunk_pb, error_pb, final_pb, from_pb
from sloserve.errors import InvalidRequestError
from sloserve.handlers import Undecodable
from sloserve.pb import serving_pb2 as pb

if TYPE_CHECKING:
    from sloserve.service import SloserveService

log = logging.getLogger(__name__)

_RECENT_IDS = 1024  # finished ids per stream whose late cancels are ignored, not errors


@dataclass(slots=True)
class _Live:
    """A request accepted on this stream: being tokenized, or (admitted) running in the engine."""

    engine_id: str
    task: asyncio.Task | None = None
    admitted: bool = False
    cancelled: bool = False  # the client cancelled it before it reached the engine


class StreamSession:
    """The state of one Stream call.

    Invariants: every accepted request id gets exactly one terminal message (Final or
    RequestError) on `out`; `None` on `out` means the stream is done; a `Failure` on `out` means
    the stream itself is broken (bytes that do not parse): the live requests get a RequestError
    each and the call ends with that failure's status. A request id is live from the moment its
    GenerateRequest is read (so a reused id is refused at once), although its text prompt is
    tokenized in a worker thread before it reaches the engine.
    """

    def __init__(self, service: SloserveService, context: grpc.aio.ServicerContext) -> None:
        self.service = service
        self.context = context
        self.prefix = uuid.uuid4().hex
        self.out: asyncio.Queue[pb.ServerMessage | Failure | None] = asyncio.Queue()
        self.live: dict[str, _Live] = {}  # client id -> its state
        self.recent: collections.OrderedDict[str, None] = collections.OrderedDict()

    async def read(self, request_iterator: AsyncIterator[pb.ClientMessage | Undecodable]) -> None:
        try:
            async for msg in request_iterator:
                if isinstance(msg, Undecodable):
                    self.out.put_nowait(Failure(grpc.StatusCode.INVALID_ARGUMENT, "undecodable", msg.message))
                    return
                kind = msg.WhichOneof("kind")
                if kind == "generate":
                    self.generate(msg.generate)
                elif kind == "cancel":
                    self.cancel(msg.cancel.request_id)
                else:
                    self.reject("", InvalidRequestError("empty ClientMessage: set generate or cancel"))
            # The client half-closed: let the live requests finish, then end the stream.
            while self.live:
                await asyncio.gather(*(entry.task for entry in list(self.live.values()) if entry.task),
                                     return_exceptions=True)
        except asyncio.CancelledError:
            raise
        except DecodeError as exc:  # registered without the lenient parsers of sloserve.handlers
            self.out.put_nowait(Failure(grpc.StatusCode.INVALID_ARGUMENT, "undecodable",
                                        Undecodable(pb.ClientMessage.DESCRIPTOR.full_name, str(exc)).message))
            return
        except Exception as exc:  # noqa: BLE001 - a broken read ends the stream, not the server
            log.info("stream read ended: %s", exc)
        self.out.put_nowait(None)

    def generate(self, req: pb.GenerateRequest) -> None:
        """Validate at once (bad fields, reused id, cheap limits); tokenize and admit in its pump."""
        arrival = time.monotonic()
        if req.request_id in self.live:
            self.reject(req.request_id, InvalidRequestError(
                f"request_id {req.request_id!r} is already live on this stream; use a new id"),
                reason="duplicate_id")
            return
        try:
            parsed = from_pb(req, max_tokens_limit=self.service.config.server.max_tokens_limit,
                             time_remaining=self.context.time_remaining())
            self.service._check_open()
            self.service._check_prompt(parsed.prompt)
        except Exception as exc:  # noqa: BLE001
            self.reject(req.request_id, exc)
            return
        self.recent.pop(req.request_id, None)
        entry = _Live(f"{self.prefix}:{req.request_id}")
        self.live[req.request_id] = entry
        entry.task = asyncio.create_task(self.pump(req.request_id, parsed, entry, arrival))

    def cancel(self, request_id: str) -> None:
        entry = self.live.get(request_id)
        if entry is not None:
            entry.cancelled = True
            if entry.admitted:
                self.service.engine.abort(entry.engine_id)  # its pump sends the Final
        elif request_id not in self.recent:
            self.reject(request_id, InvalidRequestError(
                f"cannot cancel {request_id!r}: no live request has that id on this stream"),
                reason="unknown_id")

    def reject(self, request_id: str, exc: BaseException, reason: str | None = None) -> None:
        failure = self.service._failure(exc)
        if reason is not None:
            failure.reason = reason
        self.out.put_nowait(error_pb(request_id, failure))

    async def pump(self, request_id: str, parsed: ParsedRequest, entry: _Live, arrival: float) -> None:
        terminal: pb.ServerMessage | None = None
        try:
            token_ids = await self.service._prompt_ids(parsed.prompt)
            if entry.cancelled:  # cancelled while its prompt was tokenized: it never reaches the engine
                out = _cancelled(len(token_ids), arrival)
                self.service._record(out)
                terminal = final_pb(request_id, out, arrival)
                return
            stream = self.service._admit(parsed, token_ids, entry.engine_id)
            entry.admitted = True
            async for out in stream:
                if out.new_token_ids or out.new_text:
                    self.out.put_nowait(chunk_pb(request_id, out, arrival))
                if out.finished:
                    if out.finish_reason == "error":
                        terminal = error_pb(request_id, self.service._output_failure(out))
                    else:
                        self.service._record(out)
                        terminal = final_pb(request_id, out, arrival)
                    break
            else:
                terminal = error_pb(request_id, self.service._failure(
                    RuntimeError("the engine ended the request without a finish reason")))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            terminal = error_pb(request_id, self.service._failure(exc))
        finally:
            if self.live.get(request_id) is entry:
                del self.live[request_id]
            self.recent[request_id] = None
            if len(self.recent) > _RECENT_IDS:
                self.recent.popitem(last=False)
            if entry.admitted:
                self.service._release()
            if terminal is not None:
                self.out.put_nowait(terminal)

    def fail_live(self, failure: Failure) -> list[pb.ServerMessage]:
        """Stop every live request (the stream broke, or shutdown); returns one RequestError for each."""
        errors = []
        for request_id in list(self.live):
            self._stop(self.live.pop(request_id))
            if self.service.metrics is not None:
                self.service.metrics.request_failed(failure.code, failure.reason)
            errors.append(error_pb(request_id, failure))
        return errors

    def abort_all(self) -> None:
        """The client is gone: abort every live request (frees its blocks) and stop the pumps."""
        for request_id in list(self.live):
            entry = self.live.pop(request_id)
            self._stop(entry)
            if entry.admitted and self.service.metrics is not None:
                self.service.metrics.request_done("cancelled")

    def _stop(self, entry: _Live) -> None:
        if entry.admitted:
            self.service.engine.abort(entry.engine_id)
        if entry.task is not None:
            entry.task.cancel()


def _cancelled(prompt_tokens: int, arrival: float) -> Any:
    """A RequestOutput-shaped record for a request cancelled before it reached the engine."""
    now = time.monotonic()
    return SimpleNamespace(finish_reason="cancelled", num_prompt_tokens=prompt_tokens, num_output_tokens=0,
                           num_cached_tokens=0, arrival_time=arrival, first_scheduled_time=None,
                           first_token_time=None, finish_time=now)
