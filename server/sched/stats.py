"""The scheduler's counters since start-up and its recent TTFT prediction errors (plain data)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sloserve.sched.quantiles import nearest_rank

PREDICTION_ERRORS_KEPT = 512


@dataclass(slots=True)
class SchedulerStats:
    """Totals named as EngineStats' fields; `counters()` is what the engine's stats report."""

    prompt_tokens_total: int = 0
    prefix_hit_tokens_total: int = 0
    computed_prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    preemptions_total: int = 0
    requests_finished_total: int = 0
    kv_blocks_peak: int = 0  # most blocks held by requests at once
    # speculative decoding: verify steps of one sequence, draft tokens in them, accepted ones
    spec_drafts_total: int = 0
    spec_drafted_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    # predicted minus actual TTFT of recent requests that had a prediction (seconds)
    ttft_errors: deque[float] = field(default_factory=lambda: deque(maxlen=PREDICTION_ERRORS_KEPT))
    # NOTE: stats are read after every step: the quantiles are re-sorted only after new errors
    _error_quantiles: dict = field(default_factory=dict)

    def add_ttft_error(self, seconds: float) -> None:
        """One request's predicted minus actual time to first token."""
        self.ttft_errors.append(seconds)
        self._error_quantiles = {}

    def counters(self) -> dict:
        """The totals and the TTFT prediction error p50 / p90 (once there are errors)."""
        if self.ttft_errors and not self._error_quantiles:
            errors = sorted(self.ttft_errors)
            self._error_quantiles = {
                "ttft_predictions": len(errors),
                "ttft_prediction_error_p50_s": nearest_rank(errors, 0.5),
                "ttft_prediction_error_p90_s": nearest_rank(errors, 0.9),
            }
        return dict(
            prompt_tokens_total=self.prompt_tokens_total,
            prefix_hit_tokens_total=self.prefix_hit_tokens_total,
            generated_tokens_total=self.generated_tokens_total,
            preemptions_total=self.preemptions_total,
            computed_prompt_tokens_total=self.computed_prompt_tokens_total,
            requests_finished_total=self.requests_finished_total,
            kv_blocks_peak=self.kv_blocks_peak,
            spec_drafts_total=self.spec_drafts_total,
            spec_drafted_tokens_total=self.spec_drafted_tokens_total,
            spec_accepted_tokens_total=self.spec_accepted_tokens_total,
            **self._error_quantiles,
        )
