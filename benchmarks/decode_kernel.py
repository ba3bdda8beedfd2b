"""The fused decode step (one C call) beside its torch twin, side by side in one run.

For each batch size and context length it times `ModelRunner.forward` on one prepared decode
step, with the runner's FusedDecode and with it switched off (DecoderModel.decode, eager torch
ops over the same paged cache), in alternating rounds (the best round of each counts), and
prints milliseconds per step and the ratio twin / fused (every batch size through the kernel,
also those above FUSED_MAX_BATCH: this is where that limit comes from). Thread counts are the runner's own
(one thread for small steps, see SERIAL_STEP_MACS), as served.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.decode_kernel [--model default] [--batches 1 2 4 8 16]

`--model` defaults to the built-in `default` (3.1M parameters: hidden 256, 4 layers, the shape
of issue 14's llama-server comparison); `default-random` is the ~40M one.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
from sloserve.executor import ModelRunner
from sloserve.executor import fused as fused_module
from sloserve.models.default import BUILTIN_MODELS, ensure_default_model
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

from benchmarks._output import OUT, write_json

GREEDY = SamplingParams(max_tokens=1 << 20)


def decode_step(runner: ModelRunner, batch: int, context: int):
    """Prepared inputs of a decode step of `batch` sequences at position `context` (pages of their own)."""
    pages = -(-(context + 1) // runner.block_size)
    seqs = [
        ScheduledSequence(
            f"r{i}",
            [48 + i],
            context,
            list(range(1 + i * pages, 1 + (i + 1) * pages)),
            True,
            GREEDY,
        )
        for i in range(batch)
    ]
    return runner.prepare(SchedulerOutput(seqs))


def timed(runner: ModelRunner, step, fused, steps: int) -> float:
    runner.decode_step.fused = fused
    started = time.perf_counter()
    for _ in range(steps):
        runner.forward(step)
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 800])
    parser.add_argument("--steps", type=int, default=50, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT / "decode_kernel.json")
    args = parser.parse_args()
    path = str(ensure_default_model(args.model)) if args.model in BUILTIN_MODELS else args.model
    config = SloserveConfig(
        model=ModelConfig(path=path, device="cpu", max_model_len=1024),
        cache=CacheConfig(
            kv_pool_bytes=(max(args.batches) * (max(args.contexts) + 64)) * 8 * 2**10, swap_bytes=0
        ),
        scheduler=SchedulerConfig(max_batch=max(args.batches), max_batched_tokens=1024),
    )
    fused_module.FUSED_MAX_BATCH = max(args.batches)  # time the kernel past its serving limit too
    runner = ModelRunner(config)
    fused = runner.decode_step.fused if runner.decode_step else None
    if fused is None:
        raise SystemExit(f"{path}: decode steps cannot take the fused kernel here")
    print(
        f"{runner.info()['architecture']} {runner.info()['parameters'] / 1e6:.1f}M params, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(default)')}, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'batch':>5} {'context':>7} {'fused ms':>9} {'torch ms':>9} {'torch/fused':>11}")
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            step = decode_step(runner, batch, context)
            best = {"fused": float("inf"), "torch": float("inf")}
            for _ in range(args.rounds):
                best["fused"] = min(best["fused"], timed(runner, step, fused, args.steps))
                best["torch"] = min(best["torch"], timed(runner, step, None, args.steps))
            ratio = best["torch"] / best["fused"]
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "fused_ms": round(best["fused"] * 1e3, 4),
                    "torch_ms": round(best["torch"] * 1e3, 4),
                    "torch_over_fused": round(ratio, 3),
                    "threads": torch.get_num_threads(),
                }
            )
            print(
                f"{batch:>5} {context:>7} {best['fused'] * 1e3:>9.3f} {best['torch'] * 1e3:>9.3f} {ratio:>11.2f}"
            )
    runner.decode_step.fused = fused
    report = {
        "benchmark": "decode_kernel",
        "model": path,
        "parameters": runner.info()["parameters"],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "rows": rows,
    }
    write_json(args.out, report)


if __name__ == "__main__":
    main()
