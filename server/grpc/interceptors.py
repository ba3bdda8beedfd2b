"""Server interceptors: bearer-token auth (health probes exempt), and exceptions turned into statuses."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from sloserve.frontend.bearer import bearer_matches
from sloserve.frontend.failures import failure_from_exception
from sloserve.grpc.convert import STATUS

log = logging.getLogger(__name__)

_KINDS = {  # (request_streaming, response_streaming) -> (handler factory, behaviour attribute)
    (False, False): (grpc.unary_unary_rpc_method_handler, "unary_unary"),
    (False, True): (grpc.unary_stream_rpc_method_handler, "unary_stream"),
    (True, False): (grpc.stream_unary_rpc_method_handler, "stream_unary"),
    (True, True): (grpc.stream_stream_rpc_method_handler, "stream_stream"),
}


async def end_call(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """context.abort(code, message); when the call is already over (deadline passed, client gone) return quietly.

    Raises grpc.aio.AbortError like abort when the status goes out; callers return right after.
    """
    try:
        await context.abort(code, message)
    except grpc.aio.AbortError:
        raise
    except Exception as exc:  # noqa: BLE001 - ExecuteBatchError/UsageError: nobody is left to tell
        log.info("status %s not sent, the call is already over: %s", code.name, exc)


def _rebuild(handler: grpc.RpcMethodHandler, behaviour: Callable) -> grpc.RpcMethodHandler:
    """The same kind of handler with another behaviour and the original (de)serializers."""
    factory, _ = _KINDS[(handler.request_streaming, handler.response_streaming)]
    return factory(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _behaviour(handler: grpc.RpcMethodHandler) -> Callable:
    return getattr(handler, _KINDS[(handler.request_streaming, handler.response_streaming)][1])


HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"


class _HandlerInterceptor(grpc.aio.ServerInterceptor):
    """Replaces the handler of each call with `wrap(handler, details)`; an unknown method passes through."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        return self.wrap(handler, details)

    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        raise NotImplementedError


class AuthInterceptor(_HandlerInterceptor):
    """Rejects every call without `authorization: Bearer <token>` with UNAUTHENTICATED.

    The standard health service is exempt: Kubernetes gRPC probes (and grpc_health_probe) cannot
    send metadata, and health answers reveal nothing but SERVING / NOT_SERVING.
    """

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("auth token must not be empty")
        self._token = token

    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        got = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        if isinstance(got, str) and bearer_matches(got, self._token):
            return handler
        message = (
            "missing bearer token: send metadata 'authorization: Bearer <token>'"
            if got is None
            else "wrong bearer token: check the token given to the server with --auth-token"
        )

        if handler.response_streaming:

            async def deny_stream(request: Any, context: grpc.aio.ServicerContext):
                await end_call(context, grpc.StatusCode.UNAUTHENTICATED, message)
                return
                yield  # pragma: no cover - makes this an async generator

            return _rebuild(handler, deny_stream)

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await end_call(context, grpc.StatusCode.UNAUTHENTICATED, message)

        return _rebuild(handler, deny)


class ExceptionInterceptor(_HandlerInterceptor):
    """Turns an exception escaping a handler into its status code (INTERNAL if unknown) and logs it."""

    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        inner = _behaviour(handler)
        method = details.method

        async def fail(context: grpc.aio.ServicerContext, exc: Exception) -> None:
            failure = failure_from_exception(exc)
            log.error("%s failed: %s", method, failure.message, exc_info=exc)
            await end_call(context, STATUS[failure.code], failure.message)

        if inspect.isasyncgenfunction(inner):

            async def wrapped_stream(request: Any, context: grpc.aio.ServicerContext):
                try:
                    async for item in inner(request, context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    await fail(context, exc)

            return _rebuild(handler, wrapped_stream)

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                result = inner(request, context)
                return await result if inspect.isawaitable(result) else result
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001
                await fail(context, exc)

        return _rebuild(handler, wrapped)
