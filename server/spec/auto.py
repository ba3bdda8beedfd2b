"""`--speculation auto`: how many drafts a step's requests may verify, from what rows cost.

The rule (docs/design/speculative-decoding.md, "auto"): a step of `b` decoding requests with no
drafts yields b tokens in `base + per_row * b` seconds of compute plus `host / steps` (a run of
`--num-scheduler-steps` decode steps shares one schedule's host work); with k drafts each, it
yields b * E(k) tokens in `base + per_row * b * (k + 1) + host` (a verify step is a schedule of its
own), where E(k) = 1 + a + ... + a^k is the expected run a request keeps at a per-draft
acceptance a. The cap is the k with the most tokens per second, 0 when none beats no drafts:
deep where a step's fixed cost dominates (one request), none where a verify row costs about what
it earns (a large batch). base and per_row are fitted online over the steps that only decode or
verify (rows = sequences + drafts; compute seconds); host is the schedule-to-schedule time left
after compute; a is the recent acceptance (starting at PRIOR_ACCEPTANCE). Until the fit has seen
rows of different counts the cap is the most drafts: those verify steps give it the spread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sloserve.sched.slo.step_model import StepCostModel

PRIOR_ACCEPTANCE = 0.5  # per-draft acceptance assumed before any draft was verified
ACCEPTANCE_DECAY = 0.9  # weight of the past verify steps against the newest
HOST_DECAY = 0.9


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify step of k drafts yields on average: 1 + a + ... + a^k."""
    return sum(acceptance**i for i in range(k + 1))


def _row_model() -> StepCostModel:
    # NOTE: a spread of half a row suffices: one request's steps have 1 or 1 + k rows.
    return StepCostModel(decay=0.95, min_steps=4, min_spread=0.5)


@dataclass(slots=True)
class DraftPlanner:
    """Chooses each step's draft cap from the fitted row cost, the batch and the acceptance."""

    most: int  # --num-speculative-tokens
    rows: StepCostModel = field(default_factory=_row_model)
    host_s: float = 0.0  # EWMA of a schedule's time outside the runner's compute
    _drafted: float = 0.0  # decayed drafted and accepted counts of recent verify steps
    _accepted: float = 0.0

    def observe_step(self, rows: int, steps: int, compute_s: float, cycle_s: float) -> None:
        """A schedule of `steps` decode or verify steps of `rows` rows each took `compute_s` of
        compute per step and `cycle_s` from its schedule to the next."""
        if rows <= 0 or compute_s <= 0:
            return
        self.rows.observe(rows, compute_s)
        host = max(0.0, cycle_s - compute_s * steps)
        self.host_s = HOST_DECAY * self.host_s + (1 - HOST_DECAY) * host

    def observe_verify(self, drafted: int, accepted: int) -> None:
        """A request's verify step kept `accepted` of its `drafted` drafts."""
        self._drafted = ACCEPTANCE_DECAY * self._drafted + drafted
        self._accepted = ACCEPTANCE_DECAY * self._accepted + accepted

    @property
    def acceptance(self) -> float:
        """Recent per-draft acceptance (a run's accepted / drafted), PRIOR_ACCEPTANCE before any."""
        if self._drafted <= 0:
            return PRIOR_ACCEPTANCE
        return min(0.99, self._accepted / self._drafted)

    def cap(self, batch: int, steps: int) -> int:
        """Most drafts per request this step, for `batch` decoding requests whose drafts cost a
        run of `steps` decode steps per schedule."""
        fit = self.rows.fit()
        if fit is None or batch <= 0:
            return self.most
        base, per_row = fit
        a = self.acceptance
        best_k, best = 0, batch / (base + per_row * batch + self.host_s / steps)
        for k in range(1, self.most + 1):
            rate = batch * expected_tokens(a, k) / (base + per_row * batch * (k + 1) + self.host_s)
            if rate > best:
                best_k, best = k, rate
        return best_k
