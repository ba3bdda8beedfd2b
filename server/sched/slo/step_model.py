"""Step time from the step's mix: overhead + per prompt token + per decoding sequence.

A decoding sequence costs several prompt tokens' worth (its attention reads its whole context,
and it has per-sequence work), so one slope for every token gets mixed steps wrong both ways
(docs/design/admission.md). Steps still scatter around the fit, so a step filled exactly to a
deadline overruns it about half the time; `margin` is the fit's recent error at the 80th
percentile, which the deadline plan leaves free. The fit is exponentially weighted least squares
over (prompt tokens, decoding sequences), kept as running sums, so observing a step is O(1); it
is trusted only once both kinds have varied enough, and apart from each other, to tell their
slopes apart.
"""

from __future__ import annotations

from collections import deque

MIN_PROMPT_SPREAD = 4.0  # tokens: the weighted std of prompt tokens per step needed for a slope
MIN_DECODE_SPREAD = 1.0  # sequences: the same for decoding sequences
MAX_CORRELATION = 0.97  # above this the two kinds moved together: their slopes are not separable
MARGIN_QUANTILE = 0.8  # a step is filled to the cap less this quantile of the fit's recent errors
MARGIN_STEPS = 256  # recent errors kept
MARGIN_EVERY = 16  # new errors between re-sorts of the margin (the deadline plan reads it every step)


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
            self._margin = max(0.0, errors[min(len(errors) - 1, int(MARGIN_QUANTILE * len(errors)))])
        return self._margin
