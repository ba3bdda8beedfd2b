"""Naive vs full engine, in process, at equal offered load: throughput, TTFT/E2E p50/p99, SLO attainment.

Replays the ARC-AGI-2 trace (2 attempts per test input; the synthetic ARC generator when the
trace is absent) at a Poisson rate into two AsyncEngines that share one loaded ModelRunner:

  naive  SloserveConfig.naive(): fifo, batch 1, no prefix cache, no chunked prefill
  full   the defaults: SLO urgency + aging, adaptive batching, chunked prefill, prefix reuse,
         swap preemption, admission control

Outputs follow the trace (max_tokens = expected output length, EOS ignored, so that both arms
do the same work whatever the model). Writes benchmarks/out/engine.json (or --out).

Model choice on a 2-core CPU: the built-in 40M 'default-random' model is compute-bound even when
decoding (a 16-sequence decode step costs ~11x a 1-sequence step), so batching cannot help it
there and one naive ARC request takes ~8 s; the default here is 'small' (3.9M parameters, same
byte tokenizer), where a step still has a fixed cost worth sharing, as on a GPU. ARC prompts
are ~7x longer than their outputs, so prefill (compute-bound on a CPU) caps the gain; the
prefix cache halves it.

    python -m benchmarks.engine                                  # ~1 min on 2 cores
    python -m benchmarks.engine --model tiny --rate 3 --out benchmarks/out/engine_tiny.json
    python -m benchmarks.engine --model default --num-requests 12 --rate 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import time
from pathlib import Path

import orjson
from sloserve.bench.stats import RequestRecord, summarise
from sloserve.bench.workloads import WorkloadItem, default_workload, load_workload
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
from sloserve.engine import AsyncEngine
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SLO, SamplingParams

from benchmarks._output import OUT

BENCH_MODELS = {
    # 3.9M parameters: compute still matters on a CPU, but a step has a fixed cost worth sharing
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
    # 0.1M parameters: step cost nearly flat in batch size, the regime of decode on a GPU
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


def bench_model(name: str) -> str:
    """A random-weight Llama from BENCH_MODELS (see random_llama)."""
    return random_llama(**BENCH_MODELS[name])


def random_llama(**shape) -> str:
    """A random-weight Llama of `shape` (byte tokenizer), built once with the test checkpoint builder."""
    from tests.checkpoints import tiny_checkpoint

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sloserve" / "bench"
    return str(tiny_checkpoint("llama", cache, max_position_embeddings=8192, **shape))


def pick_items(args: argparse.Namespace) -> tuple[str, list[WorkloadItem]]:
    """The first --num-requests items of the workload (groups kept together) within the length caps."""
    spec = args.workload or default_workload()
    items = [
        it
        for it in load_workload(spec, seed=args.seed, attempts=2)
        if len(it.prompt) <= args.max_prompt_chars
    ]
    return spec, items[: args.num_requests]


def model_config(args: argparse.Namespace) -> dict:
    return dict(
        path=args.model_path,
        device="cpu",
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
    )


def arm_config(arm: str, args: argparse.Namespace) -> SloserveConfig:
    if arm == "naive":
        return SloserveConfig.naive(**model_config(args))
    return SloserveConfig(model=ModelConfig(**model_config(args)))


async def replay(
    engine: AsyncEngine, arm: str, items: list[WorkloadItem], offsets: list[float], slo: SLO
) -> tuple[list[RequestRecord], float]:
    """Send each item at its Poisson offset; one RequestRecord per item (engine monotonic clock)."""
    start = time.monotonic()

    async def one(i: int, item: WorkloadItem) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + offsets[i] - time.monotonic()))
        record = RequestRecord(f"{arm}-{i}", time.monotonic(), item.max_tokens, slo=slo)
        params = SamplingParams(max_tokens=item.max_tokens, ignore_eos=True)
        try:
            ids = (
                engine.tokenizer.encode(item.prompt)
                if isinstance(item.prompt, str)
                else item.prompt
            )
            stream = engine.add_request(NewRequest(record.request_id, ids, params, slo))
            async for out in stream:
                if out.new_token_ids:
                    record.chunk_times.append(time.monotonic())
                    record.chunk_tokens.append(len(out.new_token_ids))
                if out.finished:
                    record.end_time = time.monotonic()
                    record.finish_reason = out.finish_reason
                    record.prompt_tokens = out.num_prompt_tokens
                    record.output_tokens = out.num_output_tokens
                    record.cached_tokens = out.num_cached_tokens
                    record.status = "ok" if out.finish_reason in ("stop", "length") else "refused"
                    record.error_reason = out.refusal_reason
        except Exception as exc:  # noqa: BLE001 - a refusal at admission is a result, not a crash
            record.status, record.error_reason = (
                "refused",
                getattr(exc, "reason", type(exc).__name__),
            )
            record.end_time = time.monotonic()
        return record

    records = await asyncio.gather(*(one(i, it) for i, it in enumerate(items)))
    return list(records), time.monotonic() - start


async def run_arm(arm: str, runner, args, items, offsets, slo) -> dict:
    engine = AsyncEngine(arm_config(arm, args), runner)
    await engine.start()
    try:
        records, duration = await replay(engine, arm, items, offsets, slo)
        stats = engine.stats()
        sched = engine.scheduler
        result = summarise(records, duration, slo, args.rate)
        result["arm"] = arm
        result["prompt_tokens_total"] = stats.prompt_tokens_total
        result["prompt_tokens_prefilled"] = sched.computed_prompt_tokens_total
        result["prefilled_fraction"] = (
            sched.computed_prompt_tokens_total / stats.prompt_tokens_total
            if stats.prompt_tokens_total
            else None
        )
        result["prefix_hit_tokens_total"] = stats.prefix_hit_tokens_total
        result["preemptions"] = stats.preemptions_total
        result["engine_refusals"] = stats.refusals
        result["mean_step_s"] = stats.step_time_s
        result["mean_tokens_per_step"] = stats.tokens_per_step
        return result
    finally:
        await engine.stop()


def show(result: dict) -> None:
    ttft, e2e = result["ttft_s"], result["e2e_s"]
    f = lambda v: "-" if v is None else f"{v:7.2f}"  # noqa: E731
    print(
        f"{result['arm']:>6}: {result['completed']:3d}/{result['requests']} done, "
        f"{f(result['request_throughput'])} req/s, {f(result['output_token_throughput'])} out tok/s | "
        f"TTFT p50 {f(ttft['p50'])} p99 {f(ttft['p99'])} | E2E p50 {f(e2e['p50'])} p99 {f(e2e['p99'])} | "
        f"SLO {100 * (result['slo_attainment'] or 0):5.1f}% | prefilled "
        f"{100 * (result['prefilled_fraction'] or 0):5.1f}% of prompt tokens | "
        f"{result['preemptions']} preemptions, refusals {result['engine_refusals']}",
        flush=True,
    )


async def main_async(args: argparse.Namespace) -> dict:
    from sloserve.executor import ModelRunner

    args.model_path = bench_model(args.model) if args.model in BENCH_MODELS else args.model
    spec, items = pick_items(args)
    rng = random.Random(args.seed)
    offsets, t = [], 0.0
    for _ in items:
        offsets.append(t)
        t += rng.expovariate(args.rate)
    slo = SLO(ttft_s=args.ttft_slo, e2e_s=args.e2e_slo)
    # One runner serves both arms: sized for the naive arm's whole-prompt steps and the full arm's batch.
    runner = ModelRunner(
        SloserveConfig(
            model=ModelConfig(**model_config(args)),
            cache=CacheConfig(),
            scheduler=SchedulerConfig(chunked_prefill=False),
        )
    )
    print(
        f"model {args.model} ({runner.info()['parameters'] / 1e6:.1f}M params, {runner.info()['attention_backend']} "
        f"attention), workload {spec}: "
        f"{len(items)} requests, prompts {sum(len(i.prompt) for i in items) / len(items):.0f} chars "
        f"avg, outputs {sum(i.max_tokens for i in items) / len(items):.0f} tokens avg, "
        f"Poisson {args.rate} req/s, SLO ttft {args.ttft_slo}s e2e {args.e2e_slo}s",
        flush=True,
    )
    load_before = os.getloadavg()
    results = {}
    for arm in args.arms:
        results[arm] = await run_arm(arm, runner, args, items, offsets, slo)
        show(results[arm])
    report = {
        "model": args.model,
        "model_path": args.model_path,
        "workload": spec,
        "attention_backend": runner.info()["attention_backend"],
        "num_requests": len(items),
        "rate": args.rate,
        "slo": {"ttft_s": args.ttft_slo, "e2e_s": args.e2e_slo},
        "max_prompt_chars": args.max_prompt_chars,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "arms": results,
    }
    if "naive" in results and "full" in results:
        naive, full = results["naive"], results["full"]
        report["throughput_ratio"] = full["request_throughput"] / naive["request_throughput"]
        report["p99_e2e_ratio"] = full["e2e_s"]["p99"] / naive["e2e_s"]["p99"]
        report["p99_ttft_ratio"] = full["ttft_s"]["p99"] / naive["ttft_s"]["p99"]
        print(
            f"full vs naive: throughput x{report['throughput_ratio']:.2f} (goal >= 5), "
            f"P99 E2E x{report['p99_e2e_ratio']:.3f} (goal <= 0.25), P99 TTFT x{report['p99_ttft_ratio']:.3f}; "
            f"full prefilled {100 * full['prefilled_fraction']:.1f}% of prompt tokens (goal <= 50%)"
        )
    return report


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="small",
        help="'small', 'tiny', 'default', 'default-random', 'default-moe' or a folder",
    )
    ap.add_argument(
        "--workload", default=None, help="a sloserve.bench workload spec (default: the ARC trace)"
    )
    ap.add_argument("--num-requests", type=int, default=120)
    ap.add_argument(
        "--max-prompt-chars", type=int, default=600, help="skip longer ARC prompts (CPU time)"
    )
    ap.add_argument(
        "--rate",
        type=float,
        default=200.0,
        help="Poisson arrival rate, requests/s (above both arms' capacity on a CPU, so throughput is capacity)",
    )
    ap.add_argument("--ttft-slo", type=float, default=5.0)
    ap.add_argument("--e2e-slo", type=float, default=15.0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument(
        "--attention-backend", default="sdpa", help="same for both arms (auto picks sdpa on CPU)"
    )
    ap.add_argument("--arms", nargs="+", default=["naive", "full"], choices=["naive", "full"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT / "engine.json")
    args = ap.parse_args()
    report = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
