"""Admission control: refuse early, with a reason, what cannot be served in time."""

from __future__ import annotations

from collections import Counter

from sloserve.config import SchedulerConfig
from sloserve.engine.request import Request
from sloserve.errors import RequestRefusedError

REASONS = ("queue_full", "deadline_passed", "slo_unattainable", "queue_timeout", "draining")


class ThroughputEstimate:
    """Exponentially weighted tokens per second of engine steps (computed tokens / step time)."""

    def __init__(self, decay: float = 0.9, min_steps: int = 3) -> None:
        self.decay = decay
        self.min_steps = min_steps
        self._tokens = 0.0
        self._seconds = 0.0
        self.steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self._tokens = self._tokens * self.decay + tokens
        self._seconds = self._seconds * self.decay + seconds
        self.steps += 1

    @property
    def tokens_per_s(self) -> float | None:
        """None until enough steps were seen to trust the number."""
        if self.steps < self.min_steps or self._seconds <= 0:
            return None
        return self._tokens / self._seconds


class AdmissionControl:
    """Queue cap (always), deadline / SLO / queue-timeout checks (when enabled); counts refusals."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.enabled = config.admission_control
        self.max_waiting = config.max_waiting
        self.queue_timeout_s = config.queue_timeout_s
        self.speed = ThroughputEstimate()
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
        speed = self.speed.tokens_per_s
        if speed is None:
            return
        need = tokens_ahead + req.num_prompt_tokens - cached_tokens
        estimate = need / speed
        if estimate > left:
            raise self.refuse(
                "slo_unattainable",
                f"first token expected in ~{estimate:.2f}s ({need} prompt tokens to prefill at "
                f"~{speed:.0f} tokens/s) but the SLO allows {left:.2f}s; relax the SLO or retry later")

    def timed_out(self, req: Request, now: float) -> bool:
        """True when a never-started request has waited longer than the queue timeout."""
        return (self.enabled and not req.ever_scheduled
                and now - req.arrival_time > self.queue_timeout_s)
