"""Where one engine decode step spends its wall time: schedule, inputs, forward, sampling, outputs.

EngineCore runs `batch` greedy requests (128-token prompts, ignore_eos) until all of them decode,
then times `steps` decode steps, each split into the five phases of EngineCore.step():

  schedule   EngineCore.schedule()                          (scheduler, block manager; no torch)
  inputs     ModelRunner.prepare(): swaps, step tensors      (metadata, slot mapping, block tables)
  forward    ModelRunner.forward(): the model over paged KV  (incl. attention)
  sampling   ModelRunner.sample(): logits -> token ids
  outputs    EngineCore.update(): tokens into requests, stop checks, detokenisation

Medians of each phase are printed per batch size (mean and p90 are in the JSON). The decode
path is the fused kernel where the model takes it (executor/fused.py); `--compare-torch` also
times each batch with it off (its torch twin, the path before it), right after.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.step_breakdown [--batches 1 64] [--steps 40]

`--model` defaults to the ~40M random-weight Llama ('default-random'), the shape the issue's
figures describe; any checkpoint folder or built-in name works.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
from sloserve.engine.core import EngineCore
from sloserve.models.default import BUILTIN_MODELS, ensure_default_model
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import StepResult

from benchmarks._output import OUT, write_json

PHASES = ("schedule", "inputs", "forward", "sampling", "outputs")


def _runner_phases(runner):
    """(prepare, forward, sample) of the runner; older runners only had execute's parts inline."""
    if hasattr(runner, "prepare"):
        return runner.prepare, runner.forward, runner.sample

    def forward(step):
        return runner.model.forward(
            step.input_ids, step.positions, step.meta, runner.kv, step.sample_idx
        )

    def sample(out, step, logits):
        seqs = out.sequences
        return runner.sampler.sample(
            logits, [seqs[i].sampling for i in step.sampled], [seqs[i].req_id for i in step.sampled]
        )

    return (lambda out: runner.inputs.build(out.sequences)), forward, sample


def breakdown(core: EngineCore, batch: int, steps: int, prompt_len: int) -> dict:
    """Per-phase wall seconds of `steps` decode steps of `batch` running requests."""
    runner = core.runner
    prepare, forward, sample = _runner_phases(runner)
    sync = (
        (lambda: torch.cuda.synchronize(runner.device))
        if runner.device.type == "cuda"
        else (lambda: None)
    )
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):  # distinct prompts: no prefix sharing
        core.add(
            NewRequest(rid, [256] + [48 + (i * 7 + j) % 10 for j in range(prompt_len - 1)], params)
        )
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    sizes: list[int] = []
    warm = 3
    while len(sizes) < steps:
        t0 = time.perf_counter()
        out = core.schedule()
        t1 = time.perf_counter()
        step = prepare(out)
        t2 = time.perf_counter()
        logits = forward(step) if step is not None else None
        sync()
        t3 = time.perf_counter()
        sampled = iter(sample(out, step, logits) if step is not None else [])
        result = StepResult([[next(sampled)] if s.sample else [] for s in out.sequences])
        t4 = time.perf_counter()
        core.update(out, result, t4 - t1)
        t5 = time.perf_counter()
        decoding = all(len(s.token_ids) == 1 for s in out.sequences) and len(out.sequences) == batch
        if not decoding:
            continue
        if warm:
            warm -= 1
            continue
        sizes.append(len(out.sequences))
        for name, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            times[name].append(dt)
    for rid in ids:
        core.abort(rid)
    core.step()  # let the runner drop per-request state
    row = {"batch": batch, "steps": steps}
    total = [sum(ts) for ts in zip(*times.values(), strict=True)]
    for name, ts in (*times.items(), ("total", total)):
        ordered = sorted(ts)
        row[name] = {
            "median_ms": round(statistics.median(ts) * 1e3, 3),
            "mean_ms": round(statistics.fmean(ts) * 1e3, 3),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 3),
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default-random")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per batch size")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the decode step (eager otherwise)"
    )
    parser.add_argument(
        "--compare-torch",
        action="store_true",
        help="also time each batch with the fused decode kernel off (its torch twin), alternating",
    )
    parser.add_argument("--out", type=Path, default=OUT / "step_breakdown.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(ensure_default_model(args.model)) if args.model in BUILTIN_MODELS else args.model
    model_kw = {
        "path": path,
        "device": args.device,
        "attention_backend": args.attention_backend,
        "max_model_len": 1024,
    }
    if args.compile:
        model_kw["enforce_eager"] = False
    config = SloserveConfig(
        model=ModelConfig(**model_kw),
        cache=CacheConfig(kv_pool_bytes=256 * 1024**2, swap_bytes=0, prefix_cache=False),
        scheduler=SchedulerConfig(
            max_batch=max(args.batches),
            max_batched_tokens=2048,
            adaptive_batch=False,
            admission_control=False,
            num_scheduler_steps=1,
        ),  # one step at a time
    )
    started = time.perf_counter()
    core = EngineCore(config)
    startup = time.perf_counter() - started
    info = core.runner.info()
    print(
        f"{info['architecture']} {info['parameters'] / 1e6:.1f}M params, {info['attention_backend']} attention, "
        f"{info.get('decode_step', 'eager')} decode, {torch.get_num_threads()} threads "
        f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}), start-up {startup:.1f}s, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'batch':>5} {'path':>6} "
        + " ".join(f"{p:>9}" for p in (*PHASES, "total"))
        + "   (median ms per decode step)"
    )
    rows = []
    decode_step = core.runner.decode_step
    fused = getattr(decode_step, "fused", None)
    paths = [("fused" if fused else "torch", fused)] + (
        [("torch", None)] if args.compare_torch and fused else []
    )
    for batch in args.batches:
        for name, kernel in paths:
            if decode_step is not None:
                decode_step.fused = kernel
            row = breakdown(core, batch, args.steps, args.prompt_len) | {"path": name}
            rows.append(row)
            print(
                f"{batch:>5} {name:>6} "
                + " ".join(f"{row[p]['median_ms']:>9.2f}" for p in (*PHASES, "total"))
            )
    if decode_step is not None:
        decode_step.fused = fused
    report = {
        "benchmark": "step_breakdown",
        "model": path,
        "startup_s": round(startup, 2),
        "info": {
            k: info.get(k)
            for k in (
                "architecture",
                "parameters",
                "attention_backend",
                "decode_step",
                "warmup_time_s",
            )
        },
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "rows": rows,
    }
    write_json(args.out, report)


if __name__ == "__main__":
    main()
