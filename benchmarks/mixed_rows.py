"""Mixed steps (decodes beside a prefill chunk) through the fused kernel's rows and through the flat
torch path, side by side in one run.

For each (decodes, chunk) shape it times `ModelRunner.execute` of one mixed step -- `decodes`
sequences decoding at position `--context` and one prompt computing a `chunk`-token chunk that
starts there, each sequence on pages of its own -- with the kernel taking it one row per token
(`FusedDecode.rows`) and with the flat path (`DecoderModel.forward`: oneDNN products, torch's flash
kernel for the chunk, the paged kernel for the decodes), in alternating rounds; the best round of
each counts. Threads are the runner's own, as served: the kernel's team, and the flat path's rule
(one thread under SERIAL_STEP_MACS). `execute` includes building the inputs and sampling.

    python -m benchmarks.mixed_rows [--model default] [--decodes 2 8 16 24] [--chunks 8 16 32]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
from sloserve.executor import ModelRunner
from sloserve.models.default import BUILTIN_MODELS, ensure_default_model
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

from benchmarks._output import OUT, write_json

GREEDY = SamplingParams(max_tokens=1 << 20)


def mixed_step(runner: ModelRunner, decodes: int, chunk: int, context: int) -> SchedulerOutput:
    """`decodes` sequences decoding at `context` and one `chunk`-token chunk from there, sampled."""
    pages = -(-(context + chunk) // runner.block_size)
    table = lambda i: list(range(1 + i * pages, 1 + (i + 1) * pages))  # noqa: E731
    seqs = [
        ScheduledSequence(f"d{i}", [48 + i % 10], context, table(i), True, GREEDY)
        for i in range(decodes)
    ]
    seqs.append(
        ScheduledSequence(
            "chunk", [48 + j % 10 for j in range(chunk)], context, table(decodes), True, GREEDY
        )
    )
    return SchedulerOutput(seqs)


def make_runner(model: str, decodes: int, chunk: int, context: int) -> tuple[str, ModelRunner]:
    """(checkpoint path, a CPU runner with pages for `decodes` + 1 sequences of `context` + `chunk` tokens)."""
    path = str(ensure_default_model(model)) if model in BUILTIN_MODELS else model
    longest = context + chunk + 64
    config = SloserveConfig(
        model=ModelConfig(path=path, device="cpu", max_model_len=longest),
        cache=CacheConfig(kv_pool_bytes=(decodes + 1) * longest * 8 * 2**10, swap_bytes=0),
        scheduler=SchedulerConfig(
            max_batch=decodes + 1, max_batched_tokens=max(1024, chunk + decodes + 1)
        ),
    )
    return path, ModelRunner(config)


def timed(runner: ModelRunner, out: SchedulerOutput, max_batch: int, steps: int) -> float:
    # 0: no mixed step fits the rows, the flat path runs
    runner.decode_step.fused.max_batch = max_batch
    return seconds_per_execute(runner, out, steps)


def seconds_per_execute(runner: ModelRunner, out: SchedulerOutput, steps: int) -> float:
    """Mean wall time of `steps` runs of ModelRunner.execute(out)."""
    started = time.perf_counter()
    for _ in range(steps):
        runner.execute(out)
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--decodes", type=int, nargs="+", default=[2, 8, 16, 24])
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument(
        "--context", type=int, default=700, help="tokens before the step, every sequence"
    )
    parser.add_argument("--steps", type=int, default=30, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT / "mixed_rows.json")
    args = parser.parse_args()
    path, runner = make_runner(args.model, max(args.decodes), max(args.chunks), args.context)
    fused = runner.decode_step.fused if runner.decode_step else None
    if fused is None:
        raise SystemExit(f"{path}: steps cannot take the fused kernel here")
    limit = fused.max_batch
    print(
        f"{runner.info()['architecture']} {runner.info()['parameters'] / 1e6:.1f}M params, context {args.context}, "
        f"rows up to {limit}, kernel threads {fused.threads}, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'decodes':>7} {'chunk':>5} {'rows ms':>8} {'flat ms':>8} {'rows/flat':>9}")
    results = []
    for decodes in args.decodes:
        for chunk in args.chunks:
            if decodes + chunk > limit:
                continue
            out = mixed_step(runner, decodes, chunk, args.context)
            best = {"rows": float("inf"), "flat": float("inf")}
            for _ in range(args.rounds):
                best["rows"] = min(best["rows"], timed(runner, out, limit, args.steps))
                best["flat"] = min(best["flat"], timed(runner, out, 0, args.steps))
            ratio = best["rows"] / best["flat"]
            results.append(
                {
                    "decodes": decodes,
                    "chunk": chunk,
                    "rows_ms": round(best["rows"] * 1e3, 3),
                    "flat_ms": round(best["flat"] * 1e3, 3),
                    "rows_over_flat": round(ratio, 3),
                }
            )
            print(
                f"{decodes:>7} {chunk:>5} {best['rows'] * 1e3:>8.2f} {best['flat'] * 1e3:>8.2f} {ratio:>9.2f}",
                flush=True,
            )
    fused.max_batch = limit
    report = {
        "benchmark": "mixed_rows",
        "model": path,
        "parameters": runner.info()["parameters"],
        "context": args.context,
        "kernel_threads": fused.threads,
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "rows": results,
    }
    write_json(args.out, report)


if __name__ == "__main__":
    main()
