"""Admission control: refuse early, with a reason, what cannot be served in time."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from sloserve.config import SchedulerConfig
from sloserve.engine.request import Request
from sloserve.errors import RequestRefusedError

REASONS = ("queue_full", "deadline_passed", "slo_unattainable", "queue_timeout", "draining")
SLO_MARGIN = 0.8  # admit only when the first-token estimate fits in this share of the time left


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

    def step_cost(self) -> tuple[float, float] | None:
        """(overhead_s, per_token_s) to price steps with: the fit, else the mean step as pure overhead.

        Before the fit can be trusted (e.g. only 1-token decode steps seen), the mean time of the
        recent steps still prices a step of the same kind -- which is what a slot wait is made of.
        """
        fit = self.fit()
        if fit is not None:
            return fit
        if self.steps < self.min_steps:
            return None
        return self._y / self._w, 0.0

    @property
    def tokens_per_s(self) -> float | None:
        fit = self.fit()
        return None if fit is None else 1.0 / fit[1]


@dataclass(frozen=True, slots=True)
class FirstTokenEstimate:
    """When a new request's first token is expected, and what it waits for."""

    seconds: float
    steps: int  # engine steps until its first token
    slot_steps: int  # of which spent waiting for a free slot in the running batch
    tokens: int  # tokens every request computes in those steps (prefill + decode)
    ahead: int  # waiting requests that start before it


class AdmissionControl:
    """Queue cap (always), deadline / SLO / queue-timeout checks (when enabled); counts refusals."""

    def __init__(self, config: SchedulerConfig, max_model_len: int | None = None) -> None:
        self.enabled = config.admission_control
        self.max_waiting = config.max_waiting
        self.queue_timeout_s = config.queue_timeout_s
        self.max_wait_s = config.max_wait_s
        self.step_tokens = config.max_batched_tokens
        # Most prompt tokens of one request in one step (without chunking a prompt runs whole).
        self.chunk = min(config.prefill_chunk, config.max_batched_tokens) if config.chunked_prefill else 1 << 30
        self.max_model_len = max_model_len
        self.speed = StepCostModel()
        self.refusals: Counter[str] = Counter()

    def refuse(self, reason: str, message: str) -> RequestRefusedError:
        """Count a refusal and build its error."""
        self.refusals[reason] += 1
        return RequestRefusedError(reason, message)

    def check_new(self, req: Request, now: float, num_waiting: int, running: Sequence[Request],
                  ahead: Sequence[Request], behind: Sequence[Request], batch_cap: int,
                  cached_tokens: int) -> None:
        """Raise RequestRefusedError when `req` should not even be queued.

        `running` is the running set, `ahead` the waiting requests more urgent than `req` (in
        queue order), `behind` the other waiting ones: those among them that would wait past the
        starvation guard before `req`'s first token jump ahead of it. `batch_cap` is the most
        requests that run at once.
        """
        if num_waiting >= self.max_waiting:
            raise self.refuse("queue_full", f"the waiting queue is full ({self.max_waiting} requests); "
                              "retry later or raise max_waiting")
        if not self.enabled or not req.has_explicit_slo:
            return
        left = req.deadline - now
        if left <= 0:
            raise self.refuse("deadline_passed", f"the first-token deadline passed {-left:.3f}s ago")
        est = self.estimate(req, running, ahead, batch_cap, cached_tokens)
        if est is not None and behind:
            starving = [r for r in behind if r.arrival_time + self.max_wait_s < now + est.seconds]
            if starving:
                est = self.estimate(req, running, starving + list(ahead), batch_cap, cached_tokens)
        if est is not None and est.seconds > SLO_MARGIN * left:
            wait = (f"{est.slot_steps} steps for a slot in the full batch of {batch_cap}, "
                    if est.slot_steps else "")
            raise self.refuse(
                "slo_unattainable",
                f"first token expected in ~{est.seconds:.2f}s ({wait}{est.steps} steps in all, "
                f"{len(running)} running and {est.ahead} waiting ahead, {est.tokens} tokens to compute) "
                f"but the SLO allows {left:.2f}s; relax the SLO or retry later")

    def estimate(self, req: Request, running: Sequence[Request], ahead: Sequence[Request],
                 batch_cap: int, cached_tokens: int = 0) -> FirstTokenEstimate | None:
        """Predict the first-token time of `req`, queued behind `ahead`; None before steps were timed.

        Steps are simulated as slots of the running batch: each running request holds its slot
        for its remaining steps (prefill chunks, then one step per output token it may still
        produce -- max_tokens is an upper bound, so this errs late); each request ahead takes
        the slot that frees first, in order; `req` takes the next one and needs its own prefill
        chunks for its first token. The steps are priced with the step-cost model from the
        tokens computed in them, and are never fewer than the token budget allows.
        O(len(running) + len(ahead)) heap operations on at most `batch_cap` slots.
        """
        cost = self.speed.step_cost()
        if cost is None:
            return None
        overhead, per_token = cost
        cap = max(1, batch_cap)
        live = [self._work(r) for r in running]
        # Slot i frees when the (len(running) - cap + 1 + i)-th running request finishes.
        slots = ([0] * max(0, cap - len(live)) + sorted(steps for _, _, steps in live))[-cap:]
        queued = []
        for r in ahead:
            start = slots[0]
            work = self._work(r)
            heapq.heapreplace(slots, start + work[2])
            queued.append((start, work))
        start = slots[0]
        pending = max(1, req.num_tokens - cached_tokens)
        steps = start + self._prefill_steps(pending)
        tokens = pending
        for work in live:
            tokens += self._tokens_within(work, steps)
        for begin, work in queued:
            tokens += self._tokens_within(work, steps - begin)
        steps = max(steps, -(-tokens // self.step_tokens))
        return FirstTokenEstimate(seconds=steps * overhead + tokens * per_token, steps=steps,
                                  slot_steps=start, tokens=tokens, ahead=len(queued))

    def _prefill_steps(self, pending: int) -> int:
        return -(-pending // self.chunk)

    def _work(self, r: Request) -> tuple[int, int, int]:
        """(tokens to compute before its next token, steps for them, steps until it finishes)."""
        pending = max(1, r.num_tokens - r.num_computed_tokens)
        outputs = r.sampling.max_tokens - r.num_output_tokens
        if self.max_model_len is not None:
            outputs = min(outputs, self.max_model_len - r.num_tokens)
        prefill = self._prefill_steps(pending)
        return pending, prefill, prefill + max(1, outputs) - 1

    def _tokens_within(self, work: tuple[int, int, int], steps: int) -> int:
        """Tokens a request with `work` left computes in its next `steps` steps."""
        pending, prefill, total = work
        if steps <= 0:
            return 0
        return min(pending, steps * self.chunk) + max(0, min(total, steps) - prefill)

    def timed_out(self, req: Request, now: float) -> bool:
        """True when a never-started request has waited longer than the queue timeout."""
        return (self.enabled and not req.ever_scheduled
                and now - req.arrival_time > self.queue_timeout_s)
