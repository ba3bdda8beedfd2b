from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]

class ServerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVER_STATE_UNSPECIFIED: _ClassVar[ServerState]
    SERVER_STATE_LOADING: _ClassVar[ServerState]
    SERVER_STATE_SERVING: _ClassVar[ServerState]
    SERVER_STATE_DRAINING: _ClassVar[ServerState]
    SERVER_STATE_ENGINE_DEAD: _ClassVar[ServerState]

class InFlight(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IN_FLIGHT_REFUSE: _ClassVar[InFlight]
    IN_FLIGHT_DRAIN: _ClassVar[InFlight]
    IN_FLIGHT_ABORT: _ClassVar[InFlight]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
SERVER_STATE_UNSPECIFIED: ServerState
SERVER_STATE_LOADING: ServerState
SERVER_STATE_SERVING: ServerState
SERVER_STATE_DRAINING: ServerState
SERVER_STATE_ENGINE_DEAD: ServerState
IN_FLIGHT_REFUSE: InFlight
IN_FLIGHT_DRAIN: InFlight
IN_FLIGHT_ABORT: InFlight

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop", "ignore_eos", "structured")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    structured: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class Slo(_message.Message):
    __slots__ = ("ttft_s", "tpot_s", "e2e_s")
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    tpot_s: float
    e2e_s: float
    def __init__(self, ttft_s: _Optional[float] = ..., tpot_s: _Optional[float] = ..., e2e_s: _Optional[float] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "max_tokens", "sampling", "slo", "priority", "prediction_text", "prediction_token_ids", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_TEXT_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    max_tokens: int
    sampling: SamplingParams
    slo: Slo
    priority: int
    prediction_text: str
    prediction_token_ids: TokenIds
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., slo: _Optional[_Union[Slo, _Mapping]] = ..., priority: _Optional[int] = ..., prediction_text: _Optional[str] = ..., prediction_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ClientMessage(_message.Message):
    __slots__ = ("generate", "cancel")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    generate: GenerateRequest
    cancel: CancelRequest
    def __init__(self, generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[_Union[CancelRequest, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "time_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    time_s: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., time_s: _Optional[float] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("request_id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_prompt_tokens", "queue_s", "ttft_s", "e2e_s", "accepted_prediction_tokens", "rejected_prediction_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    queue_s: float
    ttft_s: float
    e2e_s: float
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., queue_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "code", "message", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("chunk", "final", "error")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    chunk: TokenChunk
    final: Final
    error: RequestError
    def __init__(self, chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("waiting", "running", "kv_blocks_total", "kv_blocks_free", "kv_blocks_cached", "swap_blocks_total", "swap_blocks_free", "prompt_tokens_total", "prefix_hit_tokens_total", "generated_tokens_total", "preemptions_total", "refusals", "step_time_s", "tokens_per_step", "requests_finished_total", "step_time_p50_s", "step_time_p99_s", "kv_blocks_peak", "ttft_predictions", "ttft_prediction_error_p50_s", "ttft_prediction_error_p90_s", "expert_resident_per_layer", "expert_hits_total", "expert_misses_total", "expert_hit_rate", "expert_prefetches_total", "expert_prefetch_accuracy", "expert_prediction_recall", "expert_bytes_copied_total", "expert_bytes_per_step", "expert_miss_stall_s_total", "steps_total", "busy_seconds_total", "computed_prompt_tokens_total", "spec_drafts_total", "spec_drafted_tokens_total", "spec_accepted_tokens_total", "lora_adapters_loaded", "lora_adapter_bytes", "lora_loads_total", "lora_unloads_total", "lora_requests", "lora_generated_tokens")
    class RefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LoraRequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LoraGeneratedTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    SWAP_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SWAP_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_P50_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_P99_S_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_PEAK_FIELD_NUMBER: _ClassVar[int]
    TTFT_PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    TTFT_PREDICTION_ERROR_P50_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_PREDICTION_ERROR_P90_S_FIELD_NUMBER: _ClassVar[int]
    EXPERT_RESIDENT_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXPERT_MISSES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXPERT_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PREFETCHES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PREFETCH_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PREDICTION_RECALL_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_COPIED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    EXPERT_MISS_STALL_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_LOADED_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_LOADS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LORA_UNLOADS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LORA_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    running: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    swap_blocks_total: int
    swap_blocks_free: int
    prompt_tokens_total: int
    prefix_hit_tokens_total: int
    generated_tokens_total: int
    preemptions_total: int
    refusals: _containers.ScalarMap[str, int]
    step_time_s: float
    tokens_per_step: float
    requests_finished_total: int
    step_time_p50_s: float
    step_time_p99_s: float
    kv_blocks_peak: int
    ttft_predictions: int
    ttft_prediction_error_p50_s: float
    ttft_prediction_error_p90_s: float
    expert_resident_per_layer: _containers.RepeatedScalarFieldContainer[int]
    expert_hits_total: int
    expert_misses_total: int
    expert_hit_rate: float
    expert_prefetches_total: int
    expert_prefetch_accuracy: float
    expert_prediction_recall: float
    expert_bytes_copied_total: int
    expert_bytes_per_step: float
    expert_miss_stall_s_total: float
    steps_total: int
    busy_seconds_total: float
    computed_prompt_tokens_total: int
    spec_drafts_total: int
    spec_drafted_tokens_total: int
    spec_accepted_tokens_total: int
    lora_adapters_loaded: int
    lora_adapter_bytes: int
    lora_loads_total: int
    lora_unloads_total: int
    lora_requests: _containers.ScalarMap[str, int]
    lora_generated_tokens: _containers.ScalarMap[str, int]
    def __init__(self, waiting: _Optional[int] = ..., running: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., swap_blocks_total: _Optional[int] = ..., swap_blocks_free: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., prefix_hit_tokens_total: _Optional[int] = ..., generated_tokens_total: _Optional[int] = ..., preemptions_total: _Optional[int] = ..., refusals: _Optional[_Mapping[str, int]] = ..., step_time_s: _Optional[float] = ..., tokens_per_step: _Optional[float] = ..., requests_finished_total: _Optional[int] = ..., step_time_p50_s: _Optional[float] = ..., step_time_p99_s: _Optional[float] = ..., kv_blocks_peak: _Optional[int] = ..., ttft_predictions: _Optional[int] = ..., ttft_prediction_error_p50_s: _Optional[float] = ..., ttft_prediction_error_p90_s: _Optional[float] = ..., expert_resident_per_layer: _Optional[_Iterable[int]] = ..., expert_hits_total: _Optional[int] = ..., expert_misses_total: _Optional[int] = ..., expert_hit_rate: _Optional[float] = ..., expert_prefetches_total: _Optional[int] = ..., expert_prefetch_accuracy: _Optional[float] = ..., expert_prediction_recall: _Optional[float] = ..., expert_bytes_copied_total: _Optional[int] = ..., expert_bytes_per_step: _Optional[float] = ..., expert_miss_stall_s_total: _Optional[float] = ..., steps_total: _Optional[int] = ..., busy_seconds_total: _Optional[float] = ..., computed_prompt_tokens_total: _Optional[int] = ..., spec_drafts_total: _Optional[int] = ..., spec_drafted_tokens_total: _Optional[int] = ..., spec_accepted_tokens_total: _Optional[int] = ..., lora_adapters_loaded: _Optional[int] = ..., lora_adapter_bytes: _Optional[int] = ..., lora_loads_total: _Optional[int] = ..., lora_unloads_total: _Optional[int] = ..., lora_requests: _Optional[_Mapping[str, int]] = ..., lora_generated_tokens: _Optional[_Mapping[str, int]] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "version", "max_model_len", "max_prompt_tokens", "max_tokens_limit", "block_size", "device", "attention_backend", "stats", "state", "kv_block_bytes", "expert_residency", "num_experts", "expert_slots_per_layer", "expert_device_bytes", "tensor_parallel_size", "tensor_parallel_devices", "dtype", "dtype_reason", "weight_resident_bytes", "quantization", "kv_cache_dtype", "kv_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_SLOTS_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_DEVICES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    version: str
    max_model_len: int
    max_prompt_tokens: int
    max_tokens_limit: int
    block_size: int
    device: str
    attention_backend: str
    stats: EngineStats
    state: ServerState
    kv_block_bytes: int
    expert_residency: str
    num_experts: int
    expert_slots_per_layer: int
    expert_device_bytes: int
    tensor_parallel_size: int
    tensor_parallel_devices: _containers.RepeatedScalarFieldContainer[str]
    dtype: str
    dtype_reason: str
    weight_resident_bytes: int
    quantization: str
    kv_cache_dtype: str
    kv_tokens: int
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., version: _Optional[str] = ..., max_model_len: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., max_tokens_limit: _Optional[int] = ..., block_size: _Optional[int] = ..., device: _Optional[str] = ..., attention_backend: _Optional[str] = ..., stats: _Optional[_Union[EngineStats, _Mapping]] = ..., state: _Optional[_Union[ServerState, str]] = ..., kv_block_bytes: _Optional[int] = ..., expert_residency: _Optional[str] = ..., num_experts: _Optional[int] = ..., expert_slots_per_layer: _Optional[int] = ..., expert_device_bytes: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., tensor_parallel_devices: _Optional[_Iterable[str]] = ..., dtype: _Optional[str] = ..., dtype_reason: _Optional[str] = ..., weight_resident_bytes: _Optional[int] = ..., quantization: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., kv_tokens: _Optional[int] = ...) -> None: ...

class ScoreCandidate(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "candidates", "top_logprobs", "slo")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    candidates: _containers.RepeatedCompositeFieldContainer[ScoreCandidate]
    top_logprobs: int
    slo: Slo
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., candidates: _Optional[_Iterable[_Union[ScoreCandidate, _Mapping]]] = ..., top_logprobs: _Optional[int] = ..., slo: _Optional[_Union[Slo, _Mapping]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoredCandidate(_message.Message):
    __slots__ = ("token_ids", "token_logprobs", "sum_logprob", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SUM_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    sum_logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., token_logprobs: _Optional[_Iterable[float]] = ..., sum_logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("candidates", "prompt_tokens", "candidate_tokens", "cached_tokens")
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[ScoredCandidate]
    prompt_tokens: int
    candidate_tokens: int
    cached_tokens: int
    def __init__(self, candidates: _Optional[_Iterable[_Union[ScoredCandidate, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ..., candidate_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name", "in_flight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    in_flight: InFlight
    def __init__(self, name: _Optional[str] = ..., in_flight: _Optional[_Union[InFlight, str]] = ...) -> None: ...

class AdapterResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapters: _Optional[_Iterable[str]] = ...) -> None: ...
