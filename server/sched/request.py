"""A request's state inside the engine: tokens, progress, blocks, timing and SLO targets."""

from __future__ import annotations

import enum
import time

from sloserve.logprobs import Logprob
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SLO


class RequestStatus(enum.IntEnum):
    """Ordered lifecycle: every FINISHED_* value compares greater than the live states."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    FINISHED_REFUSED = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "cancelled",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_REFUSED: "error",
}


class Request:
    """One generation request.

    Progress is a single counter: ``num_computed_tokens`` of ``num_tokens`` (prompt + output)
    have their K/V in the cache. A prefill chunk, a prefix hit and a decode step all just move it
    forward, so there are no prefill/decode phase flags. ``block_table[i]`` holds positions
    ``[i * block_size, (i + 1) * block_size)``; ``block_hashes[i]`` is the chained hash of full
    block i once it has been computed (or matched in the prefix cache).
    """

    __slots__ = (
        "request_id",
        "handle",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "sampling",
        "slo",
        "arrival_time",
        "deadline",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "expected_cached_tokens",
        "block_table",
        "block_hashes",
        "host_table",
        "resumed_step",
        "num_preemptions",
        "first_scheduled_time",
        "first_token_time",
        "finish_time",
        "error",
        "error_kind",
        "refusal_reason",
        "sent_token_len",
        "ever_scheduled",
        "priority",
        "ttft_deadline",
        "e2e_deadline",
        "last_scheduled_time",
        "predicted_ttft_s",
        "model_ttft_s",
        "output_logprobs",
        "prompt_logprobs",
        "prompt_logprobs_sent",
        "prediction",
        "num_drafted",
        "draft_depth",
        "num_accepted",
        "prediction_accepted",
        "prediction_rejected",
    )

    def __init__(
        self, new: NewRequest, handle: int, default_ttft_s: float = 2.0, now: float | None = None
    ) -> None:
        """`now` is its arrival time when `new` carries none (time.monotonic() if None too)."""
        self.request_id = new.request_id
        self.handle = handle
        self.prompt_token_ids = list(new.token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(new.token_ids)
        self.sampling = sampling = new.params
        self.slo = slo = new.slo
        arrival = new.arrival_time if new.arrival_time is not None else now
        self.arrival_time = time.monotonic() if arrival is None else arrival
        self.priority = new.priority  # lower runs first under the 'priority' policy
        # Objectives as absolute times (None: not given). `deadline` orders the waiting queue:
        # the tighter of TTFT and end-to-end, else default_ttft_s -- an ordering key only: a
        # request is judged and refused by the objectives it gave, never by this default.
        self.ttft_deadline = (
            None if slo is None or slo.ttft_s is None else self.arrival_time + slo.ttft_s
        )
        self.e2e_deadline = (
            None if slo is None or slo.e2e_s is None else self.arrival_time + slo.e2e_s
        )
        self.deadline = self.arrival_time + _first_token_budget(slo, default_ttft_s)
        self.last_scheduled_time: float | None = None  # when a step last computed any of its tokens
        self.predicted_ttft_s: float | None = None  # admission's first-token estimate, from arrival
        # the same before calibration (admission.calibration)
        self.model_ttft_s: float | None = None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        # prompt tokens admission expects it not to compute (cached, claimed, or computed by a
        # request queued before it: sched/queued_prefixes.py) until it starts
        self.expected_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.host_table: list[int] = []  # host blocks holding the swapped-out K/V, in order
        self.resumed_step: int | None = None  # step it was resumed in; protects it from preemption
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.error: str | None = None
        # with `error`: the wire's kind of it (RequestOutput.error_kind), where not the engine's fault
        self.error_kind: str | None = None
        self.refusal_reason: str | None = None
        self.sent_token_len = 0
        self.ever_scheduled = False
        # Only when sampling asks: one entry per output token; per prompt token (position 0: None)
        self.output_logprobs: list[Logprob] | None = [] if sampling.logprobs is not None else None
        self.prompt_logprobs: list[Logprob | None] | None = None
        if sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(new.token_ids)
        self.prompt_logprobs_sent = False
        self.prediction = new.prediction
        # speculative decoding: draft tokens verified and accepted; the prediction's drafts
        # accepted and rejected (OpenAI's accepted/rejected_prediction_tokens)
        self.num_drafted = 0
        self.draft_depth: int | None = None  # drafts its next verify step may carry (sched/spec)
        self.num_accepted = 0
        self.prediction_accepted = 0
        self.prediction_rejected = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def tpot_s(self) -> float | None:
        return None if self.slo is None else self.slo.tpot_s

    @property
    def is_swapped(self) -> bool:
        return bool(self.host_table)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)

    def append_sampled(
        self, token: int, logprob: Logprob | None, eos_token_ids: frozenset[int], max_len: int
    ) -> None:
        """Append a sampled token (and its logprobs, when asked) and finish on a stop token (EOS
        unless ignore_eos, stop_token_ids) or at its length (`max_tokens`, or `max_len` tokens in
        all); before min_tokens outputs only the length ends it. Stop strings are the output
        stage's (it may end the request earlier)."""
        self.append_token(token)
        if self.output_logprobs is not None and logprob is not None:
            self.output_logprobs.append(logprob)
        params = self.sampling
        if self.num_output_tokens >= params.min_tokens and params.stops_on(token, eos_token_ids):
            self.status = RequestStatus.FINISHED_STOPPED
        elif self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_len:
            self.status = RequestStatus.FINISHED_LENGTH

    def keep_prompt_logprobs(self, runs: list[tuple[int, list[Logprob]]]) -> None:
        """Store the prompt positions' logprobs the runner computed, as (first position, entries)
        runs (a recompute after preemption computes them again: the first ones stay)."""
        if self.prompt_logprobs is None:
            return
        for first, entries in runs:
            for position, entry in enumerate(entries, first):
                if position < len(self.prompt_logprobs) and self.prompt_logprobs[position] is None:
                    self.prompt_logprobs[position] = entry

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens (and their logprobs) past the first `num_output_tokens`."""
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]
        del self.output_token_ids[num_output_tokens:]
        if self.output_logprobs is not None:
            del self.output_logprobs[num_output_tokens:]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )


def _first_token_budget(slo: SLO | None, default_ttft_s: float) -> float:
    """Seconds from arrival to the first-token deadline: the tighter of ttft and e2e, else the default."""
    if slo is None:
        return default_ttft_s
    budgets = [b for b in (slo.ttft_s, slo.e2e_s) if b is not None]
    return min(budgets) if budgets else default_ttft_s
