"""The gRPC servicer: a thin adapter between sloserve.v1 messages and the AsyncEngine."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from sloserve import __version__
from sloserve.config import SloserveConfig
from sloserve.convert import (
    Failure,
    ParsedRequest,
    chunk_pb,
    error_pb,
    failure_from_exception,
    failure_from_output,
    final_pb,
    from_pb,
    info_pb,
)
from sloserve.errors import InvalidRequestError
from sloserve.metrics import Metrics
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_RECENT_IDS = 1024  # finished ids per stream whose late cancels are ignored, not errors


class SloserveService(pb_grpc.SloserveServicer):
    """Stream / Generate / Info over one engine; tracks in-flight requests for graceful drain."""

    def __init__(self, engine: Any, config: SloserveConfig, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.draining = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._sessions: set[_StreamSession] = set()

    # ---- lifecycle -------------------------------------------------------------------------
    def start_draining(self) -> None:
        """Refuse new requests with UNAVAILABLE; live ones go on."""
        self.draining = True

    @property
    def inflight(self) -> int:
        return self._inflight

    def close_streams(self) -> None:
        """End every open Stream with status OK (after a drain), so stopping cancels no RPC."""
        for session in self._sessions:
            session.out.put_nowait(None)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    # ---- admission -------------------------------------------------------------------------
    def _admit(self, parsed: ParsedRequest, engine_id: str) -> Any:
        """Check service-level limits, then hand the request to the engine (raises on refusal)."""
        if self.draining:
            raise _Unavailable("draining", "the server is shutting down; retry on another replica")
        if not self.engine.ready:
            raise _Unavailable("not_ready", "the model is still loading; retry when health says SERVING")
        limit = self.config.server.max_prompt_tokens
        if limit is not None:
            n = len(parsed.prompt) if isinstance(parsed.prompt, list) else len(
                self.engine.tokenizer.encode(parsed.prompt))
            if n > limit:
                raise InvalidRequestError(
                    f"prompt has {n} tokens, over this server's limit of {limit}; shorten it")
        stream = self.engine.add_request(engine_id, parsed.prompt, parsed.params, parsed.slo)
        self._inflight += 1
        self._idle.clear()
        return stream

    def _release(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    def _output_failure(self, out: Any) -> Failure:
        failure = failure_from_output(out)
        if failure.code == grpc.StatusCode.INTERNAL:
            log.error("request %s failed: %s", out.request_id, failure.message)
        if self.metrics is not None:
            self.metrics.request_failed(failure.code, failure.reason)
        return failure

    def _failure(self, exc: BaseException) -> Failure:
        failure = _unavailable_failure(exc) or failure_from_exception(exc)
        if failure.code == grpc.StatusCode.INTERNAL:
            log.error("request failed: %s", failure.message, exc_info=exc)
        if self.metrics is not None:
            self.metrics.request_failed(failure.code, failure.reason)
        return failure

    # ---- RPCs ------------------------------------------------------------------------------
    async def Stream(self, request_iterator: AsyncIterator[pb.ClientMessage], context) -> AsyncIterator[pb.ServerMessage]:
        session = _StreamSession(self, context)
        self._sessions.add(session)
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            while (msg := await session.out.get()) is not None:
                yield msg
        finally:
            self._sessions.discard(session)
            reader.cancel()
            session.abort_all()

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.ServerMessage]:
        engine_id = f"g-{uuid.uuid4().hex}:{request.request_id}"
        arrival = time.monotonic()
        try:
            parsed = from_pb(request, max_tokens_limit=self.config.server.max_tokens_limit,
                             time_remaining=context.time_remaining())
            stream = self._admit(parsed, engine_id)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            failure = self._failure(exc)
            await context.abort(failure.code, failure.message)
            return
        finished = False
        try:
            async for out in stream:
                if out.new_token_ids or out.new_text:
                    yield chunk_pb(request.request_id, out, arrival)
                if out.finished:
                    finished = True
                    if out.finish_reason == "error":
                        failure = self._output_failure(out)
                        await context.abort(failure.code, failure.message)
                        return
                    self._record(out)
                    yield final_pb(request.request_id, out, arrival)
                    return
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            finished = True
            failure = self._failure(exc)
            await context.abort(failure.code, failure.message)
        finally:
            if not finished:  # client went away or deadline hit: free its blocks now
                self.engine.abort(engine_id)
                if self.metrics is not None:
                    self.metrics.request_done("cancelled")
            self._release()

    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        return info_pb(self.config.model.path, dict(self.engine.model_info), self.engine.stats(),
                       version=__version__, max_prompt_tokens=self.config.server.max_prompt_tokens,
                       max_tokens_limit=self.config.server.max_tokens_limit)

    def _record(self, out: Any) -> None:
        if self.metrics is not None:
            self.metrics.request_done(out.finish_reason or "unknown", out)


class _Unavailable(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _unavailable_failure(exc: BaseException) -> Failure | None:
    if isinstance(exc, _Unavailable):
        return Failure(grpc.StatusCode.UNAVAILABLE, exc.reason, str(exc))
    return None


class _StreamSession:
    """One bidirectional stream: reads commands, runs one pump task per live request.

    Invariant: every accepted request id gets exactly one terminal message (Final or
    RequestError) on `out`; `None` on `out` means the stream is done.
    """

    def __init__(self, service: SloserveService, context) -> None:
        self.service = service
        self.context = context
        self.prefix = uuid.uuid4().hex
        self.out: asyncio.Queue[pb.ServerMessage | None] = asyncio.Queue()
        self.live: dict[str, tuple[str, asyncio.Task]] = {}  # client id -> (engine id, pump)
        self.recent: collections.OrderedDict[str, None] = collections.OrderedDict()

    async def read(self, request_iterator: AsyncIterator[pb.ClientMessage]) -> None:
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "generate":
                    self.generate(msg.generate)
                elif kind == "cancel":
                    self.cancel(msg.cancel.request_id)
                else:
                    self.reject("", InvalidRequestError("empty ClientMessage: set generate or cancel"))
            # The client half-closed: let the live requests finish, then end the stream.
            while self.live:
                await asyncio.gather(*(task for _, task in list(self.live.values())),
                                     return_exceptions=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken read ends the stream, not the server
            log.info("stream read ended: %s", exc)
        self.out.put_nowait(None)

    def generate(self, req: pb.GenerateRequest) -> None:
        arrival = time.monotonic()
        if req.request_id in self.live:
            self.reject(req.request_id, InvalidRequestError(
                f"request_id {req.request_id!r} is already live on this stream; use a new id"),
                reason="duplicate_id")
            return
        engine_id = f"{self.prefix}:{req.request_id}"
        try:
            parsed = from_pb(req, max_tokens_limit=self.service.config.server.max_tokens_limit,
                             time_remaining=self.context.time_remaining())
            stream = self.service._admit(parsed, engine_id)
        except Exception as exc:  # noqa: BLE001
            self.reject(req.request_id, exc)
            return
        self.recent.pop(req.request_id, None)
        task = asyncio.create_task(self.pump(req.request_id, stream, arrival))
        self.live[req.request_id] = (engine_id, task)

    def cancel(self, request_id: str) -> None:
        if request_id in self.live:
            self.service.engine.abort(self.live[request_id][0])  # its pump sends the Final
        elif request_id not in self.recent:
            self.reject(request_id, InvalidRequestError(
                f"cannot cancel {request_id!r}: no live request has that id on this stream"),
                reason="unknown_id")

    def reject(self, request_id: str, exc: BaseException, reason: str | None = None) -> None:
        failure = self.service._failure(exc)
        if reason is not None:
            failure.reason = reason
        self.out.put_nowait(error_pb(request_id, failure))

    async def pump(self, request_id: str, stream: AsyncIterator[Any], arrival: float) -> None:
        terminal: pb.ServerMessage | None = None
        try:
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
            self.live.pop(request_id, None)
            self.recent[request_id] = None
            if len(self.recent) > _RECENT_IDS:
                self.recent.popitem(last=False)
            self.service._release()
            if terminal is not None:
                self.out.put_nowait(terminal)

    def abort_all(self) -> None:
        """The client is gone: abort every live request (frees its blocks) and stop the pumps."""
        for engine_id, task in list(self.live.values()):
            self.service.engine.abort(engine_id)
            task.cancel()
            if self.service.metrics is not None:
                self.service.metrics.request_done("cancelled")
