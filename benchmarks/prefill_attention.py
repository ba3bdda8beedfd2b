"""Prefill attention on a CPU: the call forms of torch SDPA side by side, and a whole prefill.

Part 1 times one layer's attention over a prompt chunk in three forms, alternating rounds (best
round counts):
  3-D + enable_gqa   [H, L, D] inputs, K/V shared by query-head groups: torch's math path
                     (the form SdpaBackend used before)
  4-D, mask          [1, H, L, D], K/V repeated per query head, explicit bottom-right mask:
                     torch's CPU flash kernel (a chunk after cached context)
  4-D, causal        the same with is_causal and no mask (a chunk with no context before it)
and checks the three agree. Part 2 times `ModelRunner.execute` of whole prompts of those lengths
(a prefill step, what TTFT pays), on the built-in `default` model unless --model says otherwise,
as built and with SdpaBackend's SDPA call patched back to the 3-D form with a mask (before),
alternating.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.prefill_attention [--lengths 300 900 1500]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
from sloserve.executor import ModelRunner
from sloserve.layers.attention import sdpa
from sloserve.models.default import BUILTIN_MODELS, ensure_default_model
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

from benchmarks._output import OUT, write_json


def forms(length: int, heads: int, kv_heads: int, dim: int) -> dict:
    q = torch.randn(heads, length, dim)
    k, v = torch.randn(kv_heads, length, dim), torch.randn(kv_heads, length, dim)
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    group = heads // kv_heads
    k4, v4 = k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None]
    scale = dim**-0.5
    return {
        "3-D + enable_gqa": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
        ),
        "4-D, mask": lambda: F.scaled_dot_product_attention(
            q[None], k4, v4, attn_mask=mask, scale=scale
        )[0],
        "4-D, causal": lambda: F.scaled_dot_product_attention(
            q[None], k4, v4, is_causal=True, scale=scale
        )[0],
    }


def best_of(fns: dict, repeats: int, rounds: int) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            started = time.perf_counter()
            for _ in range(repeats):
                fn()
            best[name] = min(best[name], (time.perf_counter() - started) / repeats)
    return best


def _sdpa_before(q, k, v, mask, scale, causal=False):
    """SdpaBackend's SDPA call before the flash form: 3-D inputs, enable_gqa, always a mask."""
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[-3] != k.shape[-3]
    )


def prefill_ms(runner: ModelRunner, length: int, rounds: int) -> dict[str, float]:
    """Best ms of a whole-prompt prefill step, as built ("now") and with the SDPA call of before."""
    prompt = [256] + [48 + (i * 7) % 10 for i in range(length - 1)]
    table = list(range(1, 2 + length // runner.block_size))
    greedy = SamplingParams(max_tokens=1)
    best = {"now": float("inf"), "before": float("inf")}
    built = sdpa._sdpa
    try:
        for r in range(rounds + 1):  # the first round warms up
            for name, fn in (("now", built), ("before", _sdpa_before)):
                sdpa._sdpa = fn
                started = time.perf_counter()
                runner.execute(
                    SchedulerOutput([ScheduledSequence("p", prompt, 0, table, True, greedy)])
                )
                if r:
                    best[name] = min(best[name], time.perf_counter() - started)
                runner.execute(SchedulerOutput(finished_req_ids=["p"]))
    finally:
        sdpa._sdpa = built
    return {name: ms * 1e3 for name, ms in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--lengths", type=int, nargs="+", default=[300, 900, 1500])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT / "prefill_attention.json")
    args = parser.parse_args()
    path = str(ensure_default_model(args.model)) if args.model in BUILTIN_MODELS else args.model
    threads = torch.get_num_threads()  # part 1's; the runner sets its own per step
    runner = ModelRunner(
        SloserveConfig(
            model=ModelConfig(path=path, device="cpu", max_model_len=max(args.lengths) + 16),
            cache=CacheConfig(kv_pool_bytes=64 * 2**20, swap_bytes=0, prefix_cache=False),
            scheduler=SchedulerConfig(max_batch=8, max_batched_tokens=max(args.lengths)),
        )
    )
    runner.warmup()
    spec = runner.spec
    print(
        f"{spec.architecture}: {spec.num_heads} query / {spec.num_kv_heads} KV heads of {spec.head_dim}, "
        f"{threads} threads, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'tokens':>6} {'3-D gqa ms':>10} {'4-D mask ms':>11} {'4-D causal ms':>13} {'gqa/causal':>10}   "
        f"{'prefill before':>14} {'now':>6} {'ratio':>6}"
    )
    rows = []
    for length in args.lengths:
        fns = forms(length, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        outs = [fn() for fn in fns.values()]
        agree = max(float((o - outs[0]).abs().max()) for o in outs)
        torch.set_num_threads(threads)
        best = best_of(fns, max(1, 3000 // length), args.rounds)
        step = prefill_ms(runner, length, args.rounds)
        ms = [best[name] * 1e3 for name in fns]
        rows.append(
            {
                "tokens": length,
                "layer_ms": dict(zip(fns, [round(m, 3) for m in ms], strict=True)),
                "max_abs_difference": agree,
                "prefill_step_ms": {k: round(v, 2) for k, v in step.items()},
            }
        )
        print(
            f"{length:>6} {ms[0]:>10.2f} {ms[1]:>11.2f} {ms[2]:>13.2f} {ms[0] / ms[2]:>10.2f}   "
            f"{step['before']:>14.1f} {step['now']:>6.1f} {step['before'] / step['now']:>6.2f}"
        )
    report = {
        "benchmark": "prefill_attention",
        "model": path,
        "threads": threads,
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "rows": rows,
    }
    write_json(args.out, report)


if __name__ == "__main__":
    main()
