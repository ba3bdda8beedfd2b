"""What the engine hands back: per-step request outputs and engine-wide stats (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sloserve.logprobs import Logprob


@dataclass(slots=True)
class RequestOutput:
    """New tokens and text of one request since its previous output; the last has finished=True."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # 'stop' | 'length' | 'cancelled' | 'error' | None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Set (with finish_reason 'error') when admission control refused it after queueing, e.g.
    # 'queue_timeout'; the service maps it to RESOURCE_EXHAUSTED.
    refusal_reason: str | None = None
    # With finish_reason 'error': 'invalid' (the request itself is wrong: INVALID_ARGUMENT),
    # 'not_found' (it names a LoRA adapter that is not loaded: NOT_FOUND),
    # 'refused' (admission, see refusal_reason) or None (the engine failed it: INTERNAL). An engine
    # in another process reports what add_request would have raised this way.
    error_kind: str | None = None
    # Only for a request that asked: the logprobs of new_token_ids, one each; and, once (with its
    # first tokens), its prompt's, one per prompt token (the first None).
    new_logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None
    # Speculative decoding, so far: draft tokens verified and accepted; of the client's
    # prediction, the tokens accepted into the output and the rest (OpenAI's usage fields)
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass(slots=True)
class EngineStats:
    """Mirrors the proto EngineStats message field for field."""

    waiting: int = 0
    running: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    swap_blocks_total: int = 0
    swap_blocks_free: int = 0
    prompt_tokens_total: int = 0
    prefix_hit_tokens_total: int = 0
    generated_tokens_total: int = 0
    preemptions_total: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    step_time_s: float = 0.0  # mean of the last 64 steps
    tokens_per_step: float = 0.0
    requests_finished_total: int = 0
    step_time_p50_s: float = 0.0  # over the last 512 steps
    step_time_p99_s: float = 0.0
    kv_blocks_peak: int = 0  # most KV blocks in use at once since start
    ttft_predictions: int = 0  # admitted requests whose predicted first-token time has happened
    ttft_prediction_error_p50_s: float = 0.0  # predicted minus actual TTFT, over recent requests
    ttft_prediction_error_p90_s: float = 0.0
    # Mixture-of-experts models only (empty / zero for a dense one); counted from the end of warm-up.
    # experts on the device, per MoE layer
    expert_resident_per_layer: list[int] = field(default_factory=list)
    expert_hits_total: int = 0  # (layer, expert) uses whose weights were already on the device
    expert_misses_total: int = 0  # uses that waited for a copy from host memory
    expert_hit_rate: float = 0.0  # hits / (hits + misses); 1.0 with every expert resident
    expert_prefetches_total: int = 0  # experts copied in ahead of their layer, from the prediction
    expert_prefetch_accuracy: float = 0.0  # share of those prefetches their layer then used
    # share of the experts layers used that the prediction named
    expert_prediction_recall: float = 0.0
    # host -> device expert bytes: misses, prefetches and pinning
    expert_bytes_copied_total: int = 0
    expert_bytes_per_step: float = 0.0  # mean over the last 64 steps
    expert_miss_stall_s_total: float = 0.0  # time spent waiting for copies on misses
    # The engine's work since start-up (warm-up excluded): what a scheduling policy costs in steps.
    steps_total: int = 0  # model steps run (a run of n decode steps counts n)
    busy_seconds_total: float = 0.0  # wall time the runner spent on them
    # prompt tokens computed: hits excluded, recomputes included
    computed_prompt_tokens_total: int = 0
    # Speculative decoding: verify steps (one per sequence with drafts), draft tokens verified,
    # and how many of them the model accepted
    spec_drafts_total: int = 0
    spec_drafted_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    # LoRA adapters: taking requests now, the bytes their tensors hold, loads and unloads so far,
    # and per adapter loaded now: requests admitted and tokens generated since it was loaded
    lora_adapters_loaded: int = 0
    lora_adapter_bytes: int = 0
    lora_loads_total: int = 0
    lora_unloads_total: int = 0
    lora_requests: dict[str, int] = field(default_factory=dict)
    lora_generated_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache."""
        return (
            self.prefix_hit_tokens_total / self.prompt_tokens_total
            if self.prompt_tokens_total
            else 0.0
        )
