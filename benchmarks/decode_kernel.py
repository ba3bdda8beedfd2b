"""The fused decode step (one C call) beside its torch twin, float32 and bf16, side by side in one run.

For each dtype (one runner each on the same checkpoint), batch size and context length it times
`ModelRunner.forward` on one prepared decode step, with the runner's FusedDecode and with it
switched off (DecoderModel.decode, eager torch ops over the same paged cache), and for bf16 also
a runner on oneDNN's packed bf16 copies (fused.BF16_DECODE off, as served on a CPU without
AVX512-BF16 dot products) and, where the CPU has them, the kernel's widened path beside its dot
products (`widened`: float32 arithmetic on the widened weights, the fallback elsewhere); every
arm in each round (the best round of each counts). It prints milliseconds per step and the
ratios: twin / fused per dtype, packed / fused and widened / fused for bf16, and the first
dtype's fused step / the second's (every batch size through the kernel, also those above its serving
limit: this is where that limit comes from). Thread counts are the runner's own, as served,
unless `--threads` sets both (one thread: the products alone, without the team's barriers,
which a machine shared with other busy processes stalls).

At batch 1 a step reads every weight once, so it is bound by memory bandwidth: beside it a plain
streaming read (`torch.sum` of a 1 GiB buffer, the same threads) measures the machine's read rate,
and the table gives each dtype's ceiling (weight bytes per token / that rate, in tokens/s) and the
fused step's share of it.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.decode_kernel [--model default] [--batches 1 4 16]
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.decode_kernel --model qwen-shape --dtypes float32 bfloat16

`--dtypes int8` adds a runner of the model at bf16 under `--quantization int8` (its projections,
embedding and LM head Int8Linear: the kernel's W8A8 products on VNNI against the torch path's);
`int8-plain-head` the same with the embedding and LM head back in bf16 (a tied head the embedding
itself), the layout before they were int8: `--dtypes int8 int8-plain-head` times the two side by
side.

`--dtypes w4a16` runs `--model` (a W4A16 folder, e.g. benchmarks.peers' `qwen05-bf16.w4a16`) at
bf16: the kernel's int4 products (torch's int4 layout read in place) against the torch path's
`_weight_int4pack_mm_for_cpu`, and (`widened`) on float32 activations beside AVX512-BF16 dot
products.

`--baseline PATH` times a previous build of the kernel's extension (its `_decode_step*.so`, or
the folder holding it: e.g. `git stash; make` and copy the .so out first) beside the current one,
as `base` and `base/fused` per dtype, in the same rounds (its own copy of the step's C, on the same
weights and cache).

`--model` defaults to the built-in `default` (3.1M parameters: hidden 256, 4 layers, the shape
of issue 14's llama-server comparison); `default-random` is the ~40M one; `qwen-shape` is
weight_residency's random-weight Llama of Qwen2.5-0.5B's shape (358M parameters, tied 151,936
vocab) saved in bf16.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import torch
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
from sloserve.executor import ModelRunner
from sloserve.executor import fused as fused_module
from sloserve.executor.fused import FusedDecode
from sloserve.hotpath._decode_step import bf16_dot_products
from sloserve.layers.linear import DenseLinear
from sloserve.models.default import BUILTIN_MODELS, ensure_default_model
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

from benchmarks._output import OUT, write_json

GREEDY = SamplingParams(max_tokens=1 << 20)
STREAM_BYTES = 1 << 30


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


def timed(runner: ModelRunner, step, fused, steps: int, dot_products: bool = True) -> float:
    """Seconds per step; `dot_products` False: bf16 products on the widened path."""
    runner.decode_step.fused = fused
    bf16_dot_products(dot_products)
    try:
        started = time.perf_counter()
        for _ in range(steps):
            runner.forward(step)
        return (time.perf_counter() - started) / steps
    finally:
        bf16_dot_products(True)


def read_bandwidth(buffer: torch.Tensor, repeats: int = 3) -> float:
    """Bytes per second of a streaming read of `buffer` (the best of `repeats`)."""
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * buffer.element_size() / best


def model_path(name: str) -> str:
    if name == "qwen-shape":
        from benchmarks.weight_residency import checkpoint

        return str(checkpoint(151936, "bfloat16"))
    return str(ensure_default_model(name)) if name in BUILTIN_MODELS else name


def make_runner(
    path: str, dtype: str, batches: list[int], contexts: list[int], fused: bool = True
) -> ModelRunner:
    """A runner of `path` at `dtype` ("int8": bf16 with --quantization int8; "int8-plain-head":
    that with the embedding and head in bf16); `fused`: its decode step on the kernel (bf16 under
    BF16_DECODE, so its projections keep the plain weights), else a bf16 one on oneDNN's packed
    copies (fused.BF16_DECODE off)."""
    int8 = dtype.startswith("int8")
    fused_module.BF16_DECODE = fused
    cfg = json.loads((Path(path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    token_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    config = SloserveConfig(
        model=ModelConfig(
            path=path,
            device="cpu",
            dtype="bfloat16" if int8 or dtype == "w4a16" else dtype,
            quantization="int8" if int8 else "none",
            max_model_len=1024,
        ),
        cache=CacheConfig(
            kv_pool_bytes=max(batches) * (max(contexts) + 64) * token_bytes + (64 << 20),
            swap_bytes=0,
        ),
        scheduler=SchedulerConfig(max_batch=max(batches), max_batched_tokens=1024),
    )
    runner = ModelRunner(config)
    kernel = runner.decode_step.fused if runner.decode_step else None
    if not fused:
        return runner
    if kernel is None:
        raise SystemExit(f"{path} in {dtype}: decode steps cannot take the fused kernel here")
    if dtype == "int8-plain-head":
        w = runner.model.weights
        tied, head = w.tied, w.lm_head
        w.embed = w.embed.dequantized().to(runner.dtype)
        w.lm_head = DenseLinear(w.embed if tied else head.dequantized().to(runner.dtype))
        kernel = runner.decode_step.fused = FusedDecode(runner.model, runner.kv, kernel.threads)
    kernel.max_batch = max(batches)  # time the kernel past its serving limit too
    return runner


def load_baseline(path: Path):
    """A previous build of the kernel's extension (its .so, or the folder holding it) as a module of its own."""
    if path.is_dir():
        found = sorted(path.glob("_decode_step*.so"))
        if not found:
            raise SystemExit(f"--baseline {path}: no _decode_step*.so in it")
        path = found[0]
    spec = importlib.util.spec_from_file_location("decode_kernel_baseline._decode_step", path)
    if spec is None:
        raise SystemExit(f"--baseline {path}: not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def baseline_kernel(runner: ModelRunner, module) -> FusedDecode:
    """The runner's fused step on `module`'s DecodeKernel (the same weights and cache)."""
    current = runner.decode_step.fused
    built_with, bf16_decode = fused_module.DecodeKernel, fused_module.BF16_DECODE
    fused_module.DecodeKernel, fused_module.BF16_DECODE = module.DecodeKernel, True
    try:
        kernel = FusedDecode(runner.model, runner.kv, current.threads)
    finally:
        fused_module.DecodeKernel, fused_module.BF16_DECODE = built_with, bf16_decode
    kernel.max_batch = current.max_batch
    return kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16", "int8", "int8-plain-head", "w4a16"],
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 800])
    parser.add_argument(
        "--threads", type=int, default=None, help="threads of both paths (default: torch's)"
    )
    parser.add_argument("--steps", type=int, default=50, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a previous build's _decode_step .so (or its folder)",
    )
    parser.add_argument("--out", type=Path, default=OUT / "decode_kernel.json")
    args = parser.parse_args()
    path = model_path(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    fused_module.FUSED_MAX_BATCH = max(args.batches)
    runners = {d: make_runner(path, d, args.batches, args.contexts) for d in args.dtypes}
    # bf16 on the torch path over oneDNN's packed bf16 copies
    packed = (
        make_runner(path, "bfloat16", args.batches, args.contexts, fused=False)
        if "bfloat16" in args.dtypes
        else None
    )
    kernels = {d: r.decode_step.fused for d, r in runners.items()}
    # the widened bf16 path beside the dot products, where the CPU has them (w4a16: the int4
    # products on float32 activations beside those on bf16 dot products)
    wide = next((d for d in ("bfloat16", "w4a16") if d in args.dtypes), None)
    widened = wide is not None and bf16_dot_products()
    for kernel in kernels.values():
        kernel.threads = torch.get_num_threads()
    baseline = load_baseline(args.baseline) if args.baseline else None
    bases = {d: baseline_kernel(r, baseline) for d, r in runners.items()} if baseline else {}
    info = next(iter(runners.values())).info()
    load = [round(x, 2) for x in os.getloadavg()]
    print(
        f"{info['architecture']} {info['parameters'] / 1e6:.1f}M params, {torch.get_num_threads()} "
        f"threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(default)')}, load {load}"
    )
    stream = torch.ones(STREAM_BYTES // 4)
    bandwidth = read_bandwidth(stream)
    del stream
    # every weight is read once a token: their resident bytes (held once, in the form read)
    token_bytes = {d: r.model.weights.nbytes() for d, r in runners.items()}
    print(
        f"streaming read {bandwidth / 1e9:.1f} GB/s; weight bytes per token "
        + ", ".join(
            f"{d} {b / 1e9:.3f} GB (ceiling {bandwidth / b:.1f} tok/s)"
            for d, b in token_bytes.items()
        )
    )
    head = f"{'batch':>5} {'context':>7}"
    for d in args.dtypes:
        head += f" {d + ' fused':>15} {'torch':>8} {'torch/fused':>11}"
        head += f" {'base':>8} {'base/fused':>10}" if baseline else ""
    head += f" {'bf16 packed':>11} {'packed/fused':>12}" if packed else ""
    head += f" {'widened':>8} {'widened/fused':>13}" if widened else ""
    pair = f" {args.dtypes[0]}/{args.dtypes[1]} fused" if len(args.dtypes) == 2 else ""
    print(head + pair + "  (ms per step)")
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            steps = {d: decode_step(r, batch, context) for d, r in runners.items()}
            packed_step = decode_step(packed, batch, context) if packed else None
            best = {
                (d, arm): float("inf") for d in args.dtypes for arm in ("fused", "torch", "base")
            }
            best["packed"] = best["widened"] = float("inf")
            for i in range(args.rounds):
                order = args.dtypes if i % 2 == 0 else args.dtypes[::-1]
                for d in order:
                    r = runners[d]
                    arms = [("fused", kernels[d]), ("torch", None)]
                    arms += [("base", bases[d])] if baseline else []
                    for arm, kernel in arms:
                        seconds = timed(r, steps[d], kernel, args.steps)
                        best[d, arm] = min(best[d, arm], seconds)
                    if d == wide and widened:
                        seconds = timed(r, steps[d], kernels[d], args.steps, dot_products=False)
                        best["widened"] = min(best["widened"], seconds)
                if packed:
                    best["packed"] = min(
                        best["packed"], timed(packed, packed_step, None, args.steps)
                    )
            line = f"{batch:>5} {context:>7}"
            row: dict = {"batch": batch, "context": context, "threads": torch.get_num_threads()}
            for d in args.dtypes:
                f, t = best[d, "fused"], best[d, "torch"]
                line += f" {f * 1e3:>15.3f} {t * 1e3:>8.3f} {t / f:>11.2f}"
                row[d] = {
                    "fused_ms": round(f * 1e3, 4),
                    "torch_ms": round(t * 1e3, 4),
                    "torch_over_fused": round(t / f, 3),
                }
                if baseline:
                    base = best[d, "base"]
                    line += f" {base * 1e3:>8.3f} {base / f:>10.2f}"
                    row[d]["base_ms"] = round(base * 1e3, 4)
                    row[d]["base_over_fused"] = round(base / f, 3)
                if batch == 1:
                    ceiling = bandwidth / token_bytes[d]
                    row[d]["fused_share_of_ceiling"] = round(1 / f / ceiling, 3)
                    if baseline:
                        row[d]["base_share_of_ceiling"] = round(1 / best[d, "base"] / ceiling, 3)
            if packed:
                ratio = best["packed"] / best["bfloat16", "fused"]
                row["bfloat16"]["packed_ms"] = round(best["packed"] * 1e3, 4)
                row["bfloat16"]["packed_over_fused"] = round(ratio, 3)
                line += f" {best['packed'] * 1e3:>11.3f} {ratio:>12.2f}"
            if widened:
                ratio = best["widened"] / best[wide, "fused"]
                row[wide]["widened_ms"] = round(best["widened"] * 1e3, 4)
                row[wide]["widened_over_fused"] = round(ratio, 3)
                line += f" {best['widened'] * 1e3:>8.3f} {ratio:>13.2f}"
            if len(args.dtypes) == 2:
                ratio = best[args.dtypes[0], "fused"] / best[args.dtypes[1], "fused"]
                row["fused_first_over_second"] = round(ratio, 3)
                line += f" {ratio:>14.2f}"
            print(line, flush=True)
            rows.append(row)
    for d, r in runners.items():
        r.decode_step.fused = kernels[d]
    for arm in ("fused", "base") if baseline else ("fused",):
        share = {
            d: row[d][f"{arm}_share_of_ceiling"]
            for row in rows
            if row["batch"] == 1
            for d in args.dtypes
        }
        if share:
            print(
                f"batch 1, {arm} step / bandwidth ceiling (last context): "
                + ", ".join(f"{d} {100 * s:.0f}%" for d, s in share.items())
            )
    report = {
        "benchmark": "decode_kernel",
        "model": args.model,
        "parameters": info["parameters"],
        "dtypes": args.dtypes,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "load_average_before": load,
        "load_average_after": os.getloadavg(),
        "torch": torch.__version__,
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "baseline": str(args.baseline) if baseline else None,
        "weight_bytes_per_token": token_bytes,
        "rows": rows,
    }
    write_json(args.out, report)


if __name__ == "__main__":
    main()
