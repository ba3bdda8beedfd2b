"""The gRPC servicer: a thin adapter between sloserve.v1 messages and the front end."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
from sloserve import __version__
from sloserve.config import GrpcConfig
from sloserve.errors import InvalidRequestError
from sloserve.frontend import Failure, FailureCode, Frontend, RequestHandle, Tokens
from sloserve.frontend.score import run_score
from sloserve.grpc import limits
from sloserve.grpc.adapters import adapter_call
from sloserve.grpc.convert import STATUS, chunk_pb, final_pb, from_pb, info_pb, slo_from_pb
from sloserve.grpc.handlers import Undecodable
from sloserve.grpc.interceptors import end_call
from sloserve.grpc.score import score_from_pb, score_pb
from sloserve.grpc.session import StreamSession
from sloserve.logs import Throttled
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class SloserveService(pb_grpc.SloserveServicer):
    """Stream / Generate / Info over one front end; tracks open Streams for graceful drain and their cap."""

    def __init__(self, frontend: Frontend, config: GrpcConfig | None = None) -> None:
        self.frontend = frontend
        self.config = config or GrpcConfig()
        self._warn = Throttled(log)
        self._sessions: set[StreamSession] = set()
        self._generates = 0  # Generate calls open
        self._no_streams = asyncio.Event()
        self._no_streams.set()

    def close_streams(self) -> None:
        """End every open Stream with status OK; a request still live on one gets RequestError UNAVAILABLE."""
        failure = Failure(
            FailureCode.UNAVAILABLE,
            "shutdown",
            "the server shut down before this request "
            "finished (drain grace period over); retry it on another replica",
        )
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

    async def Stream(
        self, request_iterator: AsyncIterator[pb.ClientMessage | Undecodable], context
    ) -> None:
        """Read client messages in one task, write server messages here (explicit writes, so that a write
        that cannot go out, to a client gone or not reading, is ours to end quietly)."""
        if await self._refused_for_calls(context):
            return
        session = StreamSession(self.frontend, context, self.config)
        self._sessions.add(session)
        self._no_streams.clear()
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            await self._serve(session)
            # stalled: its status goes out before the handler returns
            if session.ending is not None:
                await session.ending
        finally:
            self._sessions.discard(session)
            if not self._sessions:
                self._no_streams.set()
            reader.cancel()
            session.abort_all()

    async def _refused_for_calls(self, context: grpc.aio.ServicerContext) -> bool:
        """Refuse the call (RESOURCE_EXHAUSTED) when --grpc-max-streams Stream and Generate calls are open."""
        if len(self._sessions) + self._generates < self.config.max_streams:
            return False
        failure = limits.too_many_streams(self.config)
        self.frontend.limit_refused(failure.limit)
        self._warn.warning(
            "grpc_max_streams",
            "refusing calls: %d open (--grpc-max-streams)",
            len(self._sessions) + self._generates,
        )
        await end_call(context, STATUS[failure.code], failure.message)
        return True

    async def _serve(self, session: StreamSession) -> None:
        stalled = functools.partial(self._stalled, session)
        while (msg := await session.next_message()) is not None:
            # the stream itself is broken or idle: end every request, then it
            if isinstance(msg, Failure):
                await self._end(session, msg)
                return
            if not await self._write(session.context, msg, stalled):
                return

    async def _write(
        self, context: grpc.aio.ServicerContext, msg: pb.ServerMessage, stalled: Callable[[], None]
    ) -> bool:
        """Write one message; False when the call is over (client gone, or stalled and ended).

        A write still blocked after `stream_stall_s` (a client that reads nothing) calls `stalled`,
        which ends the call from a task of its own: the write is left pending, not cancelled, so
        that the status goes out after what is already on its way.
        """
        timer = asyncio.get_running_loop().call_later(self.config.stream_stall_s, stalled)
        try:
            await context.write(msg)
            return True
        except Exception as exc:  # noqa: BLE001 - ExecuteBatchError, AbortError: the call is over
            log.info("call from %s ended: %s", context.peer(), type(exc).__name__)
            return False
        finally:
            timer.cancel()

    def _stalled(self, session: StreamSession) -> None:
        self._warn.warning(
            "grpc_stream_stalled",
            "ending a Stream whose client reads nothing (%s)",
            session.context.peer(),
        )
        session.drop_queued()
        # should the blocked write go out after all, nothing follows it
        session.out.put_nowait(None)
        session.ending = asyncio.create_task(
            self._end(session, limits.stalled(self.config), write=False)
        )

    async def _end(self, session: StreamSession, failure: Failure, *, write: bool = True) -> None:
        """End the call with `failure`'s status; each live request first gets a RequestError (if `write`)."""
        if failure.limit is not None:
            self.frontend.limit_refused(failure.limit)
        errors = session.fail_live(
            Failure(
                failure.code,
                failure.reason,
                f"this request was ended because its stream broke: {failure.message}",
            )
        )
        stalled = functools.partial(self._stalled, session)
        for error in errors if write else ():
            if not await self._write(session.context, error, stalled):
                return
        await _abort(session.context, failure)

    async def Generate(self, request: pb.GenerateRequest | Undecodable, context) -> None:
        arrival = time.monotonic()  # the one arrival stamp: grpc has just read the request
        if await self._refused_for_calls(context):
            return
        self._generates += 1
        try:
            await self._generate(request, context, arrival)
        finally:
            self._generates -= 1

    async def _generate(
        self, request: pb.GenerateRequest | Undecodable, context, arrival: float
    ) -> None:
        try:
            if isinstance(request, Undecodable):
                raise InvalidRequestError(request.message)
            limits.check_request_id(request.request_id, self.config)
            parsed = from_pb(
                request,
                default_max_tokens=self.frontend.default_max_tokens,
                time_remaining=context.time_remaining(),
            )
            self.frontend.check(parsed)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            failure = self.frontend.failure(exc)
            await end_call(context, STATUS[failure.code], failure.message)
            return
        ending: list[asyncio.Task] = []

        def stalled() -> None:
            failure = limits.stalled(self.config)
            self.frontend.limit_refused(failure.limit)
            self._warn.warning(
                "grpc_stream_stalled",
                "ending a Generate call whose client reads nothing (%s)",
                context.peer(),
            )
            ending.append(asyncio.create_task(_abort(context, failure)))

        handle = RequestHandle(f"g-{uuid.uuid4().hex}:{request.request_id}", arrival)
        async with contextlib.aclosing(self.frontend.run(handle, parsed)) as events:
            async for event in events:
                if isinstance(event, Failure):
                    await end_call(context, STATUS[event.code], event.message)
                    return
                msg = (
                    chunk_pb(request.request_id, event)
                    if isinstance(event, Tokens)
                    else final_pb(request.request_id, event)
                )
                if not await self._write(context, msg, stalled):
                    break
        for task in ending:
            await task

    async def Info(self, request: pb.InfoRequest | Undecodable, context) -> pb.InfoResponse:
        if isinstance(request, Undecodable):
            await end_call(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return pb.InfoResponse()  # only when the call was already over
        frontend = self.frontend
        return info_pb(
            frontend.config.model.path,
            dict(frontend.engine.model_info),
            frontend.engine.stats(),
            frontend.state,
            version=__version__,
            max_prompt_tokens=frontend.config.server.max_prompt_tokens,
            max_tokens_limit=frontend.config.server.max_tokens_limit,
        )

    async def Score(self, request: pb.ScoreRequest | Undecodable, context) -> pb.ScoreResponse:
        """Candidates of one prompt scored on its shared blocks (frontend/score.py); a cancelled
        call aborts every candidate still in the engine."""
        arrival = time.monotonic()
        frontend = self.frontend
        try:
            if isinstance(request, Undecodable):
                raise InvalidRequestError(request.message)
            frontend.check_open()
            call = score_from_pb(request, frontend.limits.max_logprobs)
            slo = slo_from_pb(request.slo, context.time_remaining())
            engine_id = f"g-{uuid.uuid4().hex}:{request.request_id[:128]}"
            outcome = await run_score(frontend, engine_id, arrival, call, slo)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            outcome = frontend.failure(exc)
        if isinstance(outcome, Failure):
            await end_call(context, STATUS[outcome.code], outcome.message)
            return pb.ScoreResponse()  # only when the call was already over
        return score_pb(*outcome)

    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest | Undecodable, context
    ) -> pb.AdapterResponse:
        """A LoRA adapter loaded while serving (grpc/adapters.py)."""
        return await self._adapter(request, context)

    async def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest | Undecodable, context
    ) -> pb.AdapterResponse:
        """A LoRA adapter unloaded, its requests in flight refusing, draining or aborted."""
        return await self._adapter(request, context)

    async def _adapter(self, request, context) -> pb.AdapterResponse:
        if isinstance(request, Undecodable):
            outcome = (grpc.StatusCode.INVALID_ARGUMENT, request.message)
        else:
            try:
                self.frontend.check_open()
                outcome = await adapter_call(self.frontend.engine, request)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                failure = self.frontend.failure(exc)
                outcome = (STATUS[failure.code], failure.message)
        if isinstance(outcome, tuple):
            await end_call(context, *outcome)
            return pb.AdapterResponse()  # only when the call was already over
        return outcome


async def _abort(context: grpc.aio.ServicerContext, failure: Failure) -> None:
    """End the call with `failure`'s status, from any task (end_call's AbortError is the handler's, not ours)."""
    try:
        await end_call(context, STATUS[failure.code], failure.message)
    except grpc.aio.AbortError:
        pass  # the status is on its way (after what the client has not read yet)
