"""The gRPC edge's own limits (GrpcConfig): request ids, streams, requests per stream, stalls, idleness.

Each refusal names its limit and the flag that sets it; the limit is also the label it is
counted under in sloserve_limit_refusals_total.
"""

from __future__ import annotations

from sloserve.config import GrpcConfig
from sloserve.frontend import Failure, FailureCode
from sloserve.frontend.failures import LimitExceeded


def check_request_id(request_id: str, config: GrpcConfig) -> None:
    """A request_id is 1..max characters of printable ASCII; the error never echoes the id itself."""
    if len(request_id) > config.max_request_id_length:
        raise LimitExceeded(
            "request_id_length",
            f"request_id has {len(request_id)} characters, over this server's "
            f"limit of {config.max_request_id_length} (--grpc-max-request-id-length); use a "
            "shorter id",
        )
    if not (request_id.isascii() and request_id.isprintable()):
        raise LimitExceeded(
            "request_id_charset",
            "request_id must be printable ASCII (space to '~'); it holds "
            "a control or non-ASCII character",
        )


def too_many_requests(config: GrpcConfig) -> LimitExceeded:
    return LimitExceeded(
        "grpc_max_requests_per_stream",
        f"this stream already has "
        f"{config.max_requests_per_stream} live requests (--grpc-max-requests-per-stream); wait "
        "for one to end, or open another Stream",
        code=FailureCode.RESOURCE_EXHAUSTED,
    )


def too_many_streams(config: GrpcConfig) -> Failure:
    return Failure(
        FailureCode.RESOURCE_EXHAUSTED,
        "grpc_max_streams",
        f"this server already has "
        f"{config.max_streams} Stream and Generate calls open (--grpc-max-streams); close one, retry "
        "later or use another replica",
        "grpc_max_streams",
    )


def stalled(config: GrpcConfig) -> Failure:
    return Failure(
        FailureCode.RESOURCE_EXHAUSTED,
        "grpc_stream_stalled",
        f"the client read nothing from this "
        f"Stream for {config.stream_stall_s:g} s while messages waited to be written "
        "(--grpc-stream-stall-timeout); read the stream as you write to it",
        "grpc_stream_stalled",
    )


def idle(config: GrpcConfig) -> Failure:
    return Failure(
        FailureCode.UNAVAILABLE,
        "grpc_stream_idle",
        f"this Stream had no live request and no "
        f"message for {config.stream_idle_s:g} s (--grpc-stream-idle-timeout); open a new Stream "
        "when you have requests to send",
        "grpc_stream_idle",
    )
