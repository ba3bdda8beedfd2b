"""Prime admission's step-cost model before the server reports ready.

A fresh server used to admit blindly until its cost model had seen enough real steps: a flood
arriving right after start-up was let in whole and missed its TTFT. Priming times steps of the
shapes serving will run -- decode batches from one sequence to the full batch, and prefill
chunks up to the chunk size -- on the pages of the still empty pool (the runner's time_steps),
and feeds them to the model the scheduler prices steps with.
"""

from __future__ import annotations

from sloserve.config import SchedulerConfig
from sloserve.engine.runner import Runner
from sloserve.sched.slo.admission import AdmissionControl


def priming_shapes(config: SchedulerConfig, max_model_len: int) -> list[tuple[int, int]]:
    """(sequences, tokens per sequence) of the steps to time: decode batches, then prefill chunks."""
    batch = min(config.max_batch, config.max_batched_tokens)
    decode = sorted({b for b in (1, 4, 16, batch) if b <= batch})
    chunk = min(
        config.prefill_chunk if config.chunked_prefill else config.max_batched_tokens,
        config.max_batched_tokens,
        max_model_len - 1,
    )
    prefill = sorted({c for c in (chunk // 4, chunk // 2, chunk) if c > 1})
    return [(b, 1) for b in decode] + [(1, c) for c in prefill]


def prime(
    runner: Runner, admission: AdmissionControl, config: SchedulerConfig, max_model_len: int
) -> int:
    """Time the priming shapes with `runner.time_steps` and feed admission; returns the steps fed.

    A runner that cannot time steps (RunnerDefaults: a test double) leaves the model unprimed.
    """
    timings = runner.time_steps(priming_shapes(config, max_model_len))
    for seqs, each, seconds in timings:
        admission.on_compute(seqs * each, seconds, decodes=seqs if each == 1 else 0)
    return len(timings)
