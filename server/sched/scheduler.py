"""The scheduler: which tokens of which requests run in the next step (plain Python, no torch).

One step: expire queue timeouts, re-key the waiting queue, then fill a token budget -- running
requests first in urgency order (a decode token each, or their next prefill chunk), preempting
the least urgent running request when blocks run out, then waiting requests in queue order
with chunked prefill while the running set is below the (adaptive) batch target. With
`prefill_order` shortest, prompts go one after another: a step computes one prompt's chunk, the
one with the least remaining prefill among equal slack, besides tails of at most MIN_CHUNK
tokens and urgent or starving requests' chunks (Scheduler._next_prompt).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence

from sloserve.config import SloserveConfig
from sloserve.errors import InvalidRequestError
from sloserve.hotpath import target_batch_size
from sloserve.logprobs import Logprob
from sloserve.new_request import NewRequest
from sloserve.sched.block_manager import BlockManager
from sloserve.sched.multistep import longest_run
from sloserve.sched.output import ScheduledSequence, SchedulerOutput, StepResult
from sloserve.sched.preemption import Preemption
from sloserve.sched.queue_policy import make_queue
from sloserve.sched.queued_prefixes import QueuedPrefixes
from sloserve.sched.request import Request, RequestStatus
from sloserve.sched.slo.admission import AdmissionControl
from sloserve.sched.slo.deadlines import MIN_CHUNK, DeadlinePlan, TightestRecent
from sloserve.sched.stats import SchedulerStats
from sloserve.spec.auto import DraftPlanner
from sloserve.spec.depth import next_depth
from sloserve.spec.proposer import NgramProposer, PredictionProposer, Proposer


class Scheduler:
    """Owns every live request, the waiting queue, the running set and the block manager."""

    def __init__(
        self,
        config: SloserveConfig,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        num_host_blocks: int = 0,
        eos_token_ids: Sequence[int] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = sc = config.scheduler
        swap = sc.preemption_mode == "swap"
        self.block_manager = BlockManager(
            num_blocks,
            block_size,
            prefix_cache=config.cache.prefix_cache,
            num_host_blocks=num_host_blocks if swap else 0,
        )
        self.block_size = block_size
        # NOTE: a request alone must always fit in the pool, else it could preempt itself forever.
        self.max_model_len = min(max_model_len, (num_blocks - 1) * block_size)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.waiting = make_queue(sc)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.admission = AdmissionControl(sc, self.max_model_len)
        self.queued_prefixes = QueuedPrefixes()
        self.step_count = 0
        self._handles = itertools.count()
        # TTFT objectives of recent newcomers: the deadline plan leaves them room
        self.arrivals = TightestRecent()
        self._scheduled: list[tuple[Request, int]] = []
        self._outputs: list[Request] = []  # finished outside update() (queue timeouts)
        self._finished_ids: list[str] = []
        self.counters = SchedulerStats()
        self.preemption = Preemption(
            sc, self.block_manager, self.waiting, self.running, self.counters, self._urgency
        )
        self._step_tokens = 0  # tokens scheduled so far in the step being composed
        self._step_decodes = 0  # of which one-token chunks (decoding sequences)
        self._step_prompts = 0  # prompt chunks of more than MIN_CHUNK tokens in it
        # Most decode steps per schedule (the core lowers it to 1 for a runner that cannot run them)
        self.max_steps = self.config.num_scheduler_steps
        # speculative decoding: drafts from prompt lookup (when on) and from a request's prediction
        self.ngram: Proposer | None = (
            NgramProposer(sc.prompt_lookup_min, sc.prompt_lookup_max)
            if sc.speculation in ("ngram", "auto")
            else None
        )
        self.predicted: Proposer = PredictionProposer(sc.prompt_lookup_max)
        # auto: the step's draft cap from measured step costs (spec/auto.py)
        self.planner = DraftPlanner(sc.num_speculative_tokens) if sc.speculation == "auto" else None
        self._draft_cap = sc.num_speculative_tokens
        # (scheduled at, rows, steps) of the last schedule that only decoded or verified
        self._last_rows: tuple[float, int, int] | None = None

    # ---- requests in and out -----------------------------------------------------------
    def add_request(self, new: NewRequest) -> Request:
        """Validate and queue a request; InvalidRequestError / RequestRefusedError say why not."""
        if new.request_id in self.requests:
            raise InvalidRequestError(f"request id {new.request_id!r} is already in use")
        if len(new.token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(new.token_ids)} tokens but the model takes at most "
                f"{self.max_model_len - 1} (room is needed for one output token); shorten it"
            )
        if (
            new.prediction is not None
            and len(new.token_ids) + len(new.prediction) > self.max_model_len
        ):
            raise InvalidRequestError(
                f"the prompt ({len(new.token_ids)} tokens) and the prediction "
                f"({len(new.prediction)} tokens) exceed the model's context of "
                f"{self.max_model_len} tokens; shorten the prediction"
            )
        now = self.clock()
        if new.slo is not None and new.slo.ttft_s is not None:
            self.arrivals.add(now, new.slo.ttft_s)
        req = Request(new, next(self._handles), self.config.default_ttft_s, now)
        cached, hashes = 0, []
        if self.admission.enabled:
            found = self._prefix(req)
            cached, hashes = self.queued_prefixes.price(req, self.block_manager, found)
        self.admission.check_new(
            req,
            now,
            self.running,
            self.waiting,
            len(self.waiting),
            self._batch_target(extra=1),
            cached,
        )
        self.requests[new.request_id] = req
        self.waiting.add(req, now)
        self.queued_prefixes.add(new.request_id, hashes)
        self.admission.queued(req)
        return req

    def abort(self, request_id: str) -> Request | None:
        """Finish a request as 'cancelled' and free its blocks now; None if it is not live."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def abort_all(self) -> list[Request]:
        """Finish every live request as 'cancelled' (shutdown, a dead engine loop)."""
        return [
            req for request_id in list(self.requests) if (req := self.abort(request_id)) is not None
        ]

    def stop_early(
        self, req: Request, num_output_tokens: int, status: RequestStatus, error: str | None = None
    ) -> None:
        """The output stage ended `req` after its first `num_output_tokens` output tokens (a stop
        string, a failure): later tokens of the step are dropped and its blocks freed."""
        self.counters.generated_tokens_total -= req.num_output_tokens - num_output_tokens
        req.truncate_output(num_output_tokens)
        req.error = error
        if req.is_finished:
            req.status = status  # already freed (a stop string on its last token)
        else:
            self._finish(req, status)
        if not self.requests:
            self.admission.on_idle()  # as update() does when its step finishes the last request

    def has_work(self) -> bool:
        """Live requests, undelivered outputs, or finished ids the executor has not been told about."""
        return bool(self.requests) or bool(self._outputs) or bool(self._finished_ids)

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work; call update() with the sampled tokens before scheduling again."""
        assert not self._scheduled, "update() must follow every schedule()"
        now = self.clock()
        self.step_count += 1
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = []
        self.preemption.swapped = []
        self._step_tokens = 0
        self._step_decodes = 0
        self._step_prompts = 0
        self._expire(now)
        if self.planner is not None:
            self._plan_drafts(now)
        plan = self._deadline_plan(now)
        budget = self.config.max_batched_tokens
        if plan is None:
            self.waiting.rekey(now)  # the aged urgency key orders the queue only without a plan
            pending = deque(sorted(self.running, key=self._urgency))
            budget, preempted = self._run(pending, out, budget, now, None)
        else:
            # Must-run requests first, running or waiting, then the optional ones under the cap;
            # each group least slack first (with slack preemption), else by the policy's key.
            order = plan.sort_key if self.config.slack_preemption else self._urgency
            pending = deque(sorted(self.running, key=lambda r: (not plan.must_run(r), order(r))))
            budget, preempted = self._run(pending, out, budget, now, plan, must_only=True)
            if not preempted:
                budget = self._admit_waiting(out, budget, now, plan, urgent_only=True)
            budget, again = self._run(pending, out, budget, now, plan)
            preempted = preempted or again
        if not preempted:
            self._admit_waiting(out, budget, now, plan)
        out.num_steps = self._run_length(out)
        prefill = any(len(seq.token_ids) > 1 for seq in out.sequences)
        only_rows = out.sequences and all(
            len(seq.token_ids) == 1 + seq.num_drafts for seq in out.sequences
        )
        self._last_rows = (now, out.num_tokens, out.num_steps) if only_rows else None
        self.admission.on_step(
            now,
            len(out.sequences),
            prefill,
            self._step_tokens,
            self._step_decodes,
            steps=out.num_steps,
        )
        bm = self.block_manager
        self.counters.kv_blocks_peak = max(
            self.counters.kv_blocks_peak, bm.num_usable - bm.num_free
        )
        return out

    def _run(
        self,
        pending: deque[Request],
        out: SchedulerOutput,
        budget: int,
        now: float,
        plan: DeadlinePlan | None,
        must_only: bool = False,
    ) -> tuple[int, bool]:
        """Schedule running requests from the front of `pending` (only must-run ones if
        `must_only`), preempting from its back when blocks run out; (budget left, preempted)."""
        preempted = False
        while pending and budget > 0:
            if pending[0].status != RequestStatus.RUNNING:
                pending.popleft()  # preempted for an urgent newcomer's slot (free_slot): queued now
                continue
            if must_only and not plan.must_run(pending[0]):
                break
            req = pending.popleft()
            n = self._chunk(req, budget, first=not out.sequences, plan=plan)
            if must_only and not plan.urgent(req) and self.config.prefill_order == "arrival":
                # starving, not urgent: progress now, the rest when there is room (in shortest
                # order _chunk gave it the step's one prompt chunk, or MIN_CHUNK past that)
                n = min(n, MIN_CHUNK)
            if plan is not None:
                n = plan.fit(req, n, *self._step_load())
            if n == 0:
                continue
            drafts = self._drafts(req, n, budget)
            while req is not None and not self.block_manager.allocate(
                req, req.num_computed_tokens + n + len(drafts)
            ):
                if drafts:
                    drafts = []  # NOTE: drafts never preempt anyone: they go when blocks are short
                    continue
                victim = self.preemption.victim(pending, req, plan)
                if victim is not req:
                    pending.remove(victim)
                self.preemption.preempt(victim, out)
                preempted = True
                if victim is req:
                    req = None
            if req is not None:
                self._schedule_chunk(req, n, out, now, plan, drafts)
                budget -= n + len(drafts)
        return budget, preempted

    def _plan_drafts(self, now: float) -> None:
        """auto: feed the planner the last schedule's cost, then cap this step's drafts."""
        last = self._last_rows
        if last is not None and self.running:
            began, rows, steps = last
            self.planner.observe_step(rows, steps, self.admission.compute_s, now - began)
        self._draft_cap = self.planner.cap(len(self.running), self.max_steps)

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """Draft tokens for `req` to verify this step: only a decode that nothing but its tokens
        steers (no grammar, logprobs, penalties, bias or min_tokens), within its max_tokens, the
        context and the step's budget; the prediction's if it has one, else prompt lookup's."""
        params = req.sampling
        if (
            n != 1
            or req.num_output_tokens == 0
            or req.num_computed_tokens + 1 != req.num_tokens
            or params.grammar is not None
            or params.logprobs is not None
            or params.needs_context
            or params.logit_bias
            or req.num_output_tokens < params.min_tokens
        ):
            return []
        proposer = self.predicted if req.prediction is not None else self.ngram
        if proposer is None:
            return []
        if req.draft_depth is None:
            req.draft_depth = self.config.num_speculative_tokens
        k = min(
            req.draft_depth,
            self._draft_cap,
            params.max_tokens - req.num_output_tokens - 1,
            self.max_model_len - req.num_tokens - 1,
            budget - 1,
        )
        return proposer.propose(req, k) if k > 0 else []

    def _run_length(self, out: SchedulerOutput) -> int:
        """How many decode steps this schedule runs back to back (1: an ordinary step).

        More than one only when nothing else could use them: every running request is in the step
        (sched/multistep.py decides how many its requests allow), nobody waits and no blocks move.
        The run's blocks are taken now (a request that stops early in the run leaves the rest of
        them to be freed with it).
        """
        seqs = out.sequences
        if (
            self.max_steps <= 1
            or not seqs
            or any(seq.num_drafts for seq in seqs)
            or self.waiting
            or out.swap_in
            or out.swap_out
            or len(seqs) != len(self.running)
        ):
            return 1
        price = self.admission.step_price()
        steps = longest_run(self._scheduled, seqs, self.max_steps, price, self.max_model_len)
        if steps <= 1:
            return 1
        bm = self.block_manager
        for (req, _), seq in zip(self._scheduled, seqs, strict=True):
            end = req.num_computed_tokens + steps
            if not bm.allocate(req, end):
                return 1  # short of blocks: the ones taken stay with their requests
            seq.block_table = req.block_table[: bm.blocks_for(end)]
        return steps

    def _admit_waiting(
        self,
        out: SchedulerOutput,
        budget: int,
        now: float,
        plan: DeadlinePlan | None,
        urgent_only: bool = False,
    ) -> int:
        """Start waiting requests in order while budget, slots and blocks allow; the budget left."""
        bm = self.block_manager
        target = self._batch_target()
        # With a deadline plan the least slack starts first: the queue's urgency key ages per step
        # (at ~100 steps/s, 0.95^steps ranks a 30 s batch request above a 0.3 s interactive one
        # within a second) and its 200 ms guard puts every old request ahead; a starving request
        # is still offered its chunk by the plan (must_run).
        queue = plan.waiting_order(self.waiting) if plan is not None else self.waiting.in_order()
        for req in queue if self.waiting else ():
            if req.status == RequestStatus.RUNNING:
                continue  # started by this step's urgent pass
            if budget <= 0:
                return budget
            if urgent_only and not plan.urgent(req):
                return budget  # the queue is in slack order: no urgent one follows
            if (
                plan is not None
                and not plan.must_run(req)
                and plan.room(*self._step_load()) < MIN_CHUNK
            ):
                continue  # optional, and the step has no room under the cap: look for a must-run one
            if (
                plan is not None
                and self._step_prompts
                and self.config.prefill_order == "shortest"
                and not plan.must_run(req)
                and self._prefill_left(req) > MIN_CHUNK
            ):
                continue  # _next_prompt would hold it back: spare pricing its prefix
            prefix = None if req.is_swapped else self._prefix(req)
            if (
                prefix is not None
                and bm.is_claimed(prefix[2])
                and (plan is None or not plan.urgent(req))
            ):
                continue  # another request is computing its next block: hit it when done
            if len(self.running) >= target and not self.preemption.free_slot(
                req, plan, out, self._scheduled
            ):
                return budget
            if req.is_swapped:
                n = self._chunk(req, budget, first=not out.sequences, plan=plan)
                if plan is not None:
                    n = plan.fit(req, n, *self._step_load())
                extra = bm.blocks_for(req.num_computed_tokens + n) - len(req.host_table)
                if n == 0 or out.swap_out or bm.num_free < len(req.host_table) + extra:
                    return budget
                out.swap_in.extend(bm.swap_in(req))
                self.preemption.swapped.append(req)
            else:
                blocks, hashes, _ = prefix
                cached = bm.hit_tokens(len(blocks), req.num_tokens)
                n = self._chunk(req, budget, first=not out.sequences, computed=cached, plan=plan)
                if plan is not None:
                    n = plan.fit(req, n, *self._step_load())
                if n == 0:
                    if plan is not None:
                        continue
                    return budget
                bm.acquire_prefix(req, blocks, hashes)
                if not bm.allocate(req, cached + n):
                    bm.free(req)
                    return budget
                req.num_computed_tokens = cached
                if not req.ever_scheduled:
                    req.num_cached_tokens = cached
                    self.counters.prompt_tokens_total += req.num_prompt_tokens
                    self.counters.prefix_hit_tokens_total += cached
            if not bm.allocate(req, req.num_computed_tokens + n):
                raise RuntimeError("block accounting broke: a checked allocation failed")
            if req.status == RequestStatus.PREEMPTED:
                req.resumed_step = self.step_count
            self.waiting.remove(req)
            self.queued_prefixes.discard(req.request_id)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._schedule_chunk(req, n, out, now, plan)
            budget -= n
        return budget

    def _prefix(self, req: Request) -> tuple[list[int], list[int], int | None]:
        """The cached prefix `req` may reuse: when it wants prompt logprobs, only full blocks before
        the row that scores its first needed one (prompt_logprobs_start - 1, see
        ScheduledSequence.prompt_logprob_rows), so that row and every later one is computed; a
        request of a LoRA adapter only that adapter's blocks (its hash chain's root)."""
        bm = self.block_manager
        if req.sampling.prompt_logprobs is not None:
            end = req.sampling.prompt_logprobs_start - 1
            return bm.find_prefix(req.all_token_ids[: max(end, 0)], bm.root(req))
        return bm.find_prefix(req.all_token_ids, bm.root(req))

    def _deadline_plan(self, now: float) -> DeadlinePlan | None:
        """This step's deadline view (the slo policy with deadline_steps), once steps have been priced."""
        if self.config.policy != "slo" or not self.config.deadline_steps:
            return None
        price = self.admission.step_price()
        if price is None:
            return None
        return DeadlinePlan.for_step(
            self.config, price, self.running, now, self.arrivals.tightest(now), self._prefill_left
        )

    def _prefill_left(self, req: Request) -> int:
        """Prompt tokens `req` still computes itself before its first token (0 once it has one);
        a queued request is spared its leading blocks that are cached or being computed."""
        if req.first_token_time is not None:
            return 0
        if req.ever_scheduled:
            return req.num_tokens - req.num_computed_tokens
        return self.queued_prefixes.own_work(req, self.block_manager)

    def _step_load(self) -> tuple[int, int]:
        """(prompt tokens, decoding sequences) scheduled so far in the step being composed."""
        return self._step_tokens - self._step_decodes, self._step_decodes

    def update(self, out: SchedulerOutput, result: StepResult) -> list[Request]:
        """Apply one step's results: advance progress, append sampled tokens, finish requests.

        Each sequence's tokens apply one after another as single steps would (a stop ends them; a
        run cut short, e.g. a sequence re-run alone after a failure, applies what it has). A
        sequence in `result.errors` alone finishes with 'error'. The logprobs are what requests
        that asked for them got: per sampled token, and per prompt position.
        Returns the requests with something new to report; their text is the output stage's.
        """
        if len(result.tokens) != len(out.sequences):
            raise ValueError(
                f"the runner returned tokens for {len(result.tokens)} of "
                f"{len(out.sequences)} sequences"
            )
        outputs, self._outputs = self._outputs, []
        now = self.clock()
        errors, prompt_logprobs = result.errors, result.prompt_logprobs
        for i, ((req, n), seq, run) in enumerate(
            zip(self._scheduled, out.sequences, result.tokens, strict=True)
        ):
            if req.status != RequestStatus.RUNNING:
                continue  # aborted or moved back to the queue during the step
            if i in errors:
                req.error = errors[i]
                self._finish(req, RequestStatus.FINISHED_ERROR)
                outputs.append(req)
                continue
            if seq.sample and not run:
                continue  # not computed
            try:
                if req.request_id in prompt_logprobs:
                    req.keep_prompt_logprobs(prompt_logprobs[req.request_id])
                if self._apply(req, n, run, now, result.logprobs.get(req.request_id)):
                    outputs.append(req)
                if seq.num_drafts:
                    self._verified(req, seq.num_drafts, len(run) - 1)
            except Exception as exc:  # one request's failure must not fail the batch
                req.error = f"{type(exc).__name__}: {exc}"
                self._finish(req, RequestStatus.FINISHED_ERROR)
                outputs.append(req)
        self._scheduled = []
        self.admission.forget()
        if not self.requests:
            self.admission.on_idle()
        return outputs

    def _apply(
        self,
        req: Request,
        n: int,
        run: list[int],
        now: float,
        logprobs: list[Logprob] | None = None,
    ) -> bool:
        """Advance `req` by its computed chunk of `n` tokens, then append its run's tokens (and their
        logprobs, when asked), each after one more step, until one finishes it; False when nothing
        was sampled (and no prompt-only request finished)."""
        self._advance(req, n)
        if not run:
            if req.sampling.prompt_only and req.num_computed_tokens >= req.num_tokens:
                # scored its prompt: nothing to sample
                self._finish(req, RequestStatus.FINISHED_LENGTH)
                return True
            return False
        if req.resumed_step is not None and self.step_count > req.resumed_step:
            req.resumed_step = None
        if req.first_token_time is None:
            req.first_token_time = now
            if req.predicted_ttft_s is not None:
                self.counters.add_ttft_error(req.predicted_ttft_s - (now - req.arrival_time))
                self.admission.on_first_token(req, now - req.arrival_time)
        for i, token in enumerate(run):
            if i:
                self._advance(req, 1)
            req.append_sampled(
                token,
                logprobs[i] if logprobs is not None and i < len(logprobs) else None,
                self.eos_token_ids,
                self.max_model_len,
            )
            self.counters.generated_tokens_total += 1
            if req.is_finished:
                self._finish(req, req.status)
                break
        return True

    def _verified(self, req: Request, drafted: int, accepted: int) -> None:
        """Count a verified draft and give back the blocks past what the request now needs (those
        only rejected drafts wrote to; never hashed, as only computed tokens are)."""
        req.num_drafted += drafted
        req.num_accepted += accepted
        req.draft_depth = next_depth(
            req.draft_depth, drafted, accepted, self.config.num_speculative_tokens
        )
        if self.planner is not None:
            self.planner.observe_verify(drafted, accepted)
        if req.prediction is not None:
            req.prediction_accepted += accepted
            req.prediction_rejected += drafted - accepted
        self.counters.spec_drafted_tokens_total += drafted
        self.counters.spec_accepted_tokens_total += accepted
        self.counters.spec_drafts_total += 1
        if not req.is_finished:
            self.block_manager.trim(req, req.num_tokens)

    def _advance(self, req: Request, n: int) -> None:
        """`req` computed `n` more tokens: commit its full blocks and count the prompt's share."""
        start = req.num_computed_tokens
        req.num_computed_tokens += n
        self.block_manager.commit(req)
        self.counters.computed_prompt_tokens_total += max(
            0, min(req.num_computed_tokens, req.num_prompt_tokens) - start
        )

    def recover_swaps(self) -> set[str]:
        """After a failed step: requests whose swap may not have happened restart by recompute.

        Returns the ids of those that were scheduled in the step and are now back in the queue.
        """
        self.admission.forget()
        return self.preemption.recover()

    # ---- helpers -----------------------------------------------------------------------
    def _urgency(self, req: Request) -> tuple:
        """The running set's order without a deadline plan (smaller runs first)."""
        if self.config.policy == "slo":
            return req.deadline, req.handle
        if self.config.policy == "priority":
            return req.priority, req.arrival_time, req.handle
        return req.arrival_time, req.handle

    def _batch_target(self, extra: int = 0) -> int:
        """Running requests allowed now (`extra`: requests about to join the queue)."""
        cap = self.config.max_batch
        if not self.config.adaptive_batch:
            return cap
        depth = len(self.running) + len(self.waiting) + extra
        return target_batch_size(cap, depth, self.config.batch_decay)

    def _chunk(
        self,
        req: Request,
        budget: int,
        first: bool,
        computed: int | None = None,
        plan: DeadlinePlan | None = None,
    ) -> int:
        """Tokens of `req` to compute now: 1 to decode, else a prefill chunk within the budget."""
        remaining = req.num_tokens - (req.num_computed_tokens if computed is None else computed)
        if remaining <= 1:
            return 1 if budget >= 1 else 0
        if self.config.chunked_prefill:
            cap = budget if first and self._alone(req) else self.config.prefill_chunk
            n = min(remaining, budget, cap)
            if remaining > MIN_CHUNK and self._step_prompts:
                return self._next_prompt(req, n, plan)
            return n
        # Without chunking a prompt runs whole; one longer than the budget may run alone.
        return remaining if remaining <= budget or first else 0

    def _next_prompt(self, req: Request, n: int, plan: DeadlinePlan | None) -> int:
        """Of `n` prompt tokens of `req`, those it computes in a step that already has a prompt
        chunk, in shortest order (prompts one after another, least remaining prefill first):
        none, as any other prompt's chunk in the step delays that prompt's first token and
        brings its own no sooner; an urgent request's all the same; a starving one's MIN_CHUNK
        (the starvation bound's offer). In arrival order every prompt of the step advances.
        Why, measured: docs/design/deadline-steps.md."""
        if self.config.prefill_order == "arrival" or (plan is not None and plan.urgent(req)):
            return n
        if plan is not None and plan.starving(req):
            return min(n, MIN_CHUNK)
        return 0

    def _alone(self, req: Request) -> bool:
        """Nobody else runs or waits: a prompt's chunk keeps no one's TPOT, so it may fill the step.

        The prefill_chunk cap bounds a step for the others' sake; alone, splitting a prompt only
        costs (each chunk pays the step's overhead: docs/design/deadline-steps.md).
        """
        running = req.status == RequestStatus.RUNNING
        return len(self.running) == running and len(self.waiting) == (not running)

    def _schedule_chunk(
        self,
        req: Request,
        n: int,
        out: SchedulerOutput,
        now: float,
        plan: DeadlinePlan | None = None,
        drafts: list[int] | None = None,
    ) -> None:
        start = req.num_computed_tokens
        end = start + n
        drafts = drafts or []
        bm = self.block_manager
        bm.claim(req)
        # Hashed blocks hold computed K/V; past `start` only when a hit covered the last token.
        kv_present = max(0, len(req.block_hashes) * self.block_size - start)
        out.sequences.append(
            ScheduledSequence(
                req_id=req.request_id,
                token_ids=req.all_token_ids[start:end] + drafts,
                start_pos=start,
                block_table=req.block_table[: bm.blocks_for(end + len(drafts))],
                sample=end == req.num_tokens and not req.sampling.prompt_only,
                sampling=req.sampling,
                num_generated=req.num_output_tokens,
                kv_present=kv_present,
                context=req.all_token_ids if req.sampling.needs_context else None,
                num_drafts=len(drafts),
            )
        )
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        req.last_scheduled_time = now
        self._step_tokens += n + len(drafts)
        if n > MIN_CHUNK:
            self._step_prompts += 1
        # priced as a decoding sequence (a prompt's last token costs about the same); a verify
        # step's rows count as prompt tokens
        if n == 1 and not drafts:
            self._step_decodes += 1
        if plan is not None and req.first_token_time is None:
            plan.paced_prefill(req, n, *self._step_load())
        req.ever_scheduled = True
        self._scheduled.append((req, n))

    def _expire(self, now: float) -> None:
        for req in self.waiting:
            if self.admission.timed_out(req, now) and not self._awaits_claim(req):
                self.admission.refusals["queue_timeout"] += 1
                req.refusal_reason = "queue_timeout"
                req.error = (
                    f"refused: waited {now - req.arrival_time:.1f}s in the queue, past the "
                    f"{self.admission.queue_timeout_s:g}s queue timeout"
                )
                self._finish(req, RequestStatus.FINISHED_REFUSED)
                self._outputs.append(req)

    def _awaits_claim(self, req: Request) -> bool:
        """Is `req` waiting for prompt blocks a running request is computing (prefix claims), or
        were they just computed, leaving it a tail? Then it waited by design and costs a tail
        now: the queue timeout passes it by."""
        if req.is_swapped:
            return False
        left = self._prefill_left(req)
        if left < req.num_tokens and left <= MIN_CHUNK:
            return True
        return self.block_manager.is_claimed(self._prefix(req)[2])

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.admission.forget()
        if req in self.running:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
            self.queued_prefixes.discard(req.request_id)
        req.status = status
        req.finish_time = self.clock()
        self.block_manager.free(req)
        self.requests.pop(req.request_id, None)
        self.counters.requests_finished_total += 1
        if req.ever_scheduled:
            self._finished_ids.append(req.request_id)

    def stats(self) -> dict:
        """The scheduler's counters, named as EngineStats' fields."""
        bm = self.block_manager
        return dict(
            waiting=len(self.waiting),
            running=len(self.running),
            kv_blocks_total=bm.num_usable,
            kv_blocks_free=bm.num_free,
            kv_blocks_cached=bm.num_cached,
            swap_blocks_total=bm.num_host_blocks,
            swap_blocks_free=bm.num_host_free,
            refusals=dict(self.admission.refusals),
            **self.counters.counters(),
        )
