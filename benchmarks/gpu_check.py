"""One-shot GPU check of the executor: backends, kernel bandwidth, decode latency, allocator, experts.

    python -m benchmarks.gpu_check            # on a GPU: full sizes, < 8 min on one H200
    python -m benchmarks.gpu_check --cpu      # reduced sizes on the CPU (automatic without CUDA)

Writes one JSON file under benchmarks/out/ (gpu_check.json, or gpu_check_cpu.json in the
reduced mode). Every section records its own error instead of stopping the run, and a section
that needs something missing (a backend, the ModelRunner) records a skip entry with the reason.
Sections:
  attention_correctness  each backend vs the reference (fp32 CPU oracle) on mixed/decode batches
  attention_kernels      decode attention time per call and achieved KV bandwidth (vs 4.3 TB/s)
  decode_latency         ModelRunner decode step latency at batch 1/32/128 (eager), and
                         torch.cuda.memory_stats() deltas over 50 steady steps
  expert_cache           hit rates, bytes copied and MoE layer time, partial vs all resident
                         (one matmul per expert in both), and the grouped-GEMM all-resident layer
  moe_offload            benchmarks/moe_offload.py's comparison on default-moe: tok/s at 25/50/100%
                         of the experts resident, preloading on and off, hit rate, prefetch accuracy
  served                 benchmarks/gpu_served.py: a ~0.9B Llama served (`sloserve serve` + `sloserve
                         bench fixed:512,128 --ignore-eos` at concurrency 1/16/64) against transformers'
                         generate and the HBM roofline, with the commit measured
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

import torch

from benchmarks._output import OUT
from benchmarks.gpu_served import llama_dims, served

H200_BANDWIDTH = 4.3e12  # bytes/s, HBM3e peak
BACKENDS = ("reference", "sdpa", "flash", "triton")
MEMORY_KEYS = (
    "num_device_alloc",
    "num_device_free",
    "segment.all.allocated",
    "segment.all.freed",
    "num_alloc_retries",
    "num_ooms",
    "allocation.all.allocated",
    "reserved_bytes.all.current",
)


class Stopwatch:
    """Seconds per call of fn, with CUDA events on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, fn, iters: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000 / iters
        began = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - began) / iters


def paged_case(chunks, num_heads, kv_heads, head_dim, page, dtype, device, seed=0):
    """q and shuffled paged caches for sequences given as (start_pos, query_len)."""
    from sloserve.layers.attention import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil((s + n) / page) for s, n in chunks]
    ids = list(range(1, sum(need) + 1))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    k = torch.randn(len(ids) + 1, page, kv_heads, head_dim, generator=gen).to(
        device=device, dtype=dtype
    )
    v = torch.randn(len(ids) + 1, page, kv_heads, head_dim, generator=gen).to(
        device=device, dtype=dtype
    )
    q = torch.randn(sum(n for _, n in chunks), num_heads, head_dim, generator=gen).to(
        device=device, dtype=dtype
    )
    qlens, starts = [n for _, n in chunks], [s for s, _ in chunks]
    meta = AttentionMetadata.build(qlens, starts, tables, page, device)
    return q, k, v, meta, AttentionMetadata.build(qlens, starts, tables, page, "cpu")


def try_backend(name, device, dtype, page, head_dim):
    """(backend, None) or (None, reason)."""
    from sloserve.layers.attention import BackendUnavailableError, get_backend

    try:
        return get_backend(name, device, dtype=dtype, block_size=page, head_dim=head_dim), None
    except (BackendUnavailableError, ValueError) as exc:
        return None, str(exc)


def attention_correctness(device: torch.device, gpu: bool) -> list[dict]:
    from sloserve.layers.attention import ReferenceBackend

    rows = []
    head_dim = 128 if gpu else 32
    dtypes = (torch.float32, torch.bfloat16) if gpu else (torch.float32,)
    for page in (16, 256) if gpu else (16,):
        lengths = [1, page - 1, page, page + 1, 3 * page + 5]
        mixed = [c for n in lengths for c in ((0, n), (n - 1, 1), (n // 2, n - n // 2))]
        for batch_name, chunks in (("mixed", mixed), ("decode", [(n - 1, 1) for n in lengths])):
            for ratio in (1, 4, 8):
                for dtype in dtypes:
                    q, k, v, meta, meta_cpu = paged_case(
                        chunks, 2 * ratio, 2, head_dim, page, dtype, device
                    )
                    scale = head_dim**-0.5
                    ref = ReferenceBackend().forward(
                        q.float().cpu(), k.float().cpu(), v.float().cpu(), meta_cpu, scale
                    )
                    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
                    for name in BACKENDS:
                        row = {
                            "backend": name,
                            "page": page,
                            "batch": batch_name,
                            "gqa": ratio,
                            "dtype": str(dtype).removeprefix("torch."),
                        }
                        backend, reason = try_backend(name, device, dtype, page, head_dim)
                        if backend is None:
                            rows.append({**row, "available": False, "reason": reason})
                            continue
                        out = backend.forward(q, k, v, meta, scale).float().cpu()
                        err = float((out - ref).norm() / ref.norm())
                        rows.append(
                            {
                                **row,
                                "available": True,
                                "rel_err": err,
                                "tolerance": tolerance,
                                "ok": bool(err <= tolerance),
                            }
                        )
    return rows


def attention_kernels(device: torch.device, gpu: bool) -> list[dict]:
    clock = Stopwatch(device)
    if gpu:
        heads, kv_heads, head_dim, dtype, iters = 32, 8, 128, torch.bfloat16, 20
        shapes = [(1, 8192), (32, 4096), (128, 2048)]
    else:
        heads, kv_heads, head_dim, dtype, iters = 8, 2, 64, torch.float32, 5
        shapes = [(1, 512), (8, 256), (32, 128)]
    rows = []
    for page in (16, 256) if gpu else (16,):
        for batch, context in shapes:
            chunks = [(context - 1, 1)] * batch
            q, k, v, meta, _ = paged_case(
                chunks, heads, kv_heads, head_dim, page, dtype, device, seed=batch
            )
            kv_bytes = batch * context * kv_heads * head_dim * 2 * k.element_size()
            for name in BACKENDS:
                row = {
                    "backend": name,
                    "page": page,
                    "batch": batch,
                    "context": context,
                    "heads": heads,
                    "kv_heads": kv_heads,
                    "head_dim": head_dim,
                    "dtype": str(dtype).removeprefix("torch."),
                }
                backend, reason = try_backend(name, device, dtype, page, head_dim)
                if backend is None:
                    rows.append({**row, "available": False, "reason": reason})
                    continue
                seconds = clock.time(partial(backend.forward, q, k, v, meta, head_dim**-0.5), iters)
                row.update(
                    available=True,
                    time_us=seconds * 1e6,
                    kv_bytes=kv_bytes,
                    kv_bandwidth_gbs=kv_bytes / seconds / 1e9,
                )
                if gpu:
                    row["fraction_of_4_3_tbs"] = kv_bytes / seconds / H200_BANDWIDTH
                rows.append(row)
    return rows


def build_llama(folder: Path, gpu: bool, device: torch.device) -> dict:
    """A random-weight Llama checkpoint (~0.9B on a GPU, tiny on a CPU) saved with transformers."""
    from sloserve.tokenizer import save_byte_level_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    dims = llama_dims(gpu)
    config = LlamaConfig(
        **dims,
        max_position_embeddings=4096,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=False,
    )
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16 if gpu else torch.float32
        )
    model.save_pretrained(folder, safe_serialization=True)
    save_byte_level_tokenizer(folder, config.max_position_embeddings)
    return {**dims, "parameters": sum(p.numel() for p in model.parameters())}


def decode_batch(
    runner,
    batch: int,
    pages,
    prompt_len: int,
    warmup: int,
    steady: int,
    gpu: bool,
    token_budget: int,
) -> dict:
    """Prefill `batch` random prompts, then time `steady` decode steps after `warmup` ones."""
    from sloserve.sampling_params import SamplingParams
    from sloserve.sched.output import ScheduledSequence, SchedulerOutput

    greedy = SamplingParams(max_tokens=10**6, ignore_eos=True)
    block = runner.block_size
    total = prompt_len + warmup + steady + 1
    tables = [[next(pages) for _ in range(math.ceil(total / block))] for _ in range(batch)]
    gen = random.Random(batch)
    prompts = [[gen.randrange(256) for _ in range(prompt_len)] for _ in range(batch)]
    last: list[int] = []
    group = max(1, token_budget // prompt_len)
    for lo in range(0, batch, group):  # prefill within the step token budget
        seqs = [
            ScheduledSequence(f"b{batch}-{i}", prompts[i], 0, tables[i], True, greedy)
            for i in range(lo, min(batch, lo + group))
        ]
        last += [run[0] for run in runner.execute(SchedulerOutput(seqs)).tokens]

    def step(pos: int) -> None:
        seqs = [
            ScheduledSequence(
                f"b{batch}-{i}", [last[i]], pos, tables[i], True, greedy, pos - prompt_len
            )
            for i in range(batch)
        ]
        last[:] = [run[0] for run in runner.execute(SchedulerOutput(seqs)).tokens]

    pos = prompt_len
    for _ in range(warmup):
        step(pos)
        pos += 1
    device = runner.device
    before = torch.cuda.memory_stats(device) if gpu else {}
    began = time.perf_counter()
    for _ in range(steady):
        step(pos)
        pos += 1
    seconds = (time.perf_counter() - began) / steady
    run = {
        "backend": runner.backend.name,
        "block_size": block,
        "batch": batch,
        "context": pos,
        "step_ms": seconds * 1e3,
        "tokens_per_s": batch / seconds,
        "steps": steady,
    }
    if gpu:
        after = torch.cuda.memory_stats(device)
        run["memory_stats_delta"] = {
            key: after.get(key, 0) - before.get(key, 0) for key in MEMORY_KEYS
        }
        run["memory_stats_missing_keys"] = [key for key in MEMORY_KEYS if key not in after]
    else:
        run["memory_stats_delta"] = "skipped: torch.cuda.memory_stats() needs a CUDA device"
    return run


def decode_latency(device: torch.device, gpu: bool, deadline: float) -> dict:
    try:
        from sloserve.executor import ModelRunner
    except ImportError as exc:
        return {"skipped": f"sloserve.executor.ModelRunner is not importable: {exc}"}

    folder = Path(tempfile.mkdtemp(prefix="gpu_check_llama_"))
    try:
        return decode_runs(ModelRunner, folder, device, gpu, deadline)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def decode_runs(runner_cls, folder: Path, device: torch.device, gpu: bool, deadline: float) -> dict:
    from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig

    result: dict = {"model": build_llama(folder, gpu, device), "runs": []}
    prompt_len, warmup, steady = (256, 5, 50) if gpu else (32, 2, 10)
    # NOTE: auto runs with the block size unset, as a user gets it: flash with 256-token pages when
    # flash-attn is importable, else triton with 16; triton is named too, with its captured decode
    # step (CUDA graphs) and without (--enforce-eager), so graphs are timed against eager.
    runs: list[tuple[str, int | None, bool | None]] = [("auto", None, None), ("sdpa", 16, None)]
    if gpu:
        runs += [("triton", 16, None), ("triton", 16, True), ("triton", 256, None)]
    for backend, block, enforce_eager in runs:
        if time.monotonic() > deadline:
            result["runs"].append({"backend": backend, "skipped": "time budget spent"})
            continue
        config = SloserveConfig(
            model=ModelConfig(
                path=str(folder),
                device=str(device),
                attention_backend=backend,
                max_model_len=1024,
                enforce_eager=enforce_eager,
            ),
            cache=CacheConfig(
                block_size=block, kv_pool_bytes=(8 * 1024 if gpu else 256) * 1024**2, swap_bytes=0
            ),
            scheduler=SchedulerConfig(max_batch=128, max_batched_tokens=8192 if gpu else 2048),
        )
        try:
            runner = runner_cls(config)
        except Exception as exc:  # noqa: BLE001 - recorded, e.g. flash-attn not installed
            result["runs"].append({"backend": backend, "block_size": block, "skipped": repr(exc)})
            continue
        runner.warmup()
        info = runner.info()
        print(
            f"  {backend}/{block}: decode step {info['decode_step']}, warm-up {info['warmup_time_s']:.2f}s",
            flush=True,
        )
        result.setdefault("decode_paths", []).append(
            {
                "backend": backend,
                "block_size": block,
                "decode_step": info["decode_step"],
                "warmup_time_s": info["warmup_time_s"],
                "capture_bytes": getattr(runner.decode_step, "capture_bytes", None),
            }
        )
        pages = iter(range(1, runner.num_kv_blocks))
        for batch in (1, 8, 32, 64, 128) if gpu else (1, 32):
            try:
                run = decode_batch(
                    runner,
                    batch,
                    pages,
                    prompt_len,
                    warmup,
                    steady,
                    gpu,
                    config.scheduler.max_batched_tokens,
                )
            except Exception as exc:  # noqa: BLE001 - keep the other batches and backends
                result["runs"].append(
                    {
                        "backend": backend,
                        "batch": batch,
                        "error": repr(exc),
                        "traceback": traceback.format_exc(),
                    }
                )
                continue
            run["decode_step"] = info["decode_step"]
            result["runs"].append(run)
            print(
                f"  decode {run['backend']:>9} batch {batch:>3}: {run['step_ms']:.2f} ms/step",
                flush=True,
            )
        if gpu:
            result["memory_stats_keys"] = sorted(torch.cuda.memory_stats(device))
        runner = None  # free the pool before the next backend's runner
        if gpu:
            torch.cuda.empty_cache()
    return result


def expert_cache(device: torch.device, gpu: bool) -> dict:
    from sloserve.layers.moe import ExpertStore, moe_forward

    clock = Stopwatch(device)
    layers, experts, top_k = 2, 8, 2
    hidden, inter, tokens, steps, dtype = (
        (2048, 5632, 64, 40, torch.bfloat16) if gpu else (64, 128, 16, 20, torch.float32)
    )
    gen = torch.Generator().manual_seed(0)
    weights = {
        i: (
            (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02).to(dtype),
            (torch.randn(experts, hidden, inter, generator=gen) * 0.02).to(dtype),
        )
        for i in range(layers)
    }
    bias = torch.linspace(2.0, -1.5, experts)  # skewed routing: low expert ids are hot
    batches = [
        (
            torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype),
            (torch.randn(tokens, experts, generator=gen) + bias).to(device),
        )
        for _ in range(steps)
    ]
    # NOTE: one matmul per expert everywhere, so partial and all-resident outputs compare bitwise;
    # the grouped GEMMs (the CUDA default) are timed apart below.
    full = ExpertStore(weights, device=device, dtype=dtype, grouped=False)
    grouped = ExpertStore(weights, device=device, dtype=dtype)

    def run(store: ExpertStore) -> torch.Tensor:
        out = None
        for x, logits in batches:
            for layer in range(layers):
                out = moe_forward(x, logits, store, layer, top_k, True)
        return out

    result: dict = {
        "layers": layers,
        "experts": experts,
        "top_k": top_k,
        "hidden": hidden,
        "intermediate": inter,
        "tokens_per_step": tokens,
        "steps": steps,
        "dtype": str(dtype).removeprefix("torch."),
        "all_resident_layer_ms": clock.time(lambda: run(full), 1, warmup=1)
        * 1e3
        / (steps * layers),
        "grouped_gemms": grouped.grouped,
    }
    expected = run(full)
    if grouped.grouped:
        result["all_resident_grouped_layer_ms"] = (
            clock.time(lambda: run(grouped), 1, warmup=1) * 1e3 / (steps * layers)
        )
        result["grouped_max_abs_diff"] = float(
            (run(grouped).float() - expected.float()).abs().max()
        )
    for slots, preload in ((4, 0), (4, 2), (6, 3)):
        key = f"slots{slots}_preload{preload}"
        try:
            store = ExpertStore(
                weights, device=device, dtype=dtype, slots_per_layer=slots, grouped=False
            )
            run(store)  # routing statistics for preload
            store.preload(preload)
            store.reset_stats()
            began = time.perf_counter()
            out = run(store)
            if gpu:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - began
        except Exception as exc:  # noqa: BLE001 - keep the other configurations
            result[key] = {"error": repr(exc), "traceback": traceback.format_exc()}
            continue
        result[key] = {
            **store.stats(),
            "identical_to_all_resident": bool(torch.equal(out, expected)),
            "layer_ms": seconds * 1e3 / (steps * layers),
            "copy_gbs": store.bytes_copied / seconds / 1e9,
        }
        print(f"  experts {key}: hit rate {store.stats()['hit_rate']:.2f}", flush=True)
    return result


def moe_offload(device: torch.device, gpu: bool) -> dict:
    """benchmarks/moe_offload.py's arms on default-moe (reduced: 6 requests, 32 output tokens each)."""
    from sloserve.bench.workloads import default_workload, load_workload
    from sloserve.models.loader import resolve_model_path
    from sloserve.tokenizer import Tokenizer

    from benchmarks.moe_offload import compare

    spec = default_workload()
    items = [it for it in load_workload(spec, seed=0, attempts=2) if len(it.prompt) <= 1200][
        : 6 if gpu else 2
    ]
    tokenizer = Tokenizer.from_pretrained(resolve_model_path("default-moe"))
    prompts = [tokenizer.encode(it.prompt) for it in items]
    budgets = [min(it.max_tokens, 32 if gpu else 4) for it in items]
    runs = []
    for concurrency in (1, 6) if gpu else (2,):
        runs += compare(
            "default-moe",
            str(device),
            prompts,
            budgets,
            concurrency,
            [25, 50, 100],
            [True, False],
            2048,
            2 if gpu else 1,
            log=lambda line: print(line, flush=True),
        )
    return {"workload": spec, "requests": len(items), "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="reduced sizes on the CPU")
    parser.add_argument(
        "--out", type=Path, help="JSON path (default benchmarks/out/gpu_check[_cpu].json)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="skip later runs past this many seconds"
    )
    args = parser.parse_args()
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    started = time.monotonic()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 correctness checks must be fp32
    report: dict = {
        "mode": "gpu" if gpu else "cpu-reduced",
        "device": torch.cuda.get_device_name(0)
        if gpu
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if not gpu:
        report["note"] = (
            "no CUDA device: reduced CPU sizes; GPU-only backends are listed as unavailable"
        )
    sections = [
        ("attention_correctness", lambda: attention_correctness(device, gpu)),
        ("attention_kernels", lambda: attention_kernels(device, gpu)),
        ("decode_latency", lambda: decode_latency(device, gpu, started + args.budget_s)),
        ("expert_cache", lambda: expert_cache(device, gpu)),
        ("moe_offload", lambda: moe_offload(device, gpu)),
        ("served", lambda: served(gpu)),
    ]
    for name, section in sections:
        print(f"[{time.monotonic() - started:6.1f}s] {name}", flush=True)
        try:
            report[name] = section()
        except Exception as exc:  # noqa: BLE001 - one failing section must not hide the others
            report[name] = {"error": repr(exc), "traceback": traceback.format_exc()}
            print(traceback.format_exc(), file=sys.stderr, flush=True)
    report["wall_s"] = time.monotonic() - started
    bad = [
        r
        for r in report.get("attention_correctness", [])
        if isinstance(r, dict) and r.get("ok") is False
    ]
    report["correctness_failures"] = len(bad)
    out = args.out or OUT / ("gpu_check.json" if gpu else "gpu_check_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    if gpu:
        print(
            "torch.cuda.memory_stats() keys:",
            ", ".join(report["decode_latency"].get("memory_stats_keys", [])),
        )
    print(f"wrote {out} in {report['wall_s']:.1f}s; correctness failures: {len(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
