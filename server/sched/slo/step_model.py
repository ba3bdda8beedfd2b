"""The step-cost models: what a step of a given shape costs, fitted online from the steps run.

MixedStepModel prices a step from its mix: overhead + per prompt token + per decoding sequence.

A decoding sequence costs several prompt tokens' worth (its attention reads its whole context,
and it has per-sequence work), so one slope for every token gets mixed steps wrong both ways
(docs/design/admission.md). Steps still scatter around the fit, so a step filled exactly to a
deadline overruns it about half the time; `margin` is the fit's recent error at the 80th
percentile, which the deadline plan leaves free. The fit is exponentially weighted least squares
over (prompt tokens, decoding sequences), kept as running sums, so observing a step is O(1); it
is trusted only once both kinds have varied enough, and apart from each other, to tell their
slopes apart. StepCostModel is the one-slope fit (every token alike) that prices steps
until the mix can be told apart, and times schedule-to-schedule cycles for admission; StepPrice is
what the deadline plan reads of either.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

MIN_PROMPT_SPREAD = 4.0  # tokens: the weighted std of prompt tokens per step needed for a slope
MIN_DECODE_SPREAD = 1.0  # sequences: the same for decoding sequences
MAX_CORRELATION = 0.97  # above this the two kinds moved together: their slopes are not separable
MARGIN_QUANTILE = 0.8  # a step is filled to the cap less this quantile of the fit's recent errors
MARGIN_STEPS = 256  # recent errors kept
# new errors between re-sorts of the margin (the deadline plan reads it every step)
MARGIN_EVERY = 16


class MixedStepModel:
    """Online fit of seconds = overhead + per_prompt_token * prompt + per_decode * decodes."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.steps = 0
        # weighted sums: w, p, d, y, pp, dd, pd, py, dy
        self._s = [0.0] * 9
        self._fit: tuple[float, float, float] | None = None  # the fit of the sums as they stand
        self._errors: deque[float] = deque(maxlen=MARGIN_STEPS)  # seconds taken minus predicted
        self._new_errors = 0  # since the margin was last sorted
        self._margin: float | None = 0.0  # None: recompute from _errors

    def observe(self, prompt_tokens: int, decodes: int, seconds: float) -> None:
        if prompt_tokens + decodes <= 0 or seconds <= 0:
            return
        fit = self._fit
        if fit is not None:
            self._errors.append(seconds - (fit[0] + fit[1] * prompt_tokens + fit[2] * decodes))
            self._new_errors += 1
            if self._new_errors >= MARGIN_EVERY:
                self._margin, self._new_errors = None, 0
        p, d, y, k = float(prompt_tokens), float(decodes), seconds, self.decay
        s = self._s
        for i, v in enumerate((1.0, p, d, y, p * p, d * d, p * d, p * y, d * y)):
            s[i] = s[i] * k + v
        self.steps += 1
        self._fit = self._solve()

    def fit(self) -> tuple[float, float, float] | None:
        """(overhead_s, per_prompt_token_s, per_decode_s), or None while the slopes cannot be told apart."""
        return self._fit

    def _solve(self) -> tuple[float, float, float] | None:
        w, p, d, y, pp, dd, pd, py, dy = self._s
        if self.steps < 3 or w <= 0:
            return None
        mp, md, my = p / w, d / w, y / w
        cpp, cdd, cpd = pp / w - mp * mp, dd / w - md * md, pd / w - mp * md
        cpy, cdy = py / w - mp * my, dy / w - md * my
        if cpp < MIN_PROMPT_SPREAD**2 or cdd < MIN_DECODE_SPREAD**2:
            return None
        det = cpp * cdd - cpd * cpd
        if det <= (1 - MAX_CORRELATION**2) * cpp * cdd:
            return None
        per_prompt = (cpy * cdd - cdy * cpd) / det
        per_decode = (cdy * cpp - cpy * cpd) / det
        if per_prompt <= 0 or per_decode <= 0:
            return None
        return max(0.0, my - per_prompt * mp - per_decode * md), per_prompt, per_decode

    def margin(self) -> float:
        """Seconds by which a step overruns its prediction at the MARGIN_QUANTILE of recent steps
        (0 when it mostly does not; re-sorted every MARGIN_EVERY steps): what a step filled to a
        deadline should leave free."""
        if self._margin is None:
            errors = sorted(self._errors)
            self._margin = max(
                0.0, errors[min(len(errors) - 1, int(MARGIN_QUANTILE * len(errors)))]
            )
        return self._margin


class StepCostModel:
    """Online fit of step time = overhead + per_token * tokens (exponentially weighted least squares).

    Prefill speed cannot be read off tokens/second of all steps: small decode steps are dominated
    by fixed per-step overhead and would make a prefill look many times slower than it is.
    """

    def __init__(self, decay: float = 0.98, min_steps: int = 3, min_spread: float = 4.0) -> None:
        self.decay = decay
        self.min_steps = min_steps
        self.min_spread = min_spread  # tokens: the weighted std of step sizes needed to fit a slope
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
        # NOTE: one old odd-sized step (e.g. a cold first prefill) must not set the slope.
        if var >= (self.min_spread * w) ** 2:
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


@dataclass(frozen=True, slots=True)
class StepPrice:
    """Step time = overhead_s + per_token_s * prompt tokens + per_decode_s * decoding sequences.

    Without a per-decode slope (None) a decoding sequence is priced as one token.
    """

    overhead_s: float
    per_token_s: float
    per_decode_s: float | None = None
    margin_s: float = 0.0  # how much a step may overrun its price (DeadlinePlan leaves it free)

    @property
    def decode_s(self) -> float:
        return self.per_token_s if self.per_decode_s is None else self.per_decode_s

    def step_seconds(self, prompt_tokens: int, decodes: int) -> float:
        """A step of `prompt_tokens` prompt tokens and `decodes` decoding sequences."""
        return self.overhead_s + self.per_token_s * prompt_tokens + self.decode_s * decodes
