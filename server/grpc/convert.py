"""Protobuf <-> front-end plain data, and FailureCode -> gRPC status (protobuf types stop here)."""

from __future__ import annotations

from typing import Any

import grpc
from sloserve.errors import InvalidRequestError
from sloserve.frontend import (
    Failure,
    FailureCode,
    Finished,
    ParsedRequest,
    RequestFailed,
    ServerState,
    Tokens,
)
from sloserve.pb import serving_pb2 as pb
from sloserve.sampling_params import SLO, SamplingParams
from sloserve.structured import grammar_for

STATUS = {  # the one place a front-end failure becomes a gRPC status
    FailureCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    FailureCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    FailureCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailureCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    FailureCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    FailureCode.INTERNAL: grpc.StatusCode.INTERNAL,
}

_STATE = {
    ServerState.LOADING: pb.SERVER_STATE_LOADING,
    ServerState.SERVING: pb.SERVER_STATE_SERVING,
    ServerState.DRAINING: pb.SERVER_STATE_DRAINING,
    ServerState.ENGINE_DEAD: pb.SERVER_STATE_ENGINE_DEAD,
}

_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
}

_STATS_FIELDS = (
    "waiting",
    "running",
    "kv_blocks_total",
    "kv_blocks_free",
    "kv_blocks_cached",
    "swap_blocks_total",
    "swap_blocks_free",
    "prompt_tokens_total",
    "prefix_hit_tokens_total",
    "generated_tokens_total",
    "preemptions_total",
    "step_time_s",
    "tokens_per_step",
    "requests_finished_total",
    "step_time_p50_s",
    "step_time_p99_s",
    "kv_blocks_peak",
    "ttft_predictions",
    "ttft_prediction_error_p50_s",
    "ttft_prediction_error_p90_s",
    "expert_hits_total",
    "expert_misses_total",
    "expert_hit_rate",
    "expert_prefetches_total",
    "expert_prefetch_accuracy",
    "expert_prediction_recall",
    "expert_bytes_copied_total",
    "expert_bytes_per_step",
    "expert_miss_stall_s_total",
    "steps_total",
    "busy_seconds_total",
    "computed_prompt_tokens_total",
    "spec_drafts_total",
    "spec_drafted_tokens_total",
    "spec_accepted_tokens_total",
    "lora_adapters_loaded",
    "lora_adapter_bytes",
    "lora_loads_total",
    "lora_unloads_total",
)


def from_pb(
    req: pb.GenerateRequest, *, default_max_tokens: int, time_remaining: float | None = None
) -> ParsedRequest:
    """A GenerateRequest in plain data; raise InvalidRequestError for fields that cannot be converted.

    `time_remaining` (seconds left on the call's gRPC deadline) becomes the e2e SLO when the
    request gives none. The server's limits are the front end's to check.
    """
    if not req.request_id:
        raise InvalidRequestError("request_id must be a non-empty string chosen by the client")
    prompt: str | list[int] = (
        list(req.token_ids.ids) if req.WhichOneof("prompt") == "token_ids" else req.text
    )
    s = req.sampling
    params = SamplingParams(
        max_tokens=req.max_tokens if req.HasField("max_tokens") else default_max_tokens,
        temperature=s.temperature if s.HasField("temperature") else 0.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        seed=s.seed if s.HasField("seed") else None,
        stop_token_ids=list(s.stop_token_ids),
        stop=list(s.stop),
        ignore_eos=s.ignore_eos if s.HasField("ignore_eos") else False,
        grammar=grammar_from_pb(s.structured) if s.HasField("structured") else None,
        adapter=req.adapter or None,
    )
    which = req.WhichOneof("prediction")
    prediction: str | list[int] | None = None
    if which == "prediction_token_ids":
        prediction = list(req.prediction_token_ids.ids)
    elif which == "prediction_text":
        prediction = req.prediction_text
    return ParsedRequest(
        prompt,
        params,
        slo_from_pb(req.slo, time_remaining),
        priority=req.priority,
        prediction=prediction,
    )


def grammar_from_pb(spec: pb.StructuredOutput) -> str | None:
    """The checked grammar of a StructuredOutput (None: none set); InvalidRequestError says why not."""
    kind = spec.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not spec.json_object):
        return None
    value = list(spec.choice.values) if kind == "choice" else getattr(spec, kind)
    try:
        return grammar_for(kind, value)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"sampling.structured.{kind}: {exc}") from None


def slo_from_pb(slo: pb.Slo, time_remaining: float | None) -> SLO | None:
    """The request's SLO; a gRPC deadline fills in e2e when the client gave none."""
    ttft = slo.ttft_s if slo.HasField("ttft_s") else None
    tpot = slo.tpot_s if slo.HasField("tpot_s") else None
    e2e = slo.e2e_s if slo.HasField("e2e_s") else None
    if e2e is None and time_remaining is not None:
        if time_remaining <= 0:
            raise RequestFailed(
                FailureCode.DEADLINE_EXCEEDED,
                "deadline_exceeded",
                "the call's gRPC deadline passed before the request arrived",
            )
        e2e = time_remaining
    if ttft is None and tpot is None and e2e is None:
        return None
    return SLO(ttft_s=ttft, tpot_s=tpot, e2e_s=e2e)


def error_pb(request_id: str, failure: Failure) -> pb.ServerMessage:
    """A RequestError message (request_id empty when it answers a message that started no request)."""
    return pb.ServerMessage(
        error=pb.RequestError(
            request_id=request_id,
            code=STATUS[failure.code].value[0],
            message=failure.message,
            reason=failure.reason,
        )
    )


def chunk_pb(request_id: str, tokens: Tokens) -> pb.ServerMessage:
    """A TokenChunk from the front end's Tokens event."""
    return pb.ServerMessage(
        chunk=pb.TokenChunk(
            request_id=request_id,
            token_ids=tokens.token_ids,
            text=tokens.text,
            time_s=tokens.time_s,
        )
    )


def final_pb(request_id: str, done: Finished) -> pb.ServerMessage:
    """The Final message of a request that ran to a finish reason (times from its arrival)."""
    return pb.ServerMessage(
        final=pb.Final(
            request_id=request_id,
            finish_reason=_FINISH.get(done.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
            cached_prompt_tokens=done.cached_tokens,
            queue_s=done.queue_s or 0.0,
            ttft_s=done.ttft_s or 0.0,
            e2e_s=done.e2e_s,
            accepted_prediction_tokens=done.accepted_prediction_tokens or 0,
            rejected_prediction_tokens=done.rejected_prediction_tokens or 0,
        )
    )


def stats_pb(stats: Any) -> pb.EngineStats:
    """EngineStats dataclass -> proto (same field names)."""
    msg = pb.EngineStats(**{name: getattr(stats, name) for name in _STATS_FIELDS})
    msg.refusals.update({str(k): int(v) for k, v in (stats.refusals or {}).items()})
    msg.lora_requests.update(getattr(stats, "lora_requests", None) or {})
    msg.lora_generated_tokens.update(getattr(stats, "lora_generated_tokens", None) or {})
    msg.expert_resident_per_layer.extend(
        int(n) for n in getattr(stats, "expert_resident_per_layer", ()) or ()
    )
    return msg


def info_pb(
    model: str,
    model_info: dict,
    stats: Any,
    state: ServerState,
    *,
    version: str,
    max_prompt_tokens: int | None,
    max_tokens_limit: int,
) -> pb.InfoResponse:
    """The InfoResponse from the engine's model_info and stats and the server's state."""
    max_len = int(model_info.get("max_model_len") or 0)  # a prompt leaves room for one output token
    return pb.InfoResponse(
        model=model,
        architecture=str(model_info.get("architecture", "")),
        version=version,
        max_model_len=max_len,
        max_prompt_tokens=max_prompt_tokens or max(0, max_len - 1),
        max_tokens_limit=max_tokens_limit,
        block_size=int(model_info.get("block_size") or 0),
        device=str(model_info.get("device", "")),
        dtype=str(model_info.get("dtype", "")),
        dtype_reason=str(model_info.get("dtype_reason", "")),
        weight_resident_bytes=int(model_info.get("weight_resident_bytes") or 0),
        quantization=str(model_info.get("quantization", "")),
        kv_cache_dtype=str(model_info.get("kv_cache_dtype", "")),
        kv_tokens=int(model_info.get("kv_tokens") or 0),
        attention_backend=str(model_info.get("attention_backend", "")),
        kv_block_bytes=int(model_info.get("kv_block_bytes") or 0),
        expert_residency=str(model_info.get("expert_residency") or ""),
        num_experts=int(model_info.get("num_experts") or 0),
        expert_slots_per_layer=int(model_info.get("expert_slots_per_layer") or 0),
        expert_device_bytes=int(model_info.get("expert_device_bytes") or 0),
        tensor_parallel_size=int(model_info.get("tensor_parallel_size") or 1),
        tensor_parallel_devices=[str(d) for d in model_info.get("tensor_parallel_devices") or ()],
        stats=stats_pb(stats),
        state=_STATE[state],
    )
