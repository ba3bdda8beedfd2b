"""Preemption: who gives up its blocks or its batch slot, and how it goes back to the queue.

A preempted request swaps its K/V out to the host pool (`preemption_mode` swap, when the pool
has room) or drops it to be recomputed; either way it is requeued as PREEMPTED. A request just
resumed is spared (no thrashing). When a step fails, the swaps it asked for may not have
happened: `recover` sends those requests back to recompute.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from sloserve.config import SchedulerConfig
from sloserve.sched.block_manager import BlockManager
from sloserve.sched.output import SchedulerOutput
from sloserve.sched.queue_policy import WaitingQueue
from sloserve.sched.request import Request, RequestStatus
from sloserve.sched.slo.deadlines import DeadlinePlan
from sloserve.sched.stats import SchedulerStats


class Preemption:
    """Preempts among the scheduler's running requests (the same list object the scheduler owns)."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        waiting: WaitingQueue,
        running: list[Request],
        stats: SchedulerStats,
        urgency: Callable[[Request], tuple],
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting = waiting
        self.running = running
        self.stats = stats
        self.urgency = urgency
        self.swapped: list[Request] = []  # requests swapped in or out by the current step

    def victim(
        self, pending: deque[Request], current: Request, plan: DeadlinePlan | None
    ) -> Request:
        """Who gives up its blocks for `current`: among the running requests not yet scheduled in
        this step, the one with the most slack (slo with slack_preemption), else the least urgent
        by the policy's key; those just resumed are spared (no thrashing)."""
        key = plan.sort_key if plan is not None and self.config.slack_preemption else self.urgency
        candidates = [
            r
            for r in pending
            if r.resumed_step is None and (r.block_table or r.num_computed_tokens)
        ]
        if candidates:
            return max(candidates, key=key)
        if current.resumed_step is None or not pending:
            return current
        return pending[-1]

    def free_slot(
        self,
        req: Request,
        plan: DeadlinePlan | None,
        out: SchedulerOutput,
        scheduled: list[tuple[Request, int]],
    ) -> bool:
        """The batch is full: preempt the running request with the most slack for `req`, when `req`
        waits for its first token under a TTFT objective (a request merely starving preempts
        nobody, or the preempted would preempt back), the victim need not run, is not
        already `scheduled` in this step, has no token out yet (a decoding request frees its slot soon
        enough by finishing; preempting it only churns), and has more slack than `req` by a
        horizon. One slot per step (admission's estimate counts on that pace): as soon as a
        newcomer is queued, not once it is urgent -- a flood of newcomers that all turn urgent
        together would otherwise wait a step each, past their deadlines."""
        if (
            plan is None
            or not self.config.slack_preemption
            or req.ttft_deadline is None
            or req.first_token_time is not None
            or out.swap_out
        ):
            return False
        taken = {r.request_id for r, _ in scheduled}
        candidates = [
            r
            for r in self.running
            if r.request_id not in taken
            and r.first_token_time is None
            and r.resumed_step is None
            and not plan.must_run(r)
        ]
        if not candidates:
            return False
        victim = max(candidates, key=plan.sort_key)
        if plan.slack(victim) <= plan.slack(req) + plan.horizon_s:
            return False
        self.preempt(victim, out)
        return True

    def preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Move a running request back to the queue: swap its K/V out, else drop it (recompute)."""
        self.running.remove(req)
        pairs = None
        if self.config.preemption_mode == "swap" and req.num_computed_tokens:
            pairs = self.block_manager.swap_out(req)
        if pairs:
            out.swap_out.extend(pairs)
            self.swapped.append(req)
        else:
            self.block_manager.free(req)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.resumed_step = None
        req.num_preemptions += 1
        self.stats.preemptions_total += 1
        self.waiting.requeue(req)

    def recover(self) -> set[str]:
        """After a failed step: the requests whose swap may not have happened restart by recompute;
        the ids of those that were running in the step and are now back in the queue."""
        moved = set()
        for req in self.swapped:
            if req.status.is_finished:
                continue
            self.block_manager.free(req)
            req.num_computed_tokens = 0
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
                req.status = RequestStatus.PREEMPTED
                self.waiting.requeue(req)
                moved.add(req.request_id)
        self.swapped = []
        return moved
