"""Executor speed on the CPU: decode tokens/s of the ~40M built-in Llama beside its bare matmuls.

For batch 1, 8, 32 and 64 it times (in the same run, same shapes):
  engine       ModelRunner.execute() decode steps (inputs, attention over paged KV, sampling, all)
  forward      the same forward the engine runs (compiled or eager, as configured) on inputs
               prepared once: no scheduler output, no input building, no sampling
  matmuls      only the model's matrix products, back to back, on preallocated inputs
in alternating rounds (the best round of each counts, so a busy machine skews neither side)
and the fp32 GEMM peak of this machine, then prints tok/s and the fractions engine/forward
(the issue's "kernels-only"), engine/matmuls and achieved/peak FLOP rate, and the start-up
time. Also times single-request greedy generation against transformers'
`generate` on the same checkpoint (skipped when transformers is not installed).

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.executor [--threads 2] [--compile] [--out ...json]

On a shared, oversubscribed CPU set OMP_WAIT_POLICY=PASSIVE: spinning OpenMP workers otherwise
steal the core the Python thread needs between kernels (measured here: batch-1 decode step 441 ms
active vs 97 ms passive, kernels-only 68 vs 71 ms). The policy in effect is recorded in the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time
from pathlib import Path

import torch
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
from sloserve.executor import ModelRunner
from sloserve.models.default import ensure_default_model
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

from benchmarks._output import OUT, write_json

BATCHES = (1, 8, 32, 64)
GREEDY = SamplingParams(max_tokens=1 << 20)


def gemm_peak(n: int = 1024, repeats: int = 15) -> float:
    """fp32 GFLOP/s of a square matmul (best of `repeats`; measured before and after the decode runs)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def matmul_weights(runner: ModelRunner) -> list[torch.Tensor]:
    """Every weight a decode step multiplies by, in order (per layer: qkv, o, gate_up, down; then lm_head)."""
    ws = []
    for layer in runner.model.weights.layers:
        ws += [layer.qkv.weight, layer.o.weight, layer.gate_up.weight, layer.down.weight]
    return [*ws, runner.model.weights.lm_head.weight]


class KernelsOnly:
    """Just the matmuls of a decode step (inputs preallocated, outputs written in place)."""

    def __init__(self, weights: list[torch.Tensor], batch: int) -> None:
        self.weights = weights
        self.xs = [torch.randn(batch, w.shape[1]) for w in weights]
        self.outs = [torch.empty(batch, w.shape[0]) for w in weights]
        self.step()

    def step(self) -> None:
        for x, w, o in zip(self.xs, self.weights, self.outs, strict=True):
            torch.mm(x, w.t(), out=o)


class ForwardOnly:
    """The engine's forward (DecodeStep or the general forward) on one decode step's inputs, prepared once."""

    def __init__(self, runner: ModelRunner, engine: EngineDecode) -> None:
        self.runner = runner
        seqs = [
            ScheduledSequence(f"r{i}", [engine.last[i]], engine.pos, engine.tables[i], True, GREEDY)
            for i in range(engine.batch)
        ]
        if hasattr(runner, "prepare"):
            # engine steps reuse the pool buffers
            self.inputs = _own_copy(runner.prepare(SchedulerOutput(seqs)))
            self.forward = runner.forward
        else:  # a runner from before prepare/forward/sample (for before/after runs of this benchmark)
            self.inputs = _own_copy(runner.inputs.build(seqs))
            self.forward = lambda s: runner.model.forward(
                s.input_ids, s.positions, s.meta, runner.kv, s.sample_idx
            )
        self.step()

    def step(self) -> None:
        self.forward(self.inputs)


def _own_copy(inputs):
    """A dataclass of step inputs whose tensors (nested ones too) are clones."""

    def copy(value):
        if isinstance(value, torch.Tensor):
            return value.clone()
        if dataclasses.is_dataclass(value):
            return dataclasses.replace(
                value,
                **{
                    f.name: copy(getattr(value, f.name))
                    for f in dataclasses.fields(value)
                    if f.init
                },
            )
        return value

    return copy(inputs)


class EngineDecode:
    """Decode steps of `batch` sequences through ModelRunner.execute, each holding `context` tokens of KV."""

    def __init__(self, runner: ModelRunner, batch: int, context: int, max_steps: int) -> None:
        self.runner, self.batch = runner, batch
        pages = -(-(context + max_steps + 2) // runner.block_size)
        self.tables = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(batch)]
        prompt = [256] + [48 + (i % 10) for i in range(context - 1)]
        self.last: list[int] = []
        for i in range(batch):  # prefill one at a time (not timed)
            seq = ScheduledSequence(f"r{i}", prompt, 0, self.tables[i], True, GREEDY)
            self.last += runner.execute(SchedulerOutput([seq])).tokens[0]
        self.pos = context
        self.step()

    def step(self) -> None:
        seqs = [
            ScheduledSequence(f"r{i}", [self.last[i]], self.pos, self.tables[i], True, GREEDY)
            for i in range(self.batch)
        ]
        self.last = [run[0] for run in self.runner.execute(SchedulerOutput(seqs)).tokens]
        self.pos += 1

    def close(self) -> None:
        self.runner.execute(SchedulerOutput(finished_req_ids=[f"r{i}" for i in range(self.batch)]))


def interleaved(timed: dict, steps: int, rounds: int) -> dict[str, float]:
    """Best wall and CPU seconds per step of each timed[name].step(), timed in alternating rounds.

    Alternating rounds and keeping the best of each make the comparison fair on a busy machine;
    CPU time (process_time) also excludes the time this process waited for a core.
    """
    best = {f"{name}_{kind}": float("inf") for name in timed for kind in ("wall", "cpu")}
    for _ in range(rounds):
        for name, which in timed.items():
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                which.step()
            best[f"{name}_wall"] = min(best[f"{name}_wall"], (time.perf_counter() - wall) / steps)
            best[f"{name}_cpu"] = min(best[f"{name}_cpu"], (time.process_time() - cpu) / steps)
    return best


def single_request(runner: ModelRunner, folder: Path, prompt_len: int, new_tokens: int) -> dict:
    """Greedy generation of one request: sloserve vs transformers generate (same checkpoint, same tokens?)."""
    prompt = [256] + [48 + (i * 7) % 10 for i in range(prompt_len - 1)]
    table = list(range(1, 2 + (prompt_len + new_tokens) // runner.block_size))
    t = time.perf_counter()
    tokens = runner.execute(
        SchedulerOutput([ScheduledSequence("g", prompt, 0, table, True, GREEDY)])
    ).tokens[0]
    while len(tokens) < new_tokens:
        seq = ScheduledSequence("g", tokens[-1:], prompt_len + len(tokens) - 1, table, True, GREEDY)
        tokens += runner.execute(SchedulerOutput([seq])).tokens[0]
    ours = time.perf_counter() - t
    result = {"prompt_tokens": prompt_len, "new_tokens": new_tokens, "sloserve_s": round(ours, 4)}
    try:
        from transformers import AutoModelForCausalLM, GenerationConfig
    except ImportError:
        result["transformers_s"] = None
        return result
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, pad_token_id=258)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)  # warm
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        theirs = time.perf_counter() - t
    result |= {
        "transformers_s": round(theirs, 4),
        "speedup": round(theirs / ours, 2),
        "same_tokens": out[0, prompt_len:].tolist() == tokens,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per timed round")
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds; the best round counts"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--backend", default="auto")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the decode step (eager otherwise)"
    )
    parser.add_argument("--out", type=Path, default=OUT / "executor.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = ensure_default_model("default-random")  # the 40M architecture these figures describe
    config = SloserveConfig(
        model=ModelConfig(
            path=str(folder),
            device="cpu",
            attention_backend=args.backend,
            max_model_len=1024,
            **({"enforce_eager": False} if args.compile else {}),
        ),
        cache=CacheConfig(kv_pool_bytes=64 * 1024 * 1024 * 4, swap_bytes=0),
        scheduler=SchedulerConfig(max_batch=max(BATCHES), max_batched_tokens=1024),
    )
    started = time.perf_counter()
    runner = ModelRunner(config)
    runner.warmup()
    startup = time.perf_counter() - started
    decode_step = runner.info().get("decode_step", "eager")
    weights = matmul_weights(runner)
    flops_per_token = 2 * sum(w.numel() for w in weights)
    peak = gemm_peak()
    rows = []
    print(
        f"model {runner.info()['parameters'] / 1e6:.1f}M params, {runner.backend.name} attention, {decode_step} "
        f"decode step, start-up {startup:.1f}s (warm-up {runner.info().get('warmup_time_s', 0):.1f}s), "
        f"{torch.get_num_threads()} threads (OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}), "
        f"fp32 GEMM peak {peak:.1f} GFLOP/s, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'batch':>5} {'engine tok/s':>13} {'forward tok/s':>14} {'matmuls tok/s':>14} {'engine/forward':>15}"
        f" {'engine/matmuls':>15} {'engine/peak':>12} {'(by CPU time)':>14}"
    )
    for batch in BATCHES:
        engine = EngineDecode(runner, batch, args.context, args.steps * args.rounds + 2)
        timed = {
            "engine": engine,
            "forward": ForwardOnly(runner, engine),
            "matmuls": KernelsOnly(weights, batch),
        }
        t = interleaved(timed, args.steps, args.rounds)
        engine.close()
        tps = {name: batch / t[f"{name}_wall"] for name in timed}
        frac_peak = tps["engine"] * flops_per_token / 1e9 / peak
        rows.append(
            {
                "batch": batch,
                "engine_tok_s": round(tps["engine"], 1),
                "forward_tok_s": round(tps["forward"], 1),
                "kernels_tok_s": round(tps["matmuls"], 1),
                "engine_over_forward": round(tps["engine"] / tps["forward"], 3),
                "engine_over_kernels": round(tps["engine"] / tps["matmuls"], 3),
                "engine_over_peak": round(frac_peak, 3),
                **{f"{name}_step_ms": round(t[f"{name}_wall"] * 1e3, 3) for name in timed},
                **{f"{name}_cpu_ms": round(t[f"{name}_cpu"] * 1e3, 3) for name in timed},
                "engine_over_forward_cpu": round(t["forward_cpu"] / t["engine_cpu"], 3),
            }
        )
        r = rows[-1]
        print(
            f"{batch:>5} {r['engine_tok_s']:>13.1f} {r['forward_tok_s']:>14.1f} {r['kernels_tok_s']:>14.1f} "
            f"{r['engine_over_forward']:>15.1%} {r['engine_over_kernels']:>15.1%} {r['engine_over_peak']:>12.1%} "
            f"{r['engine_over_forward_cpu']:>14.1%}"
        )
    peak_after = gemm_peak()
    # the machine was busier at the start: rescale the fractions to the better peak
    if peak_after > peak:
        for r in rows:
            r["engine_over_peak"] = round(r["engine_over_peak"] * peak / peak_after, 3)
        peak = peak_after
        print(
            f"(GEMM peak re-measured after the runs: {peak:.1f} GFLOP/s; fractions of peak use it)"
        )
    single = single_request(runner, folder, prompt_len=64, new_tokens=64)
    print(
        f"single request, {single['prompt_tokens']}-token prompt, {single['new_tokens']} greedy tokens: "
        f"sloserve {single['sloserve_s']:.3f}s, transformers {single.get('transformers_s')}s "
        f"(speedup {single.get('speedup')}x, same tokens: {single.get('same_tokens')})"
    )
    report = {
        "benchmark": "executor",
        "machine": platform.machine(),
        "load_average": os.getloadavg(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "model": runner.info()["parameters"],
        "context": args.context,
        "steps": args.steps,
        "rounds": args.rounds,
        "gemm_peak_gflops": round(peak, 1),
        "flops_per_token": flops_per_token,
        "decode": rows,
        "single_request": single,
        "attention_backend": runner.backend.name,
        "decode_step": decode_step,
        "startup_s": round(startup, 2),
    }
    write_json(args.out, report)


if __name__ == "__main__":
    main()
