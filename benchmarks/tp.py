"""Tensor parallelism, one rank against two, side by side in one run (gloo on a CPU, NCCL on GPUs).

For each model and size, the offline `LLM` runs three phases (greedy, EOS ignored):

  decode c=1   one 64-token prompt, --decode-tokens new tokens: output tok/s
  decode c=8   eight such prompts at once: output tok/s
  prefill      one --prefill-tokens prompt, one new token: seconds

each phase three times (the median run is reported, with the prefix cache off so every run
computes its prompts), and reads rank 0's all-reduce counters around each phase: the all-reduce time per forward (two
all-reduces per layer) and its share of the phase's wall time. On a CPU the two ranks share the
machine's cores (each rank gets cores / ranks threads), so two ranks are expected to be slower:
what they buy is a model that fits, not speed. On a machine with several GPUs the same script
runs with NCCL (--device cuda).

    python -m benchmarks.tp                       # small and medium random Llamas, TP 1 and 2
    python -m benchmarks.tp --models small --decode-tokens 8 --prefill-tokens 64 --out /tmp/tp.json  # smoke
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import orjson
from sloserve.llm import LLM
from sloserve.sampling_params import SamplingParams

from benchmarks._output import OUT
from benchmarks.engine import BENCH_MODELS, random_llama

MODELS = {
    # 3.9M parameters: per-step fixed costs (Python, the command broadcast) dominate
    "small": BENCH_MODELS["small"],
    # 113M parameters: matmuls dominate, the regime tensor parallelism is for
    "medium": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
}


def _reduce_counters(llm: LLM) -> tuple[int, float, int]:
    info = llm.engine.runner.info() if hasattr(llm.engine.runner, "group") else {}
    return (
        info.get("all_reduce_calls", 0),
        info.get("all_reduce_seconds", 0.0),
        info.get("all_reduce_bytes", 0),
    )


def run_phase(
    llm: LLM, prompts: list[list[int]], new_tokens: int, layers: int, repeats: int
) -> dict:
    """The phase `repeats` times: the median run's wall time and all-reduce counters."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    runs = []
    for _ in range(repeats):
        before = _reduce_counters(llm)
        began = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - began
        runs.append((wall, before, _reduce_counters(llm), outs))
    runs.sort(key=lambda run: run[0])
    wall, (calls0, secs0, bytes0), (calls1, secs1, bytes1), outs = runs[len(runs) // 2]
    tokens = sum(len(o.token_ids) for o in outs)
    forwards = (calls1 - calls0) // (2 * layers)
    return {
        "wall_s": round(wall, 4),
        "output_tokens": tokens,
        "tok_s": round(tokens / wall, 2),
        "forwards": forwards,
        "all_reduce_ms_per_forward": round(1000 * (secs1 - secs0) / forwards, 4)
        if forwards
        else 0.0,
        "all_reduce_share": round((secs1 - secs0) / wall, 4),
        "all_reduce_kib_per_forward": round((bytes1 - bytes0) / 1024 / forwards, 1)
        if forwards
        else 0.0,
        "token_ids": [o.token_ids for o in outs],
    }


def run_size(model: str, size: int, args: argparse.Namespace) -> dict:
    layers = MODELS[args.model_name]["num_hidden_layers"]
    prompt = [256] + [(i * 37) % 250 for i in range(63)]
    batch = [[256] + [(i * 31 + j) % 250 for i in range(63)] for j in range(8)]
    long = [256] + [(i * 13) % 250 for i in range(args.prefill_tokens - 1)]
    with LLM(
        model,
        device=args.device,
        tensor_parallel_size=size,
        max_model_len=args.prefill_tokens + 128,
        max_batch=8,
        prefix_cache=False,
    ) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))  # warm
        phases = {
            "decode_c1": run_phase(llm, [prompt], args.decode_tokens, layers, args.repeats),
            "decode_c8": run_phase(llm, batch, args.decode_tokens, layers, args.repeats),
            "prefill": run_phase(llm, [long], 1, layers, args.repeats),
        }
    return phases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", default="small,medium", help="comma-separated, from: " + ", ".join(MODELS)
    )
    parser.add_argument(
        "--sizes", default="1,2", help="tensor-parallel sizes to compare (the first is the base)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per phase; the median is reported"
    )
    parser.add_argument("--out", default=str(OUT / "tp.json"))
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    report = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "device": args.device,
        "decode_tokens": args.decode_tokens,
        "prefill_tokens": args.prefill_tokens,
        "repeats": args.repeats,
        "models": {},
    }
    for name in args.models.split(","):
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
        args.model_name = name
        model = random_llama(**MODELS[name])
        results = {size: run_size(model, size, args) for size in sizes}
        base = results[sizes[0]]
        print(
            f"\n{name} ({MODELS[name]['hidden_size']} hidden, {MODELS[name]['num_hidden_layers']} layers), "
            f"{args.device}"
        )
        print(
            f"{'phase':<10} {'TP':>3} {'tok/s':>9} {'wall s':>8} {'ratio':>6} {'AR ms/fwd':>10} {'AR share':>9} "
            f"{'KiB/fwd':>8} {'tokens':>7}"
        )
        for phase in ("decode_c1", "decode_c8", "prefill"):
            for size in sizes:
                r = results[size][phase]
                ratio = base[phase]["wall_s"] / r["wall_s"]
                same = "same" if r["token_ids"] == base[phase]["token_ids"] else "DIFFER"
                print(
                    f"{phase:<10} {size:>3} {r['tok_s']:>9.1f} {r['wall_s']:>8.3f} {ratio:>6.2f} "
                    f"{r['all_reduce_ms_per_forward']:>10.3f} {r['all_reduce_share']:>9.1%} "
                    f"{r['all_reduce_kib_per_forward']:>8.1f} {same:>7}"
                )
        for size in sizes:
            for phase, r in results[size].items():
                r["tokens_equal_base"] = r["token_ids"] == base[phase]["token_ids"]
        for size in sizes:
            for r in results[size].values():
                r.pop("token_ids")
        report["models"][name] = {str(size): results[size] for size in sizes}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
