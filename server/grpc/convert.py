"""Protobuf <-> engine conversions for the gRPC service (protobuf types stop here)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import grpc
from sloserve.errors import EngineDeadError, InvalidRequestError, RequestRefusedError
from sloserve.pb import serving_pb2 as pb
from sloserve.sampling_params import SLO, SamplingParams

DEFAULT_MAX_TOKENS = 64

_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
}

_STATS_FIELDS = (
    "waiting", "running", "kv_blocks_total", "kv_blocks_free", "kv_blocks_cached",
    "swap_blocks_total", "swap_blocks_free", "prompt_tokens_total", "prefix_hit_tokens_total",
    "generated_tokens_total", "preemptions_total", "step_time_s", "tokens_per_step",
    "requests_finished_total",
)


@dataclass(slots=True)
class ParsedRequest:
    """A validated GenerateRequest in engine terms."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    slo: SLO | None


@dataclass(slots=True)
class Failure:
    """A per-request failure: gRPC status, label for metrics, message saying what to change."""

    code: grpc.StatusCode
    reason: str
    message: str


def from_pb(
    req: pb.GenerateRequest, *, max_tokens_limit: int, time_remaining: float | None = None
) -> ParsedRequest:
    """Validate a GenerateRequest; raise InvalidRequestError with a message saying what to change.

    `time_remaining` (seconds left on the call's gRPC deadline) becomes the e2e SLO when the
    request gives none.
    """
    if not req.request_id:
        raise InvalidRequestError("request_id must be a non-empty string chosen by the client")
    kind = req.WhichOneof("prompt")
    if kind == "text" and req.text:
        prompt: str | list[int] = req.text
    elif kind == "token_ids" and len(req.token_ids.ids) > 0:
        prompt = list(req.token_ids.ids)
    else:
        raise InvalidRequestError("prompt is empty: set text or token_ids to a non-empty value")
    max_tokens = req.max_tokens if req.HasField("max_tokens") else min(DEFAULT_MAX_TOKENS, max_tokens_limit)
    if max_tokens > max_tokens_limit:
        raise InvalidRequestError(
            f"max_tokens {max_tokens} is over this server's limit of {max_tokens_limit}; ask for fewer")
    s = req.sampling
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=s.temperature if s.HasField("temperature") else 0.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        seed=s.seed if s.HasField("seed") else None,
        stop_token_ids=list(s.stop_token_ids),
        stop=list(s.stop),
        ignore_eos=s.ignore_eos if s.HasField("ignore_eos") else False,
    )
    return ParsedRequest(req.request_id, prompt, params, slo_from_pb(req.slo, time_remaining))


def slo_from_pb(slo: pb.Slo, time_remaining: float | None) -> SLO | None:
    """The request's SLO; a gRPC deadline fills in e2e when the client gave none."""
    ttft = slo.ttft_s if slo.HasField("ttft_s") else None
    tpot = slo.tpot_s if slo.HasField("tpot_s") else None
    e2e = slo.e2e_s if slo.HasField("e2e_s") else None
    if e2e is None and time_remaining is not None:
        if time_remaining <= 0:
            raise DeadlineExceeded("the call's gRPC deadline passed before the request arrived")
        e2e = time_remaining
    if ttft is None and tpot is None and e2e is None:
        return None
    return SLO(ttft_s=ttft, tpot_s=tpot, e2e_s=e2e)


class DeadlineExceeded(Exception):
    """The call's deadline is already over when the request arrives."""


def failure_from_exception(exc: BaseException) -> Failure:
    """Map an engine/service exception to the status code the client sees."""
    if isinstance(exc, InvalidRequestError):
        return Failure(grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(exc))
    if isinstance(exc, RequestRefusedError):
        return refusal(exc.reason, str(exc))
    if isinstance(exc, DeadlineExceeded):
        return Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded", str(exc))
    if isinstance(exc, EngineDeadError):
        return Failure(grpc.StatusCode.UNAVAILABLE, "engine_dead",
                       f"the engine is not running: {exc}; retry against a healthy replica")
    if isinstance(exc, ValueError):  # e.g. a tokenizer refusing token ids out of the vocabulary
        return Failure(grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(exc))
    return Failure(grpc.StatusCode.INTERNAL, "internal", f"internal error: {type(exc).__name__}: {exc}")


def refusal(reason: str, message: str) -> Failure:
    """Admission refused: RESOURCE_EXHAUSTED with the reason (DEADLINE_EXCEEDED once the deadline passed)."""
    code = grpc.StatusCode.DEADLINE_EXCEEDED if reason == "deadline_passed" else grpc.StatusCode.RESOURCE_EXHAUSTED
    return Failure(code, reason, f"{message} (reason: {reason})")


def failure_from_output(out: Any) -> Failure:
    """The failure of a final RequestOutput with finish_reason 'error' (refused after queueing, or failed)."""
    reason = getattr(out, "refusal_reason", None)
    if reason:
        return refusal(reason, out.error or "refused by admission control")
    return Failure(grpc.StatusCode.INTERNAL, "internal", f"the engine failed this request: {out.error or 'unknown error'}")


def error_pb(request_id: str, failure: Failure) -> pb.ServerMessage:
    """A terminal RequestError message."""
    return pb.ServerMessage(error=pb.RequestError(
        request_id=request_id, code=failure.code.value[0], message=failure.message, reason=failure.reason))


def chunk_pb(request_id: str, out: Any, arrival: float) -> pb.ServerMessage:
    """A TokenChunk from one RequestOutput (the new tokens of one engine step)."""
    return pb.ServerMessage(chunk=pb.TokenChunk(
        request_id=request_id, token_ids=list(out.new_token_ids), text=out.new_text or "",
        time_s=max(0.0, time.monotonic() - arrival)))


def final_pb(request_id: str, out: Any, arrival: float) -> pb.ServerMessage:
    """The Final message of a request that ran to a finish reason (times relative to arrival)."""
    start = out.arrival_time if out.arrival_time is not None else arrival
    end = out.finish_time if out.finish_time is not None else time.monotonic()

    def since(t: float | None) -> float:
        return max(0.0, t - start) if t is not None else 0.0

    return pb.ServerMessage(final=pb.Final(
        request_id=request_id,
        finish_reason=_FINISH.get(out.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED),
        prompt_tokens=out.num_prompt_tokens or 0, completion_tokens=out.num_output_tokens or 0,
        cached_prompt_tokens=out.num_cached_tokens or 0,
        queue_s=since(out.first_scheduled_time), ttft_s=since(out.first_token_time), e2e_s=since(end)))


def stats_pb(stats: Any) -> pb.EngineStats:
    """EngineStats dataclass -> proto (same field names)."""
    msg = pb.EngineStats(**{name: getattr(stats, name) for name in _STATS_FIELDS})
    msg.refusals.update({str(k): int(v) for k, v in (stats.refusals or {}).items()})
    return msg


def info_pb(model: str, model_info: dict, stats: Any, *, version: str, max_prompt_tokens: int | None,
            max_tokens_limit: int) -> pb.InfoResponse:
    """The InfoResponse from the engine's model_info and stats."""
    max_len = int(model_info.get("max_model_len") or 0)  # a prompt leaves room for one output token
    return pb.InfoResponse(
        model=model, architecture=str(model_info.get("architecture", "")), version=version,
        max_model_len=max_len, max_prompt_tokens=max_prompt_tokens or max(0, max_len - 1),
        max_tokens_limit=max_tokens_limit, block_size=int(model_info.get("block_size") or 0),
        device=str(model_info.get("device", "")),
        attention_backend=str(model_info.get("attention_backend", "")),
        stats=stats_pb(stats))
