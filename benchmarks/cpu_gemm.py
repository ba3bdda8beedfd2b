"""Dense projections on a CPU: torch's BLAS (MKL) against oneDNN on packed weights, side by side.

Part 1 times `F.linear` and oneDNN's product on packed weights (`PackedLinear`,
whatever the row count) on the model's own projection shapes at several row counts (decode
batches to prefill chunks), on 1 thread and on all, alternating rounds (best round counts), and
checks a row's result is the same whatever the row count. Part 2 times
`ModelRunner.execute` of whole prompts (a prefill step, what TTFT pays) with `--cpu-gemm blas`
and `auto`, alternating, and checks both give the same greedy tokens over a short decode.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.cpu_gemm [--model default] [--lengths 300 800 1400]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
from sloserve.executor import ModelRunner
from sloserve.layers.linear import PackedLinear, onednn_available
from sloserve.models.default import BUILTIN_MODELS, ensure_default_model
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

from benchmarks._output import OUT, write_json

GREEDY = SamplingParams(max_tokens=1)


def best_time(fn, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def gemm_table(
    shapes: dict[str, tuple[int, int]], rows: list[int], rounds: int, all_threads: int
) -> list[dict]:
    """GFLOP/s of F.linear and oneDNN on packed weights per (projection, rows, threads)."""
    table = []
    for name, (out_f, in_f) in shapes.items():
        w = torch.randn(out_f, in_f)
        packed = PackedLinear(w)
        x_all = torch.randn(max(rows), in_f)
        whole = packed(x_all)
        for threads in sorted({1, all_threads}):
            torch.set_num_threads(threads)
            for m in rows:
                x = x_all[:m].contiguous()
                same_rows = torch.equal(packed(x), whole[:m])
                repeats = max(3, int(2e8 / (2 * m * in_f * out_f)))
                best = {"blas": float("inf"), "onednn": float("inf")}
                for _ in range(rounds):
                    best["blas"] = min(
                        best["blas"], best_time(lambda x=x, w=w: F.linear(x, w), repeats)
                    )
                    best["onednn"] = min(
                        best["onednn"],
                        best_time(lambda x=x, p=packed: p(x), repeats),
                    )
                flops = 2 * m * in_f * out_f
                row = {
                    "projection": name,
                    "shape": [out_f, in_f],
                    "rows": m,
                    "threads": threads,
                    "blas_gflops": flops / best["blas"] / 1e9,
                    "onednn_gflops": flops / best["onednn"] / 1e9,
                    "speedup": best["blas"] / best["onednn"],
                    "row_invariant": same_rows,
                }
                table.append(row)
                print(
                    f"  {name:8s} [{out_f}x{in_f}] rows {m:5d} threads {threads}: blas {row['blas_gflops']:6.1f}"
                    f"  onednn {row['onednn_gflops']:6.1f} GFLOP/s  x{row['speedup']:.2f}"
                    f"{'' if same_rows else '  (rows differ by row count)'}",
                    flush=True,
                )
    torch.set_num_threads(all_threads)
    return table


def make_runner(path: str, gemm: str) -> ModelRunner:
    cfg = SloserveConfig(
        model=ModelConfig(path=path, device="cpu", max_model_len=2048, cpu_gemm=gemm),
        cache=CacheConfig(kv_pool_bytes=64 * 2**20, swap_bytes=0, prefix_cache=False),
        scheduler=SchedulerConfig(max_batch=16, max_batched_tokens=2048),
    )
    runner = ModelRunner(cfg)
    runner.warmup()
    return runner


def prefill_once(runner: ModelRunner, prompt: list[int]) -> int:
    table = list(range(1, 2 + len(prompt) // runner.block_size))
    token = runner.execute(
        SchedulerOutput([ScheduledSequence("p", prompt, 0, table, True, GREEDY)])
    ).tokens[0][0]
    runner.execute(SchedulerOutput(finished_req_ids=["p"]))
    return token


def greedy_tokens(runner: ModelRunner, prompt: list[int], steps: int) -> list[int]:
    table = list(range(1, 2 + (len(prompt) + steps) // runner.block_size))
    tokens = [
        runner.execute(
            SchedulerOutput([ScheduledSequence("g", prompt, 0, table, True, GREEDY)])
        ).tokens[0][0]
    ]
    for i in range(steps - 1):
        seq = ScheduledSequence("g", [tokens[-1]], len(prompt) + i, table, True, GREEDY)
        tokens.append(runner.execute(SchedulerOutput([seq])).tokens[0][0])
    runner.execute(SchedulerOutput(finished_req_ids=["g"]))
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="built-in name or checkpoint folder")
    parser.add_argument("--lengths", type=int, nargs="+", default=[300, 800, 1400])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512, 1024])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=str(OUT / "cpu_gemm.json"))
    args = parser.parse_args()
    if not onednn_available():
        raise SystemExit("this torch build has no oneDNN linear operators: nothing to compare")
    threads = torch.get_num_threads()  # before the runners: they set one thread for small steps
    print(f"load average {os.getloadavg()[0]:.2f}; torch {torch.__version__}, {threads} threads")
    path = str(ensure_default_model(args.model)) if args.model in BUILTIN_MODELS else args.model
    runners = {gemm: make_runner(path, gemm) for gemm in ("blas", "auto")}
    layer = runners["blas"].model.weights.layers[0]
    shapes = {
        name: tuple(getattr(layer, name).weight.shape)
        for name in ("qkv", "o", "gate_up", "down")
        if getattr(layer, name) is not None
    }
    print("part 1: one projection (best of rounds)")
    gemms = gemm_table(shapes, args.rows, args.rounds, threads)

    print("part 2: prefill of a whole prompt, ModelRunner.execute (median of alternating rounds)")
    prefill = []
    for length in args.lengths:
        prompt = [256] + [48 + (i * 7) % 10 for i in range(length - 1)]
        for runner in runners.values():
            prefill_once(runner, prompt)
        times: dict[str, list[float]] = {gemm: [] for gemm in runners}
        for _ in range(args.rounds * 2):
            for gemm, runner in runners.items():
                times[gemm].append(best_time(lambda r=runner, p=prompt: prefill_once(r, p), 1))
        med = {gemm: statistics.median(ts) for gemm, ts in times.items()}
        prefill.append(
            {
                "tokens": length,
                "blas_ms": med["blas"] * 1e3,
                "onednn_ms": med["auto"] * 1e3,
                "speedup": med["blas"] / med["auto"],
            }
        )
        print(
            f"  {length:5d} tokens: blas {med['blas'] * 1e3:7.1f} ms  onednn {med['auto'] * 1e3:7.1f} ms"
            f"  x{med['blas'] / med['auto']:.2f}",
            flush=True,
        )

    prompt = [256] + [48 + (i * 3) % 10 for i in range(299)]
    tokens = {gemm: greedy_tokens(runner, prompt, 32) for gemm, runner in runners.items()}
    equal = tokens["blas"] == tokens["auto"]
    print(f"greedy tokens, 300-token prompt + 32 steps: {'equal' if equal else 'DIFFER'}")
    write_json(
        Path(args.json),
        {
            "model": args.model,
            "load_average": os.getloadavg()[0],
            "threads": threads,
            "gemm": gemms,
            "prefill": prefill,
            "greedy_equal": equal,
        },
        indent=1,
    )


if __name__ == "__main__":
    main()
