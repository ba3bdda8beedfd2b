"""Steps the runner runs on itself: warm-up, the timed shapes that prime admission, the health probe."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

if TYPE_CHECKING:
    from sloserve.executor.runner import ModelRunner


def warm_up(runner: ModelRunner) -> None:
    """Capture (or compile) the decode step's buckets, then one prefill and one decode step on the
    null page (block 0), so first requests run warm."""
    greedy = SamplingParams(max_tokens=1)
    if runner.decode_step is not None:
        null = [ScheduledSequence("warmup", [0], 0, [0], True, greedy)]
        runner.warmup_time_s = runner.decode_step.warm_up(
            lambda n: runner.inputs.build_decode(null, n)
        )
    prefill = min(runner.inputs.max_step_tokens, 4 * runner.block_size, runner.max_model_len)
    blocks = [0] * math.ceil(prefill / runner.block_size)
    runner.execute(
        SchedulerOutput([ScheduledSequence("warmup", [0] * prefill, 0, blocks, True, greedy)])
    )
    batch = min(runner.inputs.max_seqs, 8)
    seqs = [
        ScheduledSequence(f"warmup{i}", [0], prefill - 1, blocks, True, greedy)
        for i in range(batch)
    ]
    runner.execute(SchedulerOutput(seqs))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    if runner.prefetcher is not None:
        runner.prefetcher.reset()


def time_steps(
    runner: ModelRunner, shapes: list[tuple[int, int]], rounds: int
) -> list[tuple[int, int, float]]:
    """(sequences, tokens each, seconds) of steps of the given (sequences, tokens each) shapes,
    each capped to what a step holds, on an empty pool.

    Each shape runs `rounds` times; its time is the fastest run after the first (the first
    may allocate or compile; the minimum ignores a busy machine's stalls). Each sequence
    writes pages of its own (as real ones do: many writes to one page serialise), so this
    must run before any request holds a page.
    """
    greedy = SamplingParams(max_tokens=1)
    inputs, block, max_len, num_blocks = (
        runner.inputs,
        runner.block_size,
        runner.max_model_len,
        runner.num_kv_blocks,
    )
    timings = []
    for seqs, tokens in shapes:
        seqs = min(seqs, inputs.max_seqs)
        tokens = min(tokens, inputs.max_step_tokens, max_len - 1)
        # decode at a short context, as long as every sequence gets pages of its own
        pages = max(1, min(4, (num_blocks - 1) // seqs))
        start = 0 if tokens > 1 else min(pages * block, max_len) - 1
        n = math.ceil((start + tokens) / block)
        if seqs * n > num_blocks - 1:
            continue  # a pool too small for this shape: it is not timed
        out = SchedulerOutput(
            [
                ScheduledSequence(
                    f"prime{i}",
                    [0] * tokens,
                    start,
                    list(range(1 + i * n, 1 + (i + 1) * n)),
                    True,
                    greedy,
                )
                for i in range(seqs)
            ]
        )
        times = []
        for _ in range(rounds):
            began = time.perf_counter()
            runner.execute(out)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            times.append(time.perf_counter() - began)
        timings.append((seqs, tokens, min(times[1:] or times)))
    if runner.prefetcher is not None:
        runner.prefetcher.reset()
    return timings


def probe(runner: ModelRunner) -> None:
    """One greedy decode token on the null page: raises only when the runner itself is broken."""
    seq = ScheduledSequence("__probe__", [0], 0, [0], True, SamplingParams(max_tokens=1))
    runner.execute(SchedulerOutput([seq]))
    if runner.prefetcher is not None:
        runner.prefetcher.forget([seq.req_id])
