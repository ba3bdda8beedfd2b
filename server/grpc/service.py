"""The gRPC servicer: a thin adapter between sloserve.v1 messages and the AsyncEngine."""

from __future__ import annotations

import asyncio
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
    failure_from_exception,
    failure_from_output,
    final_pb,
    from_pb,
    info_pb,
)
from sloserve.errors import InvalidRequestError
from sloserve.handlers import Undecodable
from sloserve.interceptors import end_call
from sloserve.metrics import Metrics
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.stream_session import StreamSession

log = logging.getLogger(__name__)

MAX_CHARS_PER_TOKEN = 16  # no tokenizer averages more: longer texts are refused before tokenizing


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
        self._sessions: set[StreamSession] = set()
        self._no_streams = asyncio.Event()
        self._no_streams.set()

    # ---- lifecycle -------------------------------------------------------------------------
    def start_draining(self) -> None:
        """Refuse new requests with UNAVAILABLE; live ones go on."""
        self.draining = True

    @property
    def inflight(self) -> int:
        return self._inflight

    def close_streams(self) -> None:
        """End every open Stream with status OK; a request still live on one gets RequestError UNAVAILABLE."""
        failure = Failure(grpc.StatusCode.UNAVAILABLE, "shutdown", "the server shut down before this request "
                          "finished (drain grace period over); retry it on another replica")
        for session in self._sessions:
            for error in session.fail_live(failure):
                session.out.put_nowait(error)
            session.out.put_nowait(None)

    async def wait_streams_closed(self, timeout: float) -> bool:
        """Wait until clients have closed every Stream; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._no_streams.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    # ---- admission -------------------------------------------------------------------------
    def _check_open(self) -> None:
        """Refuse with UNAVAILABLE while draining or before the model is loaded."""
        if self.draining:
            raise _Unavailable("draining", "the server is shutting down; retry on another replica")
        if not self.engine.ready:
            raise _Unavailable("not_ready", "the model is still loading; retry when health says SERVING")

    def _check_prompt(self, prompt: str | list[int]) -> None:
        """Cheap limits checked before any tokenizing: characters of a text, count of token ids."""
        if isinstance(prompt, list):
            self._check_tokens(len(prompt))
            return
        max_len = int(self.engine.model_info.get("max_model_len") or 0)
        if max_len and len(prompt) > max_len * MAX_CHARS_PER_TOKEN:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} characters, over this server's limit of "
                f"{max_len * MAX_CHARS_PER_TOKEN} ({MAX_CHARS_PER_TOKEN} per token of the model's "
                f"{max_len}-token context); shorten it")

    def _check_tokens(self, n: int) -> None:
        limit = self.config.server.max_prompt_tokens
        if limit is not None and n > limit:
            raise InvalidRequestError(f"prompt has {n} tokens, over this server's limit of {limit}; shorten it")

    async def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids; text is tokenized in a worker thread so the event loop keeps serving."""
        if isinstance(prompt, list):
            return prompt
        ids = await asyncio.to_thread(self.engine.tokenizer.encode, prompt)
        self._check_tokens(len(ids))
        return ids

    def _admit(self, parsed: ParsedRequest, token_ids: list[int], engine_id: str) -> Any:
        """Hand the tokenized request to the engine (raises on refusal); it is then in flight."""
        self._check_open()  # again: draining may have begun while the prompt was tokenized
        stream = self.engine.add_request(engine_id, token_ids, parsed.params, parsed.slo)
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
    async def Stream(self, request_iterator: AsyncIterator[pb.ClientMessage | Undecodable], context) -> AsyncIterator[pb.ServerMessage]:
        session = StreamSession(self, context)
        self._sessions.add(session)
        self._no_streams.clear()
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            while (msg := await session.out.get()) is not None:
                if isinstance(msg, Failure):  # the stream itself is broken: end every request, then it
                    for error in session.fail_live(Failure(msg.code, msg.reason, "this request was ended "
                                                           f"because its stream broke: {msg.message}")):
                        yield error
                    await end_call(context, msg.code, msg.message)
                    return
                yield msg
        finally:
            self._sessions.discard(session)
            if not self._sessions:
                self._no_streams.set()
            reader.cancel()
            session.abort_all()

    async def Generate(self, request: pb.GenerateRequest | Undecodable, context) -> AsyncIterator[pb.ServerMessage]:
        if isinstance(request, Undecodable):
            failure = self._failure(InvalidRequestError(request.message))
            await end_call(context, failure.code, failure.message)
            return
        engine_id = f"g-{uuid.uuid4().hex}:{request.request_id}"
        arrival = time.monotonic()
        try:
            parsed = from_pb(request, max_tokens_limit=self.config.server.max_tokens_limit,
                             time_remaining=context.time_remaining())
            self._check_open()
            self._check_prompt(parsed.prompt)
            token_ids = await self._prompt_ids(parsed.prompt)
            stream = self._admit(parsed, token_ids, engine_id)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            failure = self._failure(exc)
            await end_call(context, failure.code, failure.message)
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
                        await end_call(context, failure.code, failure.message)
                        return
                    self._record(out)
                    yield final_pb(request.request_id, out, arrival)
                    return
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            finished = True
            failure = self._failure(exc)
            await end_call(context, failure.code, failure.message)
        finally:
            if not finished:  # client went away or deadline hit: free its blocks now
                self.engine.abort(engine_id)
                if self.metrics is not None:
                    self.metrics.request_done("cancelled")
            self._release()

    async def Info(self, request: pb.InfoRequest | Undecodable, context) -> pb.InfoResponse:
        if isinstance(request, Undecodable):
            await end_call(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return pb.InfoResponse()  # only when the call was already over
        return info_pb(self.config.model.path, dict(self.engine.model_info), self.engine.stats(),
                       version=__version__, max_prompt_tokens=self.config.server.max_prompt_tokens,
                       max_tokens_limit=self.config.server.max_tokens_limit)

    def _record(self, out: Any) -> None:
        if self.metrics is not None:
            self.metrics.request_done(out.finish_reason or "unknown", out)


class _Unavailable(Exception):
    """Refused because of the server's state (draining, loading), not the request."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _unavailable_failure(exc: BaseException) -> Failure | None:
    if isinstance(exc, _Unavailable):
        return Failure(grpc.StatusCode.UNAVAILABLE, exc.reason, str(exc))
    return None
