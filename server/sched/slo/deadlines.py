"""Deadline step composition (the `slo` policy): who computes in this step, and how much.

Each request's *slack* is how long it can still wait before a step must compute it, priced
with the measured step-cost model (seconds = overhead + per_token * tokens):

- still prefilling, with a TTFT objective: the TTFT deadline minus the time its remaining
  prompt takes;
- decoding, with a TPOT objective: when its next token is due to keep its mean TPOT on pace,
  ``first_token_time + tpot * outputs_so_far``, minus one step;
- with an end-to-end objective: its finish-by time (below) minus its remaining outputs at one step each
  (``max_tokens`` is an upper bound, so this errs early);
- the smallest of those; infinite with no objective.

A request that has already missed an objective for good (its TTFT deadline passed without a
first token, or its end-to-end deadline passed) has infinite slack and no pace: under overload
the lost requests would otherwise stay the most urgent of all and run every step, ahead of the
ones that can still make it. Measured served at 3x capacity (9 paired runs): 30.3 of 60
interactive requests met their objectives against 28.6 without, 6 pairs won and 3 lost; at 2x,
no difference (45.0 against 44.6).

A request whose slack is under the *horizon* (two steps of the full token budget: after
skipping one step it still has one) must run; so must one that has not been computed for ``max_wait_s`` (since
its arrival if never). That is the starvation bound: a running request is computed at least
once every ``max_wait_s`` plus one step, and a waiting one is offered a chunk as soon as it has
waited ``max_wait_s`` (it still needs a free slot, blocks and token budget, and it waits while
another request computes its next prefix block: see Claims in block_manager).

An end-to-end deadline is aimed at ``finish_margin`` of its objective early (5% by default:
0.1 s of a 2 s objective). The engine's clock starts when the front end reads the request and
stops when the step that sampled the last token ends; the client also counts the trip to the
server and the last token's way back, and a request paced to the very end of its objective
misses it by those few milliseconds, or by the jitter of any step near the end. Measured served
at 2x capacity (24 paired runs): 91-94% of interactive requests met their objectives with the
margin against 84-88% without, and the margin won 20 of the 24 pairs.

The step *cap* is the tightest *pace* among the must-run decodes: the seconds per step that
still meet a request's mean TPOT and end-to-end deadline if each step from now computes one of
its remaining outputs. A request that cannot keep its pace even in a step of the must-run
decodes alone does not cap the others: it is lost for this step. Optional requests run only while the step
still ends within the cap, and a prefill chunk is cut to what fits under it -- Sarathi-Serve's
stall-free token budget, derived from deadlines instead of fixed. A must-run prefill makes at
least MIN_CHUNK tokens even past the cap (every urgent one; one starving request per step).
With no paced request running, the cap is infinite and every request runs (optional prompt
chunks within the room below).

Optional prompt chunks also leave room for the next arrival's first token: while requests with
a TTFT objective keep coming (any seen in the last ARRIVAL_WINDOW_S, refused ones included), no
optional chunk makes a step longer than ARRIVAL_SHARE of the tightest such objective, so a
newcomer does not first wait out a step of the whole token budget (2,048 prompt tokens took
~250 ms on stop 35's machine, most of a 0.3 s TTFT; cut to 75 ms a step still computes ~600
tokens, where a token costs what it costs in the full budget). Without it a run could fall into
a loop: a few refused interactive requests left no paced request running, steps grew to the
whole budget, and the next arrivals were refused behind them. Decodes still ride along past
it (a decoding sequence costs a fraction of a millisecond; held back by it, the decodes of a
TTFT-only workload waited behind every prompt step, and more requests were refused for slots),
and urgent prompts are not cut by it. It is not applied when even MIN_CHUNK tokens beside the
running decodes would not fit under it.

An urgent prompt with a TTFT objective runs whole (its full chunk in one step, past the cap) when
the paced decodes can absorb that step: each paced request may lose STALL_SHARE of its *spare*
time -- its pace less a decode step of the whole running set, times its remaining outputs -- and
then still keep its pace in such steps. Cut to the cap, the same prompt would pay a step's
overhead, and the small chunk's higher price per token, many times over: on 2 cores a prompt
token cost ~230 us in a chunk of at most 64 rows and 110-130 us in one of 128 or more
(benchmarks/README.md, stop 35), so an interactive prompt cut to the pace cost the machine about
twice what it costs whole. Only that prompt joins the step past the cap (no room is left for
optional work), so the spare time goes to a first token, not to batch work.

Only the first urgent prompt of a step may go past the room: the next ones in slack order get
only the room under the cap (often nothing) unless their slack is under the price of the step
so far (waiting for it would miss their TTFT). In a burst of interactive arrivals every newcomer turns
urgent at once, and their whole prompts together made steps of 60-110 ms, each one a stall of
every running decode: on goodput.py's seed-0 2x point (ARC trace, 18.4 req/s capacity) a dozen
long interactive answers fell behind their 2 s together and then, lost, waited seconds for their
last tokens. One a step, each decode gets a token between the prompts and the first tokens come
no later (the step that held them all ended after all of them). Measured (benchmarks/README.md,
stop 40): that point met 88.3 / 96.7 / 95.0% of interactive requests against 83.3 / 81.7 / 81.7%
(3 alternating pairs); seeds 1-4 at 1x / 1.5x / 2x met 240 / 239 / 238 of 240 against 240 / 240 / 233.

Measured served (goodput.py's mixed workload at 1.5x and 2x of a 10 req/s capacity, paired
points alternating builds; interactive requests met, summed): with this room and whole urgent
prompts 465 against 380 without either (16 pairs: 12 won, 3 lost); whole prompts on top of the
room alone 316 against 275 (12 pairs: 8 won, 4 lost); whole prompts alone 739 against 673 (24
pairs: 11 won, 12 lost) -- the room is what stops the loop, and then the whole prompts help.
Those builds held decodes to the room too; letting them ride along met 242 against 247 on this
workload (8 pairs: 2 won, 6 lost) and stopped a loss on seed_table.py's TTFT-only one (see above;
benchmarks/README.md, stop 36).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from sloserve.sched.request import Request

MIN_CHUNK = 16  # tokens: the least a must-run prefill chunk makes, even past the cap
HORIZON_STEPS = 2.0  # slack under this many full-budget steps: the request must run now
TTFT_SAFETY = 0.25  # an urgent prompt is paced to be done this share of its TTFT objective after arrival
ARRIVAL_SHARE = 0.25  # of the tightest recent TTFT objective: the longest step optional prompt chunks make
ARRIVAL_WINDOW_S = 10.0  # TTFT objectives seen this recently are expected of the next arrivals
STALL_SHARE = 0.5  # of a paced request's spare time (its pace over a full decode step, per output) one step may take


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


class DeadlinePlan:
    """One step's view of every candidate's slack, the horizon and the step cap."""

    def __init__(self, price: StepPrice, running: Iterable[Request], now: float, chunk: int,
                 max_wait_s: float, step_tokens: int, finish_margin: float = 0.0,
                 arrival_ttft_s: float | None = None) -> None:
        self.price = price
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
        if arrival_ttft_s is not None and ARRIVAL_SHARE * arrival_ttft_s >= price.step_seconds(MIN_CHUNK, len(running)):
            self.arrival_cap_s = ARRIVAL_SHARE * arrival_ttft_s
        self._overdrawn = False  # a starving request's chunk already went past the cap this step
        self._urgent_prompt = False  # min_chunk already granted one urgent prompt this step (past the room if need be)
        self._waiting: list[Request] | None = None  # the waiting queue in slack order, sorted once
        self.absorb_s = math.inf  # how far past the cap one step may run for an urgent whole prompt
        paced = [r for r in running if r.first_token_time is not None and r.num_tokens - r.num_computed_tokens <= 1
                 and (r.tpot_s is not None or r.e2e_deadline is not None) and self.must_run(r)]
        floor_s = price.step_seconds(0, len(paced))  # the step of the must-run decodes alone
        for r in paced:
            pace = self.pace(r, now)
            if pace >= floor_s:
                self.cap_s = min(self.cap_s, pace)
                outputs = max(1, r.sampling.max_tokens - r.num_output_tokens)
                self.absorb_s = min(self.absorb_s, STALL_SHARE * outputs * max(0.0, pace - self.full_step_s))

    def min_chunk(self, r: Request, n: int, prompt: int, decodes: int) -> int:
        """The least of `n` prompt tokens an urgent r must compute now, in a step that already
        computes `prompt` prompt tokens and `decodes` decoding sequences: MIN_CHUNK; for a TTFT
        objective all `n` when the paced decodes can absorb the longer step (it runs whole: see
        the module docstring), else what keeps its prompt on pace to be done TTFT_SAFETY of its
        objective after it arrived, in steps of the cap, and all of its chunk once that time has
        passed (a chunk past the cap slows the paced decodes a little; one below it misses the TTFT).
        Only the first urgent prompt of a step is granted this; the next ones get the room under
        the cap (0 here) unless waiting one step would miss their TTFT -- see the module docstring.

        The aim is fixed when the request arrives. Aimed at a share of the time left instead, it
        receded with every step: the chunks shrank towards MIN_CHUNK and served first tokens landed
        at 0.25-0.32 s of a 0.3 s objective, where any late step missed it (benchmarks/README.md,
        stop 38)."""
        floor = min(n, MIN_CHUNK)
        if r.ttft_deadline is None or r.first_token_time is not None:
            return floor
        if self._urgent_prompt and self.slack(r) >= self.price.step_seconds(prompt, decodes):
            return 0  # only the room: one urgent prompt a step goes past it, and this one can wait a step
        self._urgent_prompt = True
        if self.price.step_seconds(prompt + n, decodes) + self.price.margin_s <= self.cap_s + self.absorb_s:
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
                slack = r.first_token_time + r.tpot_s * max(1, r.num_output_tokens) - now - self.full_step_s
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
        return ((r.ttft_deadline is not None and r.first_token_time is None and now > r.ttft_deadline)
                or (r.e2e_deadline is not None and now > r.e2e_deadline))

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
        return math.isinf(self.cap_s) or self.price.step_seconds(prompt, decodes + 1) + self.price.margin_s <= self.cap_s

    def sort_key(self, r: Request) -> tuple[float, float, int]:
        """Least slack first (ties: earlier arrival)."""
        return self.slack(r), r.arrival_time, r.handle

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
