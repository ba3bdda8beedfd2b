"""A minimal scheduler for executor tests: chunked prefill, batched decode, shuffled KV pages."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput


@dataclass
class _Req:
    req_id: str
    tokens: list[int]
    params: SamplingParams
    computed: int = 0
    table: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)


def generate(
    runner,
    prompts: list[list[int]],
    max_new: int,
    *,
    chunk: int | None = None,
    seed: int = 0,
    params: list[SamplingParams] | None = None,
    stagger: bool = False,
    forced: list[list[int]] | None = None,
) -> list[list[int]]:
    """Run every prompt to `max_new` tokens in shared steps; pages come from a shuffled free list.

    chunk: longest prefill chunk per step (None = whole prompt). stagger: request i joins at step i.
    forced: each prompt's continuation to feed (teacher forcing) instead of the sampled tokens,
    which are still what is returned.
    """
    free = list(range(1, runner.num_kv_blocks))
    random.Random(seed).shuffle(free)
    params = params or [SamplingParams(max_tokens=max_new) for _ in prompts]
    reqs = [
        _Req(f"r{i}", list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    step = 0
    while any(len(r.generated) < max_new for r in reqs):
        seqs, owners = [], []
        for i, r in enumerate(reqs):
            if len(r.generated) >= max_new or (stagger and i > step):
                continue
            n = len(r.tokens) - r.computed
            if chunk is not None:
                n = min(n, chunk)
            while len(r.table) * runner.block_size < r.computed + n:
                r.table.append(free.pop())
            sample = r.computed + n == len(r.tokens)
            seqs.append(
                ScheduledSequence(
                    r.req_id,
                    r.tokens[r.computed : r.computed + n],
                    r.computed,
                    list(r.table),
                    sample,
                    r.params,
                    len(r.generated),
                )
            )
            owners.append((i, r, n, sample))
        finished = [r.req_id for r in reqs if len(r.generated) >= max_new]
        result = runner.execute(SchedulerOutput(seqs, finished_req_ids=finished))
        tokens = iter(t for run in result.tokens for t in run)
        for i, r, n, sample in owners:
            r.computed += n
            if sample:
                token = next(tokens)
                r.generated.append(token)
                r.tokens.append(token if forced is None else forced[i][len(r.generated) - 1])
        step += 1
    return [r.generated for r in reqs]
