"""A request's objectives from the wire: x-slo-* headers (milliseconds), the body's `slo`, its timeout."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from sloserve.errors import InvalidRequestError
from sloserve.frontend import FailureCode, RequestFailed
from sloserve.http.errors import HttpError
from sloserve.sampling_params import SLO

HEADERS = {"ttft_s": "x-slo-ttft-ms", "tpot_s": "x-slo-tpot-ms", "e2e_s": "x-slo-e2e-ms"}
# The client's own timeout (seconds): the official OpenAI clients send x-stainless-timeout.
TIMEOUT_HEADERS = ("x-request-timeout", "x-stainless-timeout")


def slo_from_wire(headers: Mapping[str, str], body: Any) -> SLO | None:
    """Headers win over the body's `slo: {ttft_s, tpot_s, e2e_s}` field by field (a gateway sets them).

    The request's timeout becomes the e2e objective when none is given, as a gRPC deadline does.
    """
    values: dict[str, float | None] = dict.fromkeys(HEADERS)
    extension = body.get("slo") if isinstance(body, dict) else None
    if extension is not None:
        if not isinstance(extension, dict):
            raise HttpError(
                400, 'slo must be an object such as {"ttft_s": 0.5, "tpot_s": 0.05}', param="slo"
            )
        for name in HEADERS:
            if extension.get(name) is not None:
                values[name] = _seconds(extension[name], f"slo.{name}", 1.0)
    for name, header in HEADERS.items():
        if (text := headers.get(header)) is not None:
            values[name] = _seconds(text, header, 1e-3)
    if values["e2e_s"] is None:
        for header in TIMEOUT_HEADERS:
            if (text := headers.get(header)) is not None:
                timeout = _number(text, header)
                if timeout <= 0:
                    raise RequestFailed(
                        FailureCode.DEADLINE_EXCEEDED,
                        "deadline_exceeded",
                        f"the request's timeout ({header}: {text}) passed before it arrived",
                    )
                values["e2e_s"] = timeout
                break
    if all(v is None for v in values.values()):
        return None
    try:
        return SLO(**values)
    except InvalidRequestError as exc:
        raise HttpError(400, str(exc), param="slo") from None


def _seconds(value: Any, field: str, scale: float) -> float:
    number = _number(value, field) * scale
    if not number > 0:
        raise HttpError(400, f"{field} must be a positive number, got {value!r}", param=field)
    return number


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool):
        value = None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise HttpError(400, f"{field} must be a finite number, got {value!r}", param=field)
    return number
