"""One bf16 checkpoint served by the same build at --dtype float32, bfloat16 and --quantization int8, side by side.

The model is weight_residency's random-weight Llama of Qwen2.5-0.5B's shape (358M parameters
besides the tied 151,936-token embedding), saved in bf16. Each run is a fresh `sloserve serve` of
one arm driven by one `sloserve bench` closed loop over distinct ARC prompts of at most
`--max-prompt-chars` characters (peer_llamacpp's workload; mean ~600 tokens at 900), every request
to exactly `--max-tokens` tokens; arms alternate run by run so that drift on a shared machine hits
both alike, and the load average is recorded around each run:

  c1    one request at a time: decode tok/s (1 / TPOT p50) and TTFT p50
  c16   sixteen in flight: output tok/s and TTFT p50

    python -m benchmarks.cpu_dtype [--rounds 2] [--arms float32 bfloat16 int8] [--json PATH]

bf16 needs a CPU with AVX512-BF16 or AMX-BF16 (the server refuses --dtype bfloat16 without). The
int8 arm is `--quantization int8` at `--dtype auto` (bf16 activations where auto picks bf16).
Ratios are against bfloat16 where it runs, else against the first arm.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._output import OUT, write_json
from benchmarks.harness import bench_fresh_server
from benchmarks.peer_llamacpp import write_workload
from benchmarks.weight_residency import SHAPE, checkpoint

ARMS = {  # arm -> the server's flags
    "float32": ["--dtype", "float32"],
    "bfloat16": ["--dtype", "bfloat16"],
    "int8": ["--dtype", "auto", "--quantization", "int8"],
}
LOADS = {  # name -> (concurrency, requests: the workload's first)
    "c1": (1, 4),
    "c16": (16, 24),
}


def bench_bin() -> Path:
    """This interpreter's `sloserve` command."""
    return Path(sys.executable).with_name("sloserve")


def served(folder: Path, arm: str, load: str, workload: Path, workdir: Path) -> dict:
    """One fresh server of `arm`, one closed-loop bench run against it."""
    concurrency, requests = LOADS[load]
    log_path = workdir / f"serve_{arm}_{load}_{time.monotonic_ns()}.log"
    bench = ["--workload", f"jsonl:{workload}", "--num-requests", str(requests)]
    bench += ["--concurrency", str(concurrency), "--ignore-eos"]
    load_before = os.getloadavg()[0]
    run = bench_fresh_server(bench_bin(), ["--model", str(folder), *ARMS[arm]], bench, log_path)
    load_after = os.getloadavg()[0]
    text = log_path.read_text()
    why = re.search(r"dtype (\w+): (.*)", text)
    kinds = re.search(r"dense projections (?:on oneDNN|quantized to int8): (.*), in ", text)
    resident = re.search(r"weights resident: ([\d.]+ MiB)", text)
    return {
        "dtype": why.group(1) if why else None,
        "dtype_reason": why.group(2).strip() if why else None,
        "projections": kinds.group(1) if kinds else None,
        "weights_resident": resident.group(1) if resident else None,
        "output_tok_s": run["output_token_throughput"],
        "decode_tok_s": 1.0 / run["tpot_s"]["p50"],
        "ttft_p50_s": run["ttft_s"]["p50"],
        "completed": run["completed"],
        "load_avg_1m": [round(load_before, 2), round(load_after, 2)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rounds", type=int, default=2, help="runs per arm and load, alternating")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-chars", type=int, default=900)
    p.add_argument("--loads", nargs="+", default=list(LOADS), choices=list(LOADS))
    p.add_argument("--arms", nargs="+", default=["float32", "bfloat16"], choices=list(ARMS))
    p.add_argument("--json", type=Path, default=OUT / "cpu_dtype.json")
    args = p.parse_args()

    folder = checkpoint(args.vocab, "bfloat16")
    arms = args.arms
    runs: dict[str, dict[str, list[dict]]] = {load: {a: [] for a in arms} for load in args.loads}
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "workload.jsonl"
        spec = write_workload(
            workload, max(LOADS[x][1] for x in args.loads), args.max_prompt_chars, args.max_tokens
        )
        lengths = [len(json.loads(line)["prompt"]) for line in workload.read_text().splitlines()]
        print(f"{spec}: {len(lengths)} prompts of {statistics.mean(lengths):.0f} tokens on average")
        for r in range(args.rounds):
            for load in args.loads:
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    result = served(folder, arm, load, workload, Path(tmp))
                    runs[load][arm].append(result)
                    print(f"round {r} {load} {arm}: {json.dumps(result)}", flush=True)

    fields = {"c1": ("decode_tok_s", "ttft_p50_s"), "c16": ("output_tok_s", "ttft_p50_s")}
    base = "bfloat16" if "bfloat16" in arms else arms[0]
    summary: dict[str, dict] = {}
    print(f"{'':24s}" + "".join(f" {a:>10s} {a + '/' + base:>16s}" for a in arms))
    for load in args.loads:
        for field in fields[load]:
            medians = {a: statistics.median(x[field] for x in runs[load][a]) for a in arms}
            ratios = {f"{a}/{base}": medians[a] / medians[base] for a in arms if a != base}
            summary[f"{load} {field}"] = {**medians, **ratios}
            print(
                f"{load + ' ' + field:24s}"
                + "".join(f" {medians[a]:10.3f} {medians[a] / medians[base]:16.3f}" for a in arms)
            )
    write_json(
        args.json,
        {
            "model": {"vocab_size": args.vocab, **SHAPE, "checkpoint_dtype": "bfloat16"},
            "loads": {
                k: dict(zip(("concurrency", "requests"), v, strict=True)) for k, v in LOADS.items()
            },
            "max_tokens": args.max_tokens,
            "workload": f"{spec}: distinct prompts of at most {args.max_prompt_chars} characters "
            f"(mean {statistics.mean(lengths):.0f}), --ignore-eos",
            "rounds": args.rounds,
            "runs": runs,
            "median": summary,
        },
    )


if __name__ == "__main__":
    main()
