"""Runs of decode steps: how many steps one schedule may run back to back (plain Python).

A run pays the per-step scheduling and output work once for several decode steps. It is only
offered when nothing else could use the steps (the scheduler checks that every running request
is in the step and nobody waits); this module decides its length from the requests themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

from sloserve.sched.output import ScheduledSequence
from sloserve.sched.request import Request
from sloserve.sched.slo.step_model import StepPrice

# Longest run of decode steps (num_scheduler_steps) at the priced step time: what a newcomer may
# wait for it, far under any TTFT objective (a tiny model's run of 4 steps takes ~2.5 ms)
MAX_RUN_S = 0.010


def longest_run(
    scheduled: Sequence[tuple[Request, int]],
    seqs: Sequence[ScheduledSequence],
    max_steps: int,
    price: StepPrice | None,
    max_model_len: int,
) -> int:
    """Steps the scheduled sequences may run back to back (1: an ordinary step).

    Every sequence must decode one token that it samples from (no prompt-logprob context, past
    its min_tokens: penalties and min_tokens read each step's tokens so far). A newcomer waits
    for the run to end, so the run is cut to MAX_RUN_S at the priced step time (a large batch's
    steps run singly), and to the fewest output tokens any request may still produce and to the
    context length. A run keeps the order of tokens, their sampling and their stop checks
    exactly as single steps would.
    """
    steps = max_steps
    if price is not None:
        steps = min(steps, int(MAX_RUN_S / max(1e-9, price.step_seconds(0, len(seqs)))))
    for (req, n), seq in zip(scheduled, seqs, strict=True):
        if (
            n != 1
            or not seq.sample
            or seq.context is not None
            or req.num_output_tokens < req.sampling.min_tokens
        ):
            return 1
        steps = min(
            steps,
            req.sampling.max_tokens - req.num_output_tokens,
            max_model_len - req.num_tokens,
        )
    return max(steps, 1)
