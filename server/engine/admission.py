"""Admission control: refuse early, with a reason, what cannot be served in time."""

from __future__ import annotations

from collections import Counter

from sloserve.config import SchedulerConfig
from sloserve.engine.request import Request
from sloserve.errors import RequestRefusedError

REASONS = ("queue_full", "deadline_passed", "slo_unattainable", "queue_timeout", "draining")


class StepCostModel:
    """Online fit of step time = overhead + per_token * tokens (exponentially weighted least squares).

    Prefill speed cannot be read off tokens/second of all steps: small decode steps are dominated
    by fixed per-step overhead and would make a prefill look many times slower than it is.
    """

    def __init__(self, decay: float = 0.98, min_steps: int = 3) -> None:
        self.decay = decay
        self.min_steps = min_steps
        self.steps = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + tokens * tokens
        self._xy = self._xy * d + tokens * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(overhead_s, per_token_s), or None until enough varied steps were seen to trust it."""
        if self.steps < self.min_steps:
            return None
        w, x, y = self._w, self._x, self._y
        var = w * self._xx - x * x
        if var > 1e-6 * w * w:
            per_token = (w * self._xy - x * y) / var
            if per_token > 0:
                return max(0.0, (y - per_token * x) / w), per_token
        mean_tokens = x / w
        if mean_tokens >= 64:  # steps all alike but large: treat their time as per-token cost
            return 0.0, y / x
        return None

    def seconds_for(self, tokens: int, step_tokens: int) -> float | None:
        """Estimated time to compute `tokens` in steps of at most `step_tokens`."""
        fit = self.fit()
        if fit is None:
            return None
        overhead, per_token = fit
        return tokens * per_token + -(-tokens // step_tokens) * overhead

    @property
    def tokens_per_s(self) -> float | None:
        fit = self.fit()
        return None if fit is None else 1.0 / fit[1]


class AdmissionControl:
    """Queue cap (always), deadline / SLO / queue-timeout checks (when enabled); counts refusals."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.enabled = config.admission_control
        self.max_waiting = config.max_waiting
        self.queue_timeout_s = config.queue_timeout_s
        self.step_tokens = config.max_batched_tokens
        self.speed = StepCostModel()
        self.refusals: Counter[str] = Counter()

    def refuse(self, reason: str, message: str) -> RequestRefusedError:
        """Count a refusal and build its error."""
        self.refusals[reason] += 1
        return RequestRefusedError(reason, message)

    def check_new(self, req: Request, now: float, num_waiting: int, tokens_ahead: int,
                  cached_tokens: int) -> None:
        """Raise RequestRefusedError when `req` should not even be queued."""
        if num_waiting >= self.max_waiting:
            raise self.refuse("queue_full", f"the waiting queue is full ({self.max_waiting} requests); "
                              "retry later or raise max_waiting")
        if not self.enabled or not req.has_explicit_slo:
            return
        left = req.deadline - now
        if left <= 0:
            raise self.refuse("deadline_passed", f"the first-token deadline passed {-left:.3f}s ago")
        need = tokens_ahead + req.num_prompt_tokens - cached_tokens
        estimate = self.speed.seconds_for(need, self.step_tokens)
        if estimate is not None and estimate > left:
            raise self.refuse(
                "slo_unattainable",
                f"first token expected in ~{estimate:.2f}s ({need} prompt tokens to prefill at "
                f"~{self.speed.tokens_per_s:.0f} tokens/s) but the SLO allows {left:.2f}s; "
                "relax the SLO or retry later")

    def timed_out(self, req: Request, now: float) -> bool:
        """True when a never-started request has waited longer than the queue timeout."""
        return (self.enabled and not req.ever_scheduled
                and now - req.arrival_time > self.queue_timeout_s)
