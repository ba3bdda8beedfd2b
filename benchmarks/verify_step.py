"""What a verify step costs against a one-token decode step: one sequence at a given context.

The runner's step (`ModelRunner.execute`: inputs, the kernel or torch path, verification) of one
sequence at `--context` tokens, decoding one token and verifying k drafts, each timed as the
median of `--repeat` calls, the best of `--rounds` rounds (the arms alternate within a round, so
drift on a shared machine hits them alike). By default the fused kernel runs on one thread and
a step is timed in the CPU time of that thread (what it costs its core; on a machine shared with
other work, wall time mostly measures the wait for a core); `--wall` times wall-clock time on the
kernel's own team instead. Prints each verify step's time as a multiple of the decode step's
and the load average. Two builds compare by running this under each one's Python:

    python -m benchmarks.verify_step [--model default] [--context 1000] [--k 4 8 16] [--wall] [--json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from sloserve import LLM
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

from benchmarks._output import write_json

RESULTS = Path(__file__).resolve().parent / "results"


def step_seconds(runner, context: int, drafts: int, repeat: int, clock=time.thread_time) -> float:
    """Median seconds of `repeat` steps of one sequence at `context` computing 1 + drafts tokens."""
    tokens = [5 + i % 7 for i in range(drafts + 1)]
    table = list(range(1, 2 + (context + drafts + 1) // runner.block_size))
    params = SamplingParams(max_tokens=64)
    times = []
    for _ in range(repeat):
        seq = ScheduledSequence("v", tokens, context, table, True, params, num_drafts=drafts)
        began = clock()
        runner.execute(SchedulerOutput([seq]))
        times.append(clock() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8, 16], help="drafts per step")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wall", action="store_true", help="wall time on the kernel's own team")
    parser.add_argument(
        "--json", action="store_true", help="write benchmarks/results/verify_step.json"
    )
    args = parser.parse_args()
    llm = LLM(
        model=args.model,
        device="cpu",
        max_model_len=args.context + 64,
        max_batch=1,
        kv_pool_bytes=256 << 20,
    )
    runner = llm._core.runner
    clock = time.perf_counter if args.wall else time.thread_time
    if not args.wall and runner.decode_step is not None and runner.decode_step.fused is not None:
        runner.decode_step.fused.threads = 1
    arms = [0, *args.k]
    best = {k: float("inf") for k in arms}
    for r in range(args.rounds):
        for k in arms if r % 2 == 0 else arms[::-1]:
            best[k] = min(best[k], step_seconds(runner, args.context, k, args.repeat, clock))
    llm.close()
    load = os.getloadavg()[0]
    decode = best[0]
    cells = " ".join(f"k={k}: x{best[k] / decode:.2f}" for k in args.k)
    what = "wall" if args.wall else "CPU"
    print(
        f"{args.model} at {args.context} tokens, {what} time: decode {decode * 1e3:.3f} ms; "
        f"{cells} (load {load:.1f})"
    )
    if args.json:
        report = {"model": args.model, "context": args.context, "clock": what, "load": load}
        report["decode_s"] = decode
        report["verify_x_decode"] = {str(k): best[k] / decode for k in args.k}
        write_json(RESULTS / "verify_step.json", report)


if __name__ == "__main__":
    main()
