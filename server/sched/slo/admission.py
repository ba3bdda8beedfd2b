"""Admission control: refuse early, with a reason, what cannot be served in time."""

from __future__ import annotations

import heapq
import math
import statistics
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sloserve.config import SchedulerConfig
from sloserve.errors import RequestRefusedError
from sloserve.sched.quantiles import nearest_rank
from sloserve.sched.request import Request
from sloserve.sched.slo.step_model import MixedStepModel, StepCostModel, StepPrice

REASONS = ("queue_full", "deadline_passed", "slo_unattainable", "queue_timeout", "draining")
# with others running or waiting, the estimate must fit in this share of the time left
SLO_MARGIN = 0.6
LONG_DECAY = 0.995  # the long window of step cycle times (a weight of 1/e after 200 steps)
LONG_WAIT_STEPS = 20  # waits of at least this many steps are also priced by the long window
CALIBRATION_KEPT = 32  # first tokens whose actual / estimated TTFT ratio calibrates the estimate
CALIBRATION_QUANTILE = 0.9
CALIBRATION_MIN_S = 0.25  # shorter waits are mostly fixed delays: their ratios say little
# the margin for a request next in line: this quantile of recent first tokens' lateness
LATE_QUANTILE = 0.9
LATE_MIN_SAMPLES = 8  # fewer recent first tokens than this: the SLO_MARGIN share instead
LATE_WINDOW_S = 10.0  # first tokens older than this say nothing of the load now
# prompt tokens: a step with at least this many tells what a prompt token costs
PROMPT_STEP_MIN = 64
PROMPT_STEPS_KEPT = 32  # recent prompt steps whose cost per prompt token prices a prompt alone


@dataclass(frozen=True, slots=True)
class FirstTokenEstimate:
    """When a new request's first token is expected, and what it waits for."""

    seconds: float
    steps: int  # engine steps until its first token
    slot_steps: int  # of which spent waiting for a free slot in the running batch
    tokens: int  # tokens all requests compute in those steps (an upper bound)
    ahead: int  # waiting requests that start before it


@dataclass(slots=True)
class Backlog:
    """The running batch as slots, after the waiting requests ahead took theirs in order.

    ``slots`` is a min-heap of the step at which each of the ``cap`` slots frees: a running
    request holds its slot for its remaining steps (prefill chunks, then one step per output token
    it may still produce -- max_tokens is an upper bound, so this errs late); each queued request
    takes the slot that frees first and holds it for its own steps.
    """

    slots: list[int]
    cap: int
    pending: int = 0  # tokens the requests in it compute before their next token
    prefill_steps: set[int] = field(default_factory=set)  # steps that run someone's prefill chunk
    occupants: int = 0  # running + queued requests in it
    queued: int = 0
    last_key: tuple = ()  # the policy's queue key of the last queued request (() sorts first)


class AdmissionControl:
    """Queue cap (always), deadline / SLO / queue-timeout checks (when enabled); counts refusals.

    The first-token estimate keeps a Backlog of the running set and the whole waiting queue
    between steps: a request due no sooner than everyone queued (the usual case) is priced
    against it in O(log cap) and appended; a more urgent one gets a Backlog of just the requests
    ahead of it, O(running + waiting). The scheduler calls forget() whenever a step changes them.
    """

    def __init__(self, config: SchedulerConfig, max_model_len: int | None = None) -> None:
        self.enabled = config.admission_control
        self.policy = config.policy
        # slo with deadline steps starts the least slack first: no starvation guard jumps ahead
        self.deadline_order = config.policy == "slo" and config.deadline_steps
        self.slot_preemption = self.deadline_order and config.slack_preemption
        self.max_waiting = config.max_waiting
        self.queue_timeout_s = config.queue_timeout_s
        self.max_wait_s = config.max_wait_s
        self.step_tokens = config.max_batched_tokens
        # Most prompt tokens of one request in one step (without chunking a prompt runs whole).
        self.chunk = (
            min(config.prefill_chunk, config.max_batched_tokens)
            if config.chunked_prefill
            else 1 << 30
        )
        self.max_model_len = max_model_len
        self.speed = StepCostModel()  # step compute time, fed by the engine loop
        self.mix = MixedStepModel()  # the same, per prompt token and per decoding sequence
        # Schedule-to-schedule time of busy steps against their number of sequences (on_step):
        # what a queued request really waits per step -- compute plus output delivery, lock and
        # GIL contention. Kept apart for decode-only steps and steps with a prefill chunk: a
        # backend may run the two very differently (batched decode, but a per-sequence loop
        # once any prompt is in), and the per-sequence cost is what a full batch pays.
        self.cycles = (StepCostModel(decay=0.95), StepCostModel(decay=0.95))
        # The same cycle times over a longer window (~200 steps): a wait of hundreds of steps is
        # priced at the slower of the two, so a lull of a few dozen fast steps on a contended
        # machine does not admit a queue that the usual step time cannot serve in time.
        self.long_cycles = StepCostModel(decay=LONG_DECAY)
        self.refusals: Counter[str] = Counter()
        self._backlog: Backlog | None = None
        # (start, sequences, prefill) of the step in flight
        self._step: tuple[float, int, bool] | None = None
        self._compute_s = 0.0  # compute time of the last step (on_compute)
        self._step_load = (0, 0)  # (prompt tokens, decoding sequences) of the step in flight
        self._steps = 1  # steps in the run in flight
        self.gap_s = 0.0  # EWMA of schedule-to-schedule time minus compute: output delivery, IPC
        self._delivery = (0.0, 0.0)  # (lag_s, reported at): see report_delivery_lag
        self._ratios: deque[float] = deque(maxlen=CALIBRATION_KEPT)  # actual / model TTFT, recent
        self.calibration = 1.0  # estimates are multiplied by this (>= 1): see on_first_token
        # (when, s late): see lateness
        self._late: deque[tuple[float, float]] = deque(maxlen=CALIBRATION_KEPT)
        # s per prompt token: see alone_seconds
        self._prompt_costs: deque[float] = deque(maxlen=PROMPT_STEPS_KEPT)

    def refuse(self, reason: str, message: str) -> RequestRefusedError:
        """Count a refusal and build its error."""
        self.refusals[reason] += 1
        return RequestRefusedError(reason, message)

    # ---- what the scheduler reports --------------------------------------------------------
    def on_step(
        self,
        now: float,
        seqs: int,
        prefill: bool,
        tokens: int = 0,
        decodes: int = 0,
        steps: int = 1,
    ) -> None:
        """A step of `seqs` sequences and `tokens` tokens (0: nothing ran; `decodes` of them one
        decoding sequence each), with a prefill chunk or not, was scheduled at `now`; `steps` > 1:
        a run of that many such decode steps (its cycle is priced per step)."""
        if self._step is not None:
            began, n, kind = self._step
            cycle = (now - began) / self._steps
            self.cycles[kind].observe(n, cycle)
            self.long_cycles.observe(sum(self._step_load), cycle)
            self.gap_s = 0.9 * self.gap_s + 0.1 * max(0.0, cycle - self._compute_s)
        self._step_load = (tokens - decodes, decodes)
        self._step = (now, seqs, prefill) if seqs > 0 else None
        self._steps = steps
        self._backlog = None

    def on_compute(self, tokens: int, seconds: float, decodes: int = 0) -> None:
        """The runner computed a step of `tokens` tokens, `decodes` of them one decoding sequence
        each, in `seconds` (priming steps too)."""
        self.speed.observe(tokens, seconds)
        self.mix.observe(tokens - decodes, decodes, seconds)
        if tokens - decodes >= PROMPT_STEP_MIN:
            self._prompt_costs.append(seconds / (tokens - decodes))
        self._compute_s = seconds

    @property
    def compute_s(self) -> float:
        """Compute time of the last step the runner reported (on_compute)."""
        return self._compute_s

    def report_delivery_lag(self, lag_s: float, now: float) -> None:
        """The front end handed a first token to its client `lag_s` after the engine produced it.

        The engine's steps are not all a first token waits for: a front end that falls behind on
        delivering outputs (a flood of streams on a small machine) adds its backlog to every TTFT.
        """
        self._delivery = (max(lag_s, self.delivery_lag(now)), now)

    def delivery_lag(self, now: float) -> float:
        """The largest reported backlog, less the time since it was reported: a backlog drains in
        real time when nothing is added to it. A smaller report does not lower it at once (the
        backlog swings within a burst of outputs, and a first token is delivered behind the
        backlog of its own time, not of now); a stale report from an overload fades within its
        own length, so it never refuses light load for long."""
        lag, at = self._delivery
        return max(0.0, lag - max(0.0, now - at))

    def on_first_token(self, req: Request, ttft_s: float) -> None:
        """`req` got its first token `ttft_s` after arrival: record how late it came against its
        estimate (see lateness) and calibrate the estimate by it.

        The step-cost model prices the steps a newcomer waits for at today's step time, and over
        a long wait the machine changes under it. The calibration is the CALIBRATION_QUANTILE of
        recent actual / estimated ratios, never below 1 (an estimate that errs late refuses a
        little early, which the margin already does), forgotten when the engine goes idle like the
        cycle times. It learns only from requests with a TTFT objective (one without is overtaken
        by every tighter newcomer, by design) and waits of CALIBRATION_MIN_S or more (a short wait
        is mostly fixed delays). Evidence: docs/design/admission.md.
        """
        if req.ttft_deadline is None or req.predicted_ttft_s is None:
            return
        # NOTE: a request that missed is then overtaken by design: its lateness counts up to its objective
        self._late.append(
            (
                req.arrival_time + ttft_s,
                min(ttft_s - req.predicted_ttft_s, req.ttft_deadline - req.arrival_time),
            )
        )
        if req.model_ttft_s is None or req.model_ttft_s < CALIBRATION_MIN_S:
            return
        self._ratios.append(ttft_s / req.model_ttft_s)
        ordered = sorted(self._ratios)
        self.calibration = max(
            1.0, ordered[min(len(ordered) - 1, int(CALIBRATION_QUANTILE * len(ordered)))]
        )

    def lateness(self, now: float) -> float | None:
        """How late first tokens under a TTFT objective came against their estimate (the
        LATE_QUANTILE of the last LATE_WINDOW_S, never below 0); None with too few to tell.

        The margin of a request that starts at the next step, up to the share SLO_MARGIN leaves:
        its estimate is the step in flight and its own prefill, whose error the recent first
        tokens measure (the share alone refused at light load what would have met; uncapped, the
        margin refused more under load: docs/design/admission.md).
        """
        late = self._late
        while late and late[0][0] < now - LATE_WINDOW_S:
            late.popleft()
        if len(late) < LATE_MIN_SAMPLES:
            return None
        return max(0.0, nearest_rank(sorted(x for _, x in late), LATE_QUANTILE))

    def alone_seconds(self, tokens: int) -> float:
        """A prompt of `tokens` alone on an idle engine, at the median cost per prompt token of the
        last PROMPT_STEPS_KEPT steps of at least PROMPT_STEP_MIN prompt tokens (infinite before any).

        An idle engine refuses a prompt only when even this misses: under light load nearly every
        step is a single decode, and the step model's fit cannot tell prompt tokens from decoding
        sequences (docs/design/admission.md).
        """
        if not self._prompt_costs:
            return math.inf
        return tokens * statistics.median(self._prompt_costs)

    def on_idle(self) -> None:
        """No live requests: the gap before the next step is no step time, and the cycle times
        of the load that just ended are forgotten -- the next load re-learns them within a few
        steps, priced meanwhile by the compute-time model (no estimate carried over from an overload)."""
        self._step = None
        self.cycles = (StepCostModel(decay=0.95), StepCostModel(decay=0.95))
        self.long_cycles = StepCostModel(decay=LONG_DECAY)
        self.gap_s = 0.0
        self._delivery = (0.0, 0.0)
        self._ratios.clear()
        self.calibration = 1.0
        self._late.clear()

    def step_price(self) -> StepPrice | None:
        """The deadline plan's step price: compute time (overhead, per prompt token, per decoding
        sequence; one slope for all tokens until the mix tells them apart) plus the mean gap."""
        mixed = self.mix.fit()
        if mixed is not None:
            return StepPrice(mixed[0] + self.gap_s, mixed[1], mixed[2], self.mix.margin())
        fit = self.speed.fit()
        if fit is None:
            return None
        return StepPrice(fit[0] + self.gap_s, fit[1])

    def forget(self) -> None:
        """The running set or the queue changed other than by queued(): rebuild the Backlog."""
        self._backlog = None

    def queued(self, req: Request) -> None:
        """`req` joined the end of the waiting queue."""
        b = self._backlog
        if b is not None and self._key(req) >= b.last_key:
            self._take_slot(b, req)
        else:
            self._backlog = None

    # ---- admission -------------------------------------------------------------------------
    def check_new(
        self,
        req: Request,
        now: float,
        running: Sequence[Request],
        waiting: Iterable[Request],
        num_waiting: int,
        batch_cap: int,
        cached_tokens: int,
    ) -> None:
        """Raise RequestRefusedError when `req` should not even be queued.

        `waiting` is the queue in arrival order, `batch_cap` the most requests that run at once.
        """
        if num_waiting >= self.max_waiting:
            raise self.refuse(
                "queue_full",
                f"the waiting queue is full ({self.max_waiting} requests); "
                "retry later or raise max_waiting",
            )
        if not self.enabled:
            return
        due = req.ttft_deadline if req.ttft_deadline is not None else req.e2e_deadline
        if due is not None and due <= now:
            raise self.refuse(
                "deadline_passed", f"the first-token deadline passed {now - due:.3f}s ago"
            )
        est = self._first_token(req, now, running, waiting, batch_cap, cached_tokens)
        if est is None:
            return
        req.model_ttft_s = now - req.arrival_time + est.seconds
        wait = est.seconds * self.calibration
        req.predicted_ttft_s = now - req.arrival_time + wait
        if due is None:
            return  # no objective: never refused for time
        left = due - now
        lag = self.delivery_lag(now)
        # A TTFT objective keeps a margin for the estimate's error when others run or wait: a
        # share of the time left, or next in line, how late recent first tokens came against
        # their estimates when that is less (the wait behind others is what the estimate knows
        # least). An idle engine refuses a prompt only when its own steps would miss, priced at
        # the better of the step model and recent prompt steps (alone_seconds): the margin there
        # refused prompts that met a tight objective; under load dropping it admitted more that
        # missed: README. An end-to-end-only objective is refused only when even its first token
        # would come after the deadline.
        idle = not running and num_waiting == 0
        if idle and req.ttft_deadline is not None:
            wait = min(wait, self.alone_seconds(max(1, req.num_tokens - cached_tokens)))
        if req.ttft_deadline is None or idle:
            late = wait + lag > left
        elif est.ahead == 0 and (margin := self.lateness(now)) is not None:
            late = wait + lag + min(margin, (1.0 - SLO_MARGIN) * left) > left
        else:
            late = wait + lag > SLO_MARGIN * left
        if late:
            slot = (
                f"{est.slot_steps} steps for a slot in the full batch of {batch_cap}, "
                if est.slot_steps
                else ""
            )
            behind = f" + {lag:.2f}s of output backlog in the front end" if lag > 0 else ""
            raise self.refuse(
                "slo_unattainable",
                f"first token expected in ~{wait + lag:.2f}s ({slot}{est.steps} steps in all, "
                f"{len(running)} running and {est.ahead} waiting ahead{behind}) but the SLO allows "
                f"{left:.2f}s; relax the SLO or retry later",
            )

    def _first_token(
        self,
        req: Request,
        now: float,
        running: Sequence[Request],
        waiting: Iterable[Request],
        batch_cap: int,
        cached_tokens: int,
    ) -> FirstTokenEstimate | None:
        """When `req`'s first token comes, queued by the policy's order; None before steps were timed."""
        cost = self.step_costs()
        if cost is None:
            return None
        b = self._backlog
        if b is None or b.cap != batch_cap:
            b = self._backlog = self.backlog(running, waiting, batch_cap)
        key = self._key(req)
        if key < b.last_key:
            # Ahead of some queued requests: it starts before those -- unless (slo) they wait
            # past the starvation guard before its first token and then go first. It computes
            # the blocks it shares with them itself (only cached or claimed ones are spared).
            ahead = [r for r in waiting if self._key(r) <= key]
            b = self.backlog(running, ahead, batch_cap, key)
            if self.policy == "slo" and not self.deadline_order:
                est = self._price(b, req, cached_tokens, cost, now)
                starve_by = now + est.seconds - self.max_wait_s
                starving = [r for r in waiting if self._key(r) > key and r.arrival_time < starve_by]
                if starving:
                    b = self.backlog(running, starving + ahead, batch_cap)
            return self._price(b, req, cached_tokens, cost, now)
        # Last in line: the blocks it shares with a queued request are computed before it starts.
        return self._price(b, req, max(cached_tokens, req.expected_cached_tokens), cost, now)

    def _key(self, r: Request) -> tuple:
        """The waiting order of the policy (fifo: arrival, so a newcomer is always last)."""
        if self.policy == "slo":
            return (r.deadline,)
        if self.policy == "priority":
            return (r.priority, r.arrival_time)
        return (r.arrival_time,)

    def estimate(
        self,
        req: Request,
        running: Sequence[Request],
        ahead: Iterable[Request],
        batch_cap: int,
        cached_tokens: int = 0,
        now: float | None = None,
    ) -> FirstTokenEstimate | None:
        """First-token estimate of `req` queued behind `ahead`; None before any step was timed."""
        cost = self.step_costs()
        if cost is None:
            return None
        return self._price(self.backlog(running, ahead, batch_cap), req, cached_tokens, cost, now)

    def step_costs(self) -> tuple[tuple[float, float], tuple[float, float]] | None:
        """(overhead_s, per_sequence_s) of a decode-only step and of a step with prefill; None if unknown.

        Each from the step cycles of its kind when seen, else the compute times (per token, which
        a decode step has one of per sequence), else the other kind.
        """
        decode, prefill = (c.step_cost() or self.speed.step_cost() for c in self.cycles)
        if decode is None and prefill is None:
            return None
        return decode or prefill, prefill or decode

    def backlog(
        self,
        running: Sequence[Request],
        ahead: Iterable[Request],
        batch_cap: int,
        key: tuple | None = None,
    ) -> Backlog:
        """The slots after `running` and then `ahead` (in start order) took theirs.

        `key`: the newcomer's place in deadline order; running requests after it (more slack)
        compute only their next token before its first one, not the rest of their prompts.
        """
        cap = max(1, batch_cap)
        # NOTE: with slack preemption a newcomer takes the slot of a running request that has no
        # TTFT or TPOT objective and no token out yet (sched/preemption.py free_slot): those hold
        # no slot here.
        holders = [
            r
            for r in running
            if not self.slot_preemption
            or r.tpot_s is not None
            or r.ttft_deadline is not None
            or r.first_token_time is not None
        ]
        steps = sorted(self._work(r)[1] for r in holders)
        # Slot i frees when the (len(running) - cap + 1 + i)-th running request finishes. A slot
        # taken from a request without objectives frees only when the scheduler preempts it, one
        # per step: the k-th such slot is free at step k.
        free = [0] * max(0, cap - len(running))
        taken = list(range(1, len(running) - len(holders) + 1))
        first = [
            r for r in running if key is None or not self.deadline_order or self._key(r) <= key
        ]
        b = Backlog(
            slots=sorted(free + taken + steps)[-cap:],
            cap=batch_cap,
            pending=len(running)
            - len(first)
            + sum(max(1, r.num_tokens - r.num_computed_tokens) for r in first),
            occupants=len(steps),
        )
        for r in first:
            b.prefill_steps.update(self._prefill_range(r.num_tokens - r.num_computed_tokens, 0))
        for r in ahead:
            self._take_slot(b, r)
        return b

    def _take_slot(self, b: Backlog, r: Request) -> None:
        pending, steps = self._work(r)
        b.prefill_steps.update(self._prefill_range(pending, b.slots[0]))
        heapq.heapreplace(b.slots, b.slots[0] + steps)
        b.pending += pending
        b.occupants += 1
        b.queued += 1
        b.last_key = max(b.last_key, self._key(r))

    def _price(
        self,
        b: Backlog,
        req: Request,
        cached_tokens: int,
        costs: tuple[tuple[float, float], tuple[float, float]],
        now: float | None,
    ) -> FirstTokenEstimate:
        """Steps until `req`'s first token after `b`, and their time.

        Its first token comes with its last prefill chunk, run once a slot is free. The steps
        compute the pending tokens of everyone and at most one token per occupant per step; they
        are never fewer than the token budget allows (the extra ones run prefill). Each is priced
        for the occupied slots by its kind (with a prefill chunk or not), and all wait for the
        step in flight to end. With nothing pending (nobody running or queued) its prompt fills
        the step's token budget instead of a chunk, as the scheduler runs it (Scheduler._alone).
        """
        start = b.slots[0]
        own = max(1, req.num_tokens - cached_tokens)
        chunk = max(self.chunk, self.step_tokens) if b.pending == 0 else self.chunk
        steps = start + -(-own // chunk)
        busy = min(b.cap, b.occupants)
        tokens = b.pending + own + steps * busy
        mixed = len(b.prefill_steps) + sum(
            1 for t in self._prefill_range(own, start, chunk) if t not in b.prefill_steps
        )
        extra = max(0, -(-tokens // self.step_tokens) - steps)
        steps += extra
        mixed = min(steps, mixed + extra)
        price = self.step_price() if self.deadline_order else None
        if price is not None:
            # Deadline steps run the urgent first and cut optional work to the pace, so a step
            # costs what it computes for those ahead: priced by tokens, not by past step times.
            decodes = steps * busy  # one token per occupant per step
            seconds = (
                steps * price.overhead_s
                + price.per_token_s * (tokens - decodes)
                + price.decode_s * decodes
            )
            if self._step is not None and now is not None:
                seconds += max(
                    0.0, self._steps * price.step_seconds(*self._step_load) - (now - self._step[0])
                )
            seconds = max(seconds, self._long_run_seconds(steps, tokens))
            return FirstTokenEstimate(
                seconds=seconds, steps=steps, slot_steps=start, tokens=tokens, ahead=b.queued
            )
        (d_over, d_seq), (p_over, p_seq) = costs
        seqs = min(b.cap, b.occupants + 1)
        fit = self.speed.fit()  # prompt tokens on top of the per-sequence cost, at compute speed
        seconds = (
            (steps - mixed) * (d_over + d_seq * seqs)
            + mixed * (p_over + p_seq * seqs)
            + (tokens - steps * busy) * (fit[1] if fit else 0.0)
        )
        if self._step is not None and now is not None:
            began, in_flight, kind = self._step
            over, per_seq = costs[kind]
            seconds += max(0.0, self._steps * (over + in_flight * per_seq) - (now - began))
        seconds = max(seconds, self._long_run_seconds(steps, tokens))
        return FirstTokenEstimate(
            seconds=seconds, steps=steps, slot_steps=start, tokens=tokens, ahead=b.queued
        )

    def _long_run_seconds(self, steps: int, tokens: int) -> float:
        """`steps` steps computing `tokens` tokens at the long window's cycle times (0 before it has
        any). A wait longer than the short window is more likely to see the longer run's step time
        than the last few dozen steps' (on a shared machine they swing by several times within a
        second); a short wait keeps the short window's price, which is never lowered by this."""
        if steps < LONG_WAIT_STEPS:
            return 0.0
        cost = self.long_cycles.step_cost()
        return 0.0 if cost is None else steps * cost[0] + tokens * cost[1]

    def _prefill_range(self, pending: int, start: int, chunk: int | None = None) -> range:
        """The steps from `start` that run prefill chunks of `pending` tokens (none for one token)."""
        return (
            range(start, start + -(-pending // (chunk or self.chunk))) if pending > 1 else range(0)
        )

    def _work(self, r: Request) -> tuple[int, int]:
        """(tokens to compute before its next token, steps until it finishes); a request not yet
        started is spared the prompt blocks it expects from the cache or a request before it."""
        done = r.num_computed_tokens if r.ever_scheduled else r.expected_cached_tokens
        pending = max(1, r.num_tokens - done)
        outputs = r.sampling.max_tokens - r.num_output_tokens
        if self.max_model_len is not None:
            outputs = min(outputs, self.max_model_len - r.num_tokens)
        return pending, -(-pending // self.chunk) + max(1, outputs) - 1

    def timed_out(self, req: Request, now: float) -> bool:
        """True when a never-started request has waited longer than the queue timeout."""
        return (
            self.enabled
            and not req.ever_scheduled
            and now - req.arrival_time > self.queue_timeout_s
        )
