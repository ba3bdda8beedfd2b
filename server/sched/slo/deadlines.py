"""Deadline step composition (the `slo` policy): who computes in this step, and how much.

Each request's *slack* is how long it can still wait before a step must compute it, priced
with the step-cost model (overhead + per prompt token + per decoding sequence):

- still prefilling, with a TTFT objective: the TTFT deadline minus the time its remaining
  prompt takes;
- decoding, with a TPOT objective: when its next token is due to keep its mean TPOT on pace,
  ``first_token_time + tpot * outputs_so_far``, minus one step;
- with an end-to-end objective: its finish-by time (``finish_margin`` of the objective early)
  minus its remaining outputs at one step each (``max_tokens`` bounds them, so this errs early);
- the smallest of those; infinite with no objective, and infinite for a request that has already
  missed an objective for good (so lost requests do not run ahead of those that can still make it).

Invariants:
- A request with slack under the *horizon* (two full-budget steps) must run, and so must one not
  computed for ``max_wait_s``: the starvation bound (a running request is computed at least once
  every ``max_wait_s`` plus one step; a waiting one is offered a chunk once it has waited that long).
- The step *cap* is the tightest pace among the must-run decodes (seconds per step that still
  keep a request's mean TPOT and end-to-end deadline); optional work only fills the room under it
  (Sarathi-Serve's stall-free budget, derived from deadlines). A must-run prefill makes at least
  MIN_CHUNK tokens even past the cap.
- While TTFT objectives keep arriving, optional prompt chunks keep each step under ARRIVAL_SHARE
  of the tightest recent objective (room for the next first token); decodes ride along past it.
- The first urgent prompt of a step runs whole when the paced decodes can absorb the longer step
  (each loses at most STALL_SHARE of its spare time); the next ones get only the room unless
  waiting a step would miss their TTFT.

Why each rule, with the measurements: docs/design/deadline-steps.md.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable

from sloserve.config import SchedulerConfig
from sloserve.sched.request import Request
from sloserve.sched.slo.step_model import StepPrice

MIN_CHUNK = 16  # tokens: the least a must-run prefill chunk makes, even past the cap
HORIZON_STEPS = 2.0  # slack under this many full-budget steps: the request must run now
# an urgent prompt is paced to be done this share of its TTFT objective after arrival
TTFT_SAFETY = 0.25
# of the tightest recent TTFT objective: the longest step optional prompt chunks make
ARRIVAL_SHARE = 0.25
ARRIVAL_WINDOW_S = 10.0  # TTFT objectives seen this recently are expected of the next arrivals
STALL_SHARE = 0.5  # of a paced request's spare time (its pace over a full decode step, per output) one step may take


class DeadlinePlan:
    """One step's view of every candidate's slack, the horizon and the step cap."""

    def __init__(
        self,
        price: StepPrice,
        running: Iterable[Request],
        now: float,
        chunk: int,
        max_wait_s: float,
        step_tokens: int,
        finish_margin: float = 0.0,
        arrival_ttft_s: float | None = None,
        prefill_left: Callable[[Request], int] | None = None,
    ) -> None:
        self.price = price
        # ties of slack: least remaining prefill first (Scheduler._prefill_left), None: arrival
        self.prefill_left = prefill_left
        self.now = now
        self.chunk = chunk
        self.max_wait_s = max_wait_s
        self.finish_margin = finish_margin
        running = list(running)
        self.full_step_s = price.step_seconds(0, max(1, len(running)))
        # NOTE: a request that waits also waits for the step in flight, which may be a full one
        self.horizon_s = HORIZON_STEPS * max(self.full_step_s, price.step_seconds(step_tokens, 0))
        self._slack: dict[int, float] = {}
        self.cap_s = math.inf  # the step must end this long after `now` (the paces below)
        # Optional prompt chunks also stop here: room for a newcomer's first token (unless no
        # useful step fits in it). Decodes cost little and still ride along past it.
        self.arrival_cap_s = math.inf
        if arrival_ttft_s is not None and ARRIVAL_SHARE * arrival_ttft_s >= price.step_seconds(
            MIN_CHUNK, len(running)
        ):
            self.arrival_cap_s = ARRIVAL_SHARE * arrival_ttft_s
        self._overdrawn = False  # a starving request's chunk already went past the cap this step
        self._urgent_prompt = False  # min_chunk already granted one urgent prompt this step (past the room if need be)
        self._waiting: list[Request] | None = None  # the waiting queue in slack order, sorted once
        self.absorb_s = math.inf  # how far past the cap one step may run for an urgent whole prompt
        paced = [
            r
            for r in running
            if r.first_token_time is not None
            and r.num_tokens - r.num_computed_tokens <= 1
            and (r.tpot_s is not None or r.e2e_deadline is not None)
            and self.must_run(r)
        ]
        floor_s = price.step_seconds(0, len(paced))  # the step of the must-run decodes alone
        for r in paced:
            pace = self.pace(r, now)
            if pace >= floor_s:
                self.cap_s = min(self.cap_s, pace)
                outputs = max(1, r.sampling.max_tokens - r.num_output_tokens)
                self.absorb_s = min(
                    self.absorb_s, STALL_SHARE * outputs * max(0.0, pace - self.full_step_s)
                )

    def min_chunk(self, r: Request, n: int, prompt: int, decodes: int) -> int:
        """The least of `n` prompt tokens an urgent r must compute now, in a step that already
        computes `prompt` prompt tokens and `decodes` decoding sequences: MIN_CHUNK; for a TTFT
        objective all `n` when the paced decodes can absorb the longer step (it runs whole: see
        the module docstring), else what keeps its prompt on pace to be done TTFT_SAFETY of its
        objective after it arrived, in steps of the cap, and all of its chunk once that time has
        passed (a chunk past the cap slows the paced decodes a little; one below it misses the TTFT).
        Only the first urgent prompt of a step is granted this; the next ones get the room under
        the cap (0 here) unless waiting one step would miss their TTFT -- see the module docstring.

        The aim is fixed when the request arrives: aimed at a share of the time left, it recedes
        every step (docs/design/deadline-steps.md)."""
        floor = min(n, MIN_CHUNK)
        if r.ttft_deadline is None or r.first_token_time is not None:
            return floor
        if self._urgent_prompt and self.slack(r) >= self.price.step_seconds(prompt, decodes):
            return 0  # only the room: one urgent prompt a step goes past it, and this one can wait a step
        self._urgent_prompt = True
        if (
            self.price.step_seconds(prompt + n, decodes) + self.price.margin_s
            <= self.cap_s + self.absorb_s
        ):
            return n
        step = self.cap_s if not math.isinf(self.cap_s) else self.full_step_s
        aim = r.arrival_time + TTFT_SAFETY * (r.ttft_deadline - r.arrival_time)
        steps = max(1, int((aim - self.now) / max(step, self.price.step_seconds(1, 0))))
        pending = r.num_tokens - r.num_computed_tokens
        return min(n, max(floor, -(-pending // steps)))

    def paced_prefill(self, r: Request, n: int, prompt: int, decodes: int) -> None:
        """An urgent prompt got a chunk of `n` (the step now computes `prompt` prompt tokens and
        `decodes` decoding sequences): cap the step at its
        TTFT pace -- the time left over the steps its prompt still needs, this one included --
        unless this step already runs past that (then it is lost for this step)."""
        if r.ttft_deadline is None or not self.urgent(r):
            return
        left = r.num_tokens - r.num_computed_tokens - n  # prompt tokens after this chunk
        pace = (r.ttft_deadline - self.now) / (1 + -(-left // self.chunk))
        if pace >= self.price.step_seconds(prompt, decodes):
            self.cap_s = min(self.cap_s, pace)

    def finish_by(self, r: Request) -> float | None:
        """When r's last token is aimed at: its end-to-end deadline, `finish_margin` of its
        objective early (None: no end-to-end objective)."""
        if r.e2e_deadline is None:
            return None
        return r.e2e_deadline - self.finish_margin * (r.e2e_deadline - r.arrival_time)

    def pace(self, r: Request, now: float) -> float:
        """Seconds per step that still meets r's objectives if every step from now computes one of
        its remaining outputs (max_tokens bounds them): its mean TPOT over the whole answer, and
        its last token by finish_by. Slack banked by fast steps is spread evenly."""
        outputs = max(1, r.sampling.max_tokens - r.num_output_tokens)
        pace = math.inf
        if self.missed(r):
            return pace
        if r.tpot_s is not None and r.first_token_time is not None:
            last_due = r.first_token_time + r.tpot_s * (r.num_output_tokens + outputs - 1)
            pace = (last_due - now) / outputs
        finish_by = self.finish_by(r)
        if finish_by is not None:
            pace = min(pace, (finish_by - now) / outputs)
        return pace

    def slack(self, r: Request) -> float:
        """Seconds r can still wait before a step must compute it (see the module docstring)."""
        cached = self._slack.get(r.handle)
        if cached is not None:
            return cached
        if self.missed(r):  # no objective left to keep: served like a request without objectives
            self._slack[r.handle] = math.inf
            return math.inf
        now, price = self.now, self.price
        pending = r.num_tokens - r.num_computed_tokens
        slack = math.inf
        if r.first_token_time is None:
            prefill = price.per_token_s * pending + -(-pending // self.chunk) * price.overhead_s
            if r.ttft_deadline is not None:
                slack = r.ttft_deadline - now - prefill
        else:
            prefill = 0.0
            if r.tpot_s is not None and pending <= 1:
                slack = (
                    r.first_token_time
                    + r.tpot_s * max(1, r.num_output_tokens)
                    - now
                    - self.full_step_s
                )
        finish_by = self.finish_by(r)
        if finish_by is not None:
            outputs = max(1, r.sampling.max_tokens - r.num_output_tokens)
            slack = min(slack, finish_by - now - prefill - outputs * self.full_step_s)
        self._slack[r.handle] = slack
        return slack

    def missed(self, r: Request) -> bool:
        """Has r already missed an objective for good: its TTFT deadline passed without a first
        token, or its end-to-end deadline passed? Then it has no objective left to keep and is
        served like a request without objectives (optional, under the starvation bound): running
        it ahead of the others would only make them miss theirs too."""
        now = self.now
        return (
            r.ttft_deadline is not None and r.first_token_time is None and now > r.ttft_deadline
        ) or (r.e2e_deadline is not None and now > r.e2e_deadline)

    def urgent(self, r: Request) -> bool:
        """Its slack is under the horizon: skipping it would put its objective at risk."""
        return self.slack(r) < self.horizon_s

    def starving(self, r: Request) -> bool:
        """Not computed for max_wait_s (since its arrival if never)."""
        since = r.last_scheduled_time if r.last_scheduled_time is not None else r.arrival_time
        return self.now - since >= self.max_wait_s

    def must_run(self, r: Request) -> bool:
        return self.urgent(r) or self.starving(r)

    def overdraw(self, r: Request) -> bool:
        """May r's prefill chunk go past the cap? Always when urgent; for one starving request a
        step (so a queue of starving requests cannot flood a step and break every TPOT)."""
        if self.urgent(r):
            return True
        if self.starving(r) and not self._overdrawn:
            self._overdrawn = True
            return True
        return False

    @classmethod
    def for_step(
        cls,
        config: SchedulerConfig,
        price: StepPrice,
        running: Iterable[Request],
        now: float,
        arrival_ttft_s: float | None,
        prefill_left: Callable[[Request], int] | None = None,
    ) -> DeadlinePlan:
        """The plan of a step at `now` under the scheduler's settings (its prefill chunk, the
        starvation bound, the step's token cap, the finish margin, the prefill order)."""
        sc = config
        chunk = sc.max_batched_tokens
        if sc.chunked_prefill:
            chunk = min(sc.prefill_chunk, sc.max_batched_tokens)
        return cls(
            price,
            running,
            now,
            chunk,
            sc.max_wait_s,
            sc.max_batched_tokens,
            sc.finish_margin,
            arrival_ttft_s,
            prefill_left if sc.prefill_order == "shortest" else None,
        )

    def fit(self, r: Request, n: int, prompt: int, decodes: int) -> int:
        """`n` tokens of r cut to the room under the step cap, in a step that already computes
        `prompt` prompt tokens and `decodes` decoding sequences: 0 skips an optional request this
        step; a must-run decode always computes, a must-run prefill as `overdraw` allows."""
        if n <= 1:
            return n if self.must_run(r) or self.decode_fits(prompt, decodes) else 0
        fit = min(n, self.room(prompt, decodes))
        if self.urgent(r):
            return max(fit, self.min_chunk(r, n, prompt, decodes))
        if fit >= min(n, MIN_CHUNK):
            return fit
        return min(n, MIN_CHUNK) if self.overdraw(r) else 0

    def room(self, prompt: int, decodes: int) -> int:
        """Prompt tokens that still fit under the cap and the arrival room in a step that already
        computes `prompt` prompt tokens and `decodes` decoding sequences."""
        cap = min(self.cap_s, self.arrival_cap_s)
        if math.isinf(cap):
            return 1 << 30
        left = cap - self.price.margin_s - self.price.step_seconds(prompt, decodes)
        if left < 0:
            return 0
        return int(left / self.price.per_token_s + 1e-6) if self.price.per_token_s > 0 else 1 << 30

    def decode_fits(self, prompt: int, decodes: int) -> bool:
        """Does one more decoding sequence keep the step under the cap?"""
        return (
            math.isinf(self.cap_s)
            or self.price.step_seconds(prompt, decodes + 1) + self.price.margin_s <= self.cap_s
        )

    def sort_key(self, r: Request) -> tuple[float, int, float, int]:
        """Least slack first; ties (requests without objectives, or past them: infinite slack)
        least remaining prefill first with `prefill_left`, then earlier arrival."""
        left = self.prefill_left(r) if self.prefill_left is not None else 0
        return self.slack(r), left, r.arrival_time, r.handle

    def waiting_order(self, waiting: Iterable[Request]) -> list[Request]:
        """The waiting queue in slack order, as it stood at the step's first call (sorted once per
        step; a request preempted later in the step is not started again in it)."""
        if self._waiting is None:
            self._waiting = sorted(waiting, key=self.sort_key)
        return self._waiting


class TightestRecent:
    """The smallest TTFT objective among requests that arrived in the last ARRIVAL_WINDOW_S
    (refused ones too: they show the traffic is there), in O(1) amortised per call: a deque of
    (arrival, objective) whose objectives rise from front to back."""

    def __init__(self, window_s: float = ARRIVAL_WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: deque[tuple[float, float]] = deque()

    def add(self, now: float, ttft_s: float) -> None:
        while self._seen and self._seen[-1][1] >= ttft_s:
            self._seen.pop()  # a tighter newer objective outlives it
        self._seen.append((now, ttft_s))

    def tightest(self, now: float) -> float | None:
        while self._seen and self._seen[0][0] < now - self.window_s:
            self._seen.popleft()
        return self._seen[0][1] if self._seen else None
