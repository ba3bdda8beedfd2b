"""The gRPC servicer: a thin adapter between sloserve.v1 messages and the front end."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from sloserve import __version__
from sloserve.errors import InvalidRequestError
from sloserve.frontend import Failure, FailureCode, Frontend, RequestHandle, Tokens
from sloserve.grpc.convert import STATUS, chunk_pb, final_pb, from_pb, info_pb
from sloserve.grpc.handlers import Undecodable
from sloserve.grpc.interceptors import end_call
from sloserve.grpc.session import StreamSession
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc


class SloserveService(pb_grpc.SloserveServicer):
    """Stream / Generate / Info over one front end; tracks open Streams for graceful drain."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self._sessions: set[StreamSession] = set()
        self._no_streams = asyncio.Event()
        self._no_streams.set()

    def close_streams(self) -> None:
        """End every open Stream with status OK; a request still live on one gets RequestError UNAVAILABLE."""
        failure = Failure(FailureCode.UNAVAILABLE, "shutdown", "the server shut down before this request "
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

    async def Stream(self, request_iterator: AsyncIterator[pb.ClientMessage | Undecodable], context) -> AsyncIterator[pb.ServerMessage]:
        session = StreamSession(self.frontend, context)
        self._sessions.add(session)
        self._no_streams.clear()
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            while (msg := await session.next_message()) is not None:
                if isinstance(msg, Failure):  # the stream itself is broken: end every request, then it
                    for error in session.fail_live(Failure(msg.code, msg.reason, "this request was ended "
                                                           f"because its stream broke: {msg.message}")):
                        yield error
                    await end_call(context, STATUS[msg.code], msg.message)
                    return
                yield msg
        finally:
            self._sessions.discard(session)
            if not self._sessions:
                self._no_streams.set()
            reader.cancel()
            session.abort_all()

    async def Generate(self, request: pb.GenerateRequest | Undecodable, context) -> AsyncIterator[pb.ServerMessage]:
        arrival = time.monotonic()  # the one arrival stamp: grpc has just read the request
        try:
            if isinstance(request, Undecodable):
                raise InvalidRequestError(request.message)
            parsed = from_pb(request, default_max_tokens=self.frontend.default_max_tokens,
                             time_remaining=context.time_remaining())
            self.frontend.check(parsed)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            failure = self.frontend.failure(exc)
            await end_call(context, STATUS[failure.code], failure.message)
            return
        handle = RequestHandle(f"g-{uuid.uuid4().hex}:{request.request_id}", arrival)
        async with contextlib.aclosing(self.frontend.run(handle, parsed)) as events:
            async for event in events:
                if isinstance(event, Tokens):
                    yield chunk_pb(request.request_id, event)
                elif isinstance(event, Failure):
                    await end_call(context, STATUS[event.code], event.message)
                    return
                else:
                    yield final_pb(request.request_id, event)

    async def Info(self, request: pb.InfoRequest | Undecodable, context) -> pb.InfoResponse:
        if isinstance(request, Undecodable):
            await end_call(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return pb.InfoResponse()  # only when the call was already over
        frontend = self.frontend
        return info_pb(frontend.config.model.path, dict(frontend.engine.model_info), frontend.engine.stats(),
                       frontend.state, version=__version__,
                       max_prompt_tokens=frontend.config.server.max_prompt_tokens,
                       max_tokens_limit=frontend.config.server.max_tokens_limit)
