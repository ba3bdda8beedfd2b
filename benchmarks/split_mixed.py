"""Mixed steps past the fused kernel's rows: one flat pass against two (chunks apart, decodes in
the kernel), side by side in one run.

For each (decodes, chunk) shape whose tokens exceed the kernel's rows it times
`ModelRunner.execute` of one mixed step -- `decodes` sequences decoding at position `--context` and
one prompt computing a `chunk`-token chunk that starts there, each on pages of its own -- with
`split_mixed_steps` on (as served) and off, in alternating rounds; the best round of each counts.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.split_mixed [--decodes 16 48] [--chunks 32 64 128 512]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from sloserve.executor import ModelRunner
from sloserve.sched.output import SchedulerOutput

from benchmarks._output import OUT, write_json
from benchmarks.mixed_rows import make_runner, mixed_step, seconds_per_execute


def timed(runner: ModelRunner, out: SchedulerOutput, split: bool, steps: int) -> float:
    runner.split_mixed_steps = split
    return seconds_per_execute(runner, out, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--decodes", type=int, nargs="+", default=[16, 48])
    parser.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128, 512])
    parser.add_argument(
        "--context", type=int, default=700, help="tokens before the step, every sequence"
    )
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT / "split_mixed.json")
    args = parser.parse_args()
    path, runner = make_runner(args.model, max(args.decodes), max(args.chunks), args.context)
    if runner.decode_step is None or runner.decode_step.fused is None:
        raise SystemExit(f"{path}: steps cannot take the fused kernel here")
    print(
        f"{runner.info()['architecture']} {runner.info()['parameters'] / 1e6:.1f}M params, context {args.context}, "
        f"rows up to {runner.decode_step.fused.max_batch}, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'decodes':>7} {'chunk':>5} {'split ms':>9} {'one ms':>8} {'split/one':>9}")
    results = []
    for decodes in args.decodes:
        for chunk in args.chunks:
            out = mixed_step(runner, decodes, chunk, args.context)
            if runner.split_mixed(out) is None:
                continue  # the rows take it whole, or its decodes do not fit the kernel
            best = {"split": float("inf"), "one": float("inf")}
            for _ in range(args.rounds):
                best["split"] = min(best["split"], timed(runner, out, True, args.steps))
                best["one"] = min(best["one"], timed(runner, out, False, args.steps))
            ratio = best["split"] / best["one"]
            results.append(
                {
                    "decodes": decodes,
                    "chunk": chunk,
                    "split_ms": round(best["split"] * 1e3, 3),
                    "one_pass_ms": round(best["one"] * 1e3, 3),
                    "split_over_one": round(ratio, 3),
                }
            )
            print(
                f"{decodes:>7} {chunk:>5} {best['split'] * 1e3:>9.2f} {best['one'] * 1e3:>8.2f} {ratio:>9.2f}",
                flush=True,
            )
    runner.split_mixed_steps = True
    report = {
        "benchmark": "split_mixed",
        "model": path,
        "parameters": runner.info()["parameters"],
        "context": args.context,
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "rows": results,
    }
    write_json(args.out, report)


if __name__ == "__main__":
    main()
