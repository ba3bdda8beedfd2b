"""The transport-neutral front end: validation, tokenizing, in-flight accounting, drain, metrics.

Transports (sloserve.grpc, sloserve.http) adapt their messages to and from these plain types;
nothing here imports a transport. lifecycle.py runs the one engine client under both.
"""

from sloserve.frontend.failures import Failure, FailureCode, RequestFailed
from sloserve.frontend.frontend import Frontend, RequestHandle, ServerState
from sloserve.frontend.metrics import Metrics
from sloserve.frontend.requests import Event, Finished, ParsedRequest, Tokens

__all__ = [
    "Event",
    "Failure",
    "FailureCode",
    "Finished",
    "Frontend",
    "Metrics",
    "ParsedRequest",
    "RequestFailed",
    "RequestHandle",
    "ServerState",
    "Tokens",
]
