"""FailureCode -> HTTP status, and OpenAI's JSON error shape (the one place both are decided)."""

from __future__ import annotations

import orjson
from sloserve.frontend import Failure, FailureCode
from starlette.responses import Response

STATUS = {  # the one place a front-end failure becomes an HTTP status
    FailureCode.INVALID_ARGUMENT: 400,
    FailureCode.NOT_FOUND: 404,
    FailureCode.RESOURCE_EXHAUSTED: 429,
    FailureCode.DEADLINE_EXCEEDED: 504,
    FailureCode.UNAVAILABLE: 503,
    FailureCode.INTERNAL: 500,
}

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

RETRY_AFTER_S = 1  # a refusal for load: the queue turns over in about a second on any device
# Refusals a retry of the same request cannot fix: its objective cannot be met, or its deadline passed.
# NOTE: the official clients retry 429 and every 5xx (twice, after Retry-After) unless the response
# says `x-should-retry: false`; a retried request would come back with its clock restarted.
NO_RETRY_CODES = frozenset({"slo_unattainable", "deadline_passed", "deadline_exceeded"})
CONTEXT_LENGTH = "context_length_exceeded"


class HttpError(Exception):
    """An error answered before a request reached the front end (auth, JSON, a bad field)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict:
    """{"error": {message, type, param, code}} as the OpenAI API answers."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> Response:
    return Response(
        orjson.dumps(error_body(status, message, param=param, code=code)),
        status_code=status,
        headers=retry_headers(status, code),
        media_type="application/json",
    )


def retry_headers(status: int, code: str | None) -> dict[str, str]:
    """Whether and when a client should retry: x-should-retry: false where a retry cannot help
    (every 4xx but 429, and the refusals of NO_RETRY_CODES), Retry-After (+ -ms) where one can."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    if status == 413:  # the rest of the body is not read: end the connection, not wait for it
        headers["Connection"] = "close"
    if code in NO_RETRY_CODES or (400 <= status < 500 and status != 429):
        headers["x-should-retry"] = "false"
    elif status in (429, 503):
        headers["Retry-After"] = str(RETRY_AFTER_S)
        headers["retry-after-ms"] = str(RETRY_AFTER_S * 1000)
    return headers


def failure_response(failure: Failure, *, chat: bool = False) -> Response:
    """The response for a front-end Failure; its reason (e.g. the refusal reason) is the error code.
    A prompt too long for the context names the field to shorten, as OpenAI's API does."""
    param = ("messages" if chat else "prompt") if failure.reason == CONTEXT_LENGTH else None
    # a `model` naming no loaded LoRA adapter
    if failure.reason == "model_not_found":
        param = "model"
    return error_response(STATUS[failure.code], failure.message, param=param, code=failure.reason)


def http_error_response(exc: HttpError) -> Response:
    return error_response(exc.status, str(exc), param=exc.param, code=exc.code)
