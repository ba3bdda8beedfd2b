"""MoE beyond device memory: serving with 25 / 50 / 100% of the experts resident, preloading on and off.

Each arm loads the model with a number of expert slots per MoE layer, then generates the ARC
workload (the trace when present, else synthetic ARC; greedy, EOS ignored, outputs capped) at a
fixed concurrency through the offline `LLM` (one EngineCore, stepped in process). Per arm:

  output tok/s and its ratio to the all-resident arm (the same prompts and token counts)
  hit rate (expert uses whose weights were resident), prefetch accuracy (prefetched experts
  their layer used), prediction recall (experts used that the prediction named)
  expert device bytes (all experts, or the slots carved from the pool), bytes copied per step,
  seconds stalled on misses

On a CPU the "device" and host tiers are the same RAM: a miss is a memcpy, not a PCIe transfer,
so throughput ratios here show the bookkeeping and copy cost of the cache, not what a GPU would
see; `benchmarks/gpu_check.py` runs the same comparison on CUDA (section moe_offload).

    python -m benchmarks.moe_offload                         # the full run (see --help for sizes)
    python -m benchmarks.moe_offload --num-requests 2 --max-tokens 4 --concurrency 2 \\
        --out /tmp/moe_offload_smoke.json                     # a smoke run, seconds
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import time
from pathlib import Path

import orjson
import torch
from sloserve.bench.workloads import default_workload, load_workload
from sloserve.llm import LLM
from sloserve.models.loader import resolve_model_path
from sloserve.models.spec import load_spec
from sloserve.sampling_params import SamplingParams
from sloserve.tokenizer import Tokenizer

from benchmarks._output import OUT


def arms(residencies: list[int], preload: list[bool]) -> list[tuple[int, bool]]:
    """(percent resident, preloading) pairs; 100% runs once (nothing to preload)."""
    out = [(100, False)] if 100 in residencies else []
    out += [(pct, on) for pct in sorted(set(residencies) - {100}, reverse=True) for on in preload]
    return out


def run_arm(
    model: str,
    device: str,
    pct: int,
    preload: bool,
    prompts: list[list[int]],
    budgets: list[int],
    concurrency: int,
    max_model_len: int,
    repeats: int = 1,
    **options,
) -> dict:
    """Load the model with `pct`% of its experts resident and generate every prompt `repeats` times.

    Throughput is the best repeat's; the expert figures are the last repeat's (counters reset before
    each, routing statistics and pins kept: the steady state of a server that has seen the workload).
    """
    num_experts = load_spec(resolve_model_path(model)).num_experts
    slots = max(1, math.ceil(num_experts * pct / 100))
    # NOTE: a fixed KV pool on a GPU: the default (a fraction of free memory) would be re-taken by
    # every arm, and an arm's pool is only freed once its engine is collected.
    kv = {"kv_pool_bytes": "2GiB"} if device.startswith("cuda") else {}
    # NOTE: no prefix cache: every repeat prefills its prompts again, so repeats do the same work;
    # fifo: offline, everything queued at once, and no step-cost priming at each arm's start.
    llm = LLM(
        model,
        device=device,
        max_model_len=max_model_len,
        max_batch=concurrency,
        prefix_cache=False,
        expert_slots_per_layer=slots,
        expert_preload=preload,
        **{"policy": "fifo", **kv, **options},
    )
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in budgets]
    runner = llm.engine.runner
    seconds = math.inf
    for _ in range(repeats):
        runner.experts.reset_stats()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = min(seconds, time.perf_counter() - started)
    tokens = sum(len(o.token_ids) for o in outputs)
    stats = runner.experts.stats()
    del llm, runner
    gc.collect()
    return {
        "resident_pct": pct,
        "slots_per_layer": stats["slots_per_layer"],
        "num_experts": num_experts,
        "preload": preload and stats["resident"] == "partial",
        "seconds": round(seconds, 3),
        "output_tokens": tokens,
        "output_tok_s": tokens / seconds if seconds else 0.0,
        "hit_rate": stats["hit_rate"],
        "prefetch_accuracy": stats["prefetch_accuracy"],
        "prediction_recall": stats["prediction_recall"],
        "prefetches": stats["prefetches"],
        "expert_device_bytes": stats["device_bytes"],
        "bytes_copied": stats["bytes_copied"],
        "preload_bytes": stats["preload_bytes"],
        "bytes_per_step": stats["bytes_per_step"],
        "steps": stats["steps"],
        "miss_stall_s": stats["miss_stall_s"],
        "tokens": [o.token_ids for o in outputs],
    }


def compare(
    model: str,
    device: str,
    prompts: list[list[int]],
    budgets: list[int],
    concurrency: int,
    residencies: list[int],
    preload: list[bool],
    max_model_len: int,
    repeats: int = 1,
    log=print,
    **options,
) -> list[dict]:
    """Every arm at one concurrency; ratios against the all-resident arm, and greedy-equality checks.

    `options`: more LLM options for every arm (e.g. policy='fifo' to skip the step-cost priming).
    """
    results = []
    for pct, on in arms(residencies, preload):
        result = run_arm(
            model, device, pct, on, prompts, budgets, concurrency, max_model_len, repeats, **options
        )
        results.append(result)
        log(
            f"  c={concurrency} {pct:3d}% ({result['slots_per_layer']}/{result['num_experts']} slots) "
            f"preload {'on ' if result['preload'] else 'off'}: {result['output_tok_s']:8.1f} tok/s, "
            f"hit {result['hit_rate']:.3f}, prefetch acc {result['prefetch_accuracy']:.3f}, "
            f"recall {result['prediction_recall']:.3f}, {result['bytes_per_step'] / 2**20:.2f} MiB/step, "
            f"stall {result['miss_stall_s']:.3f}s, experts {result['expert_device_bytes'] / 2**20:.1f} MiB"
        )
    full = next((r for r in results if r["resident_pct"] == 100), None)
    for r in results:
        r["concurrency"] = concurrency
        if full is not None:
            r["tok_s_vs_all_resident"] = (
                r["output_tok_s"] / full["output_tok_s"] if full["output_tok_s"] else None
            )
            r["tokens_equal_all_resident"] = r["tokens"] == full["tokens"]
    for r in results:
        del r["tokens"]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default="default-moe", help="a MoE checkpoint folder or 'default-moe'"
    )
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument(
        "--workload", default=None, help="a sloserve.bench workload spec (default: the ARC trace)"
    )
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument(
        "--max-prompt-chars", type=int, default=1200, help="skip longer ARC prompts (CPU time)"
    )
    ap.add_argument(
        "--max-tokens", type=int, default=64, help="cap on each request's output tokens"
    )
    ap.add_argument(
        "--concurrency", default="1,8", help="comma-separated max_batch values, one comparison each"
    )
    ap.add_argument(
        "--residency", default="25,50,100", help="percent of each layer's experts resident"
    )
    ap.add_argument("--preload", default="on,off", help="preloading arms: on, off or on,off")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="generate the workload this many times per arm "
        "(best throughput; expert figures of the last)",
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads [default: torch's]"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT / "moe_offload.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = args.workload or default_workload()
    items = [
        it
        for it in load_workload(spec, seed=args.seed, attempts=2)
        if len(it.prompt) <= args.max_prompt_chars
    ][: args.num_requests]
    if not items:
        raise SystemExit(
            f"no request of {spec} has a prompt of at most {args.max_prompt_chars} characters"
        )
    tokenizer = Tokenizer.from_pretrained(resolve_model_path(args.model))
    prompts = [tokenizer.encode(it.prompt) for it in items]
    budgets = [min(it.max_tokens, args.max_tokens) for it in items]
    residencies = [int(p) for p in args.residency.split(",")]
    preload = [{"on": True, "off": False}[p.strip()] for p in args.preload.split(",")]
    print(
        f"model {args.model} on {args.device}, workload {spec}: {len(items)} requests, prompts "
        f"{sum(map(len, prompts)) / len(prompts):.0f} tokens avg, outputs {sum(budgets) / len(budgets):.0f} "
        f"tokens avg (greedy, EOS ignored)",
        flush=True,
    )
    load_before = os.getloadavg()
    runs = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        runs += compare(
            args.model,
            args.device,
            prompts,
            budgets,
            concurrency,
            residencies,
            preload,
            args.max_model_len,
            args.repeats,
            log=lambda line: print(line, flush=True),
        )
    report = {
        "model": args.model,
        "device": args.device,
        "workload": spec,
        "num_requests": len(items),
        "prompt_tokens_avg": sum(map(len, prompts)) / len(prompts),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
