"""Why a request failed, in the front end's own terms; each transport maps FailureCode to its status."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from sloserve.errors import (
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    RequestRefusedError,
    UnknownAdapterError,
)


class FailureCode(enum.Enum):
    """What kind of failure; the value is the metrics outcome label."""

    INVALID_ARGUMENT = "invalid_argument"  # the request itself is wrong: change it
    NOT_FOUND = "not_found"  # it names a model (a LoRA adapter) that is not loaded
    RESOURCE_EXHAUSTED = "resource_exhausted"  # refused for load: retry later or elsewhere
    DEADLINE_EXCEEDED = "deadline_exceeded"  # its deadline passed before it could run
    # the server's state (loading, draining, dead engine): retry elsewhere
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"  # a bug or a device failure: not the client's to fix


@dataclass(slots=True)
class Failure:
    """A per-request failure: code, short label for metrics, message saying what to change."""

    code: FailureCode
    reason: str
    message: str
    # the server limit that refused it (sloserve_limit_refusals_total{limit})
    limit: str | None = None


class RequestFailed(Exception):
    """Raised in the front end (or an edge) with the code and reason it should be reported with."""

    def __init__(self, code: FailureCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


class LimitExceeded(RequestFailed):
    """Refused by one of the server's limits on input; `limit` names it (a flag's words, a metrics label)."""

    def __init__(
        self,
        limit: str,
        message: str,
        *,
        code: FailureCode = FailureCode.INVALID_ARGUMENT,
        reason: str | None = None,
    ) -> None:
        super().__init__(code, reason or limit, message)
        self.limit = limit


def failure_from_exception(exc: BaseException) -> Failure:
    """Map an engine or front-end exception to a Failure (INTERNAL if unknown)."""
    if isinstance(exc, LimitExceeded):
        return Failure(exc.code, exc.reason, str(exc), exc.limit)
    if isinstance(exc, RequestFailed):
        return Failure(exc.code, exc.reason, str(exc))
    if isinstance(exc, UnknownAdapterError):
        return Failure(FailureCode.NOT_FOUND, "model_not_found", str(exc))
    if isinstance(exc, ContextLengthError):
        return Failure(FailureCode.INVALID_ARGUMENT, "context_length_exceeded", str(exc))
    if isinstance(exc, InvalidRequestError):
        return Failure(FailureCode.INVALID_ARGUMENT, "invalid_argument", str(exc))
    if isinstance(exc, RequestRefusedError):
        return refusal(exc.reason, str(exc))
    if isinstance(exc, EngineDeadError):
        return Failure(
            FailureCode.UNAVAILABLE,
            "engine_dead",
            f"the engine is not running: {exc}; retry against a healthy replica",
        )
    if isinstance(exc, ValueError):  # e.g. a tokenizer refusing token ids out of the vocabulary
        return Failure(FailureCode.INVALID_ARGUMENT, "invalid_argument", str(exc))
    return Failure(FailureCode.INTERNAL, "internal", f"internal error: {type(exc).__name__}: {exc}")


def refusal(reason: str, message: str) -> Failure:
    """Admission refused: RESOURCE_EXHAUSTED with the reason (DEADLINE_EXCEEDED once the deadline passed)."""
    code = (
        FailureCode.DEADLINE_EXCEEDED
        if reason == "deadline_passed"
        else FailureCode.RESOURCE_EXHAUSTED
    )
    return Failure(code, reason, f"{message} (reason: {reason})")


def failure_from_output(out: Any) -> Failure:
    """The failure of a final RequestOutput with finish_reason 'error', from its error_kind."""
    kind = getattr(out, "error_kind", None)
    reason = getattr(out, "refusal_reason", None)
    if kind == "not_found":
        return Failure(FailureCode.NOT_FOUND, "model_not_found", out.error or "unknown model")
    if kind == "invalid":
        return Failure(
            FailureCode.INVALID_ARGUMENT, "invalid_argument", out.error or "invalid request"
        )
    if kind == "refused" or reason:  # outputs that predate error_kind carry only refusal_reason
        return refusal(reason or "refused", out.error or "refused by admission control")
    return Failure(
        FailureCode.INTERNAL,
        "internal",
        f"the engine failed this request: {out.error or 'unknown error'}",
    )
