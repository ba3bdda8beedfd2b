"""LoRA adapters loaded, used and unloaded while serving: time to a first token after a load, and
whether a thousand load / generate / unload cycles leak anything.

One LLM (the engine in this process; the served engine runs the same `EngineCore`):
  first token  load a rank-R adapter, generate one token with it, unload; the load's seconds and
               load + first token's, median and max over `--first-token` tries (each a fresh name)
  cycles       `--cycles` times: load an adapter, generate `--new-tokens` with it beside three
               base-model requests in the same batch, unload; every `--every` cycles the process's
               RSS, the free KV blocks, the adapters held and the prefix-cache roots. Leaks show as
               RSS that climbs past the warm-up, free blocks that fall, or names that stay.

    python -m benchmarks.lora_lifecycle [--model default-random] [--rank 64] [--cycles 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from sloserve import LLM
from sloserve.models.default import BUILTIN_MODELS, ensure_default_model
from sloserve.sampling_params import SamplingParams

from benchmarks._output import OUT, write_json
from benchmarks.lora_batch import write_adapter


def rss_mib() -> float:
    """This process's resident set, MiB (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def first_token_times(llm: LLM, adapter: Path, tries: int, prompt: list[int]) -> dict:
    """Seconds to load `adapter` and to load it and get one token with it, `tries` times."""
    loads, firsts = [], []
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for i in range(tries):
        name = f"first-{i}"
        started = time.perf_counter()
        llm.load_lora(name, str(adapter))
        loaded = time.perf_counter()
        llm.generate([prompt], params, adapter=name)
        done = time.perf_counter()
        llm.unload_lora(name)
        loads.append(loaded - started)
        firsts.append(done - started)
    return {
        "load_s_median": statistics.median(loads),
        "load_s_max": max(loads),
        "first_token_s_median": statistics.median(firsts),
        "first_token_s_max": max(firsts),
    }


def cycles(llm: LLM, adapter: Path, count: int, every: int, new_tokens: int, prompt: list[int]):
    """`count` load / generate / unload cycles; a sample of the leak signals every `every`."""
    core = llm._core
    blocks = core.scheduler.block_manager
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    # three base-model requests beside the adapter's: the cycle runs under load, and prompts vary
    # so the prefix cache keeps turning over
    samples = []
    for i in range(count):
        name = f"cycle-{i}"
        llm.load_lora(name, str(adapter))
        prompts = [[*prompt, i % 200, j] for j in range(4)]
        outs = llm.generate(prompts, params, adapter=[name, None, None, None])
        assert all(len(o.token_ids) == new_tokens for o in outs), "a cycle's request fell short"
        llm.unload_lora(name)
        if i % every == 0 or i == count - 1:
            samples.append(
                {
                    "cycle": i,
                    "rss_mib": round(rss_mib(), 1),
                    "kv_blocks_free": blocks.num_free,
                    "kv_blocks_cached": blocks.num_cached,
                    "adapters_held": len(core.runner.lora),
                    "adapter_roots": len(blocks.adapter_roots),
                    "live_requests": len(core.scheduler.requests),
                }
            )
            print(samples[-1], flush=True)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default-random", help="a built-in name or a folder")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--first-token", type=int, default=20, help="load + first-token tries")
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=OUT / "lora_lifecycle.json")
    args = parser.parse_args()
    base = ensure_default_model(args.model) if args.model in BUILTIN_MODELS else Path(args.model)
    prompt = [256, *[(i * 37) % 250 for i in range(args.prompt_tokens - 1)]]
    with tempfile.TemporaryDirectory() as tmp:
        adapter = write_adapter(Path(tmp) / "adapter", base, args.rank, seed=1)
        started = time.perf_counter()
        llm = LLM(str(base), device="cpu", max_model_len=512)
        print(
            f"model {base} ready in {time.perf_counter() - started:.1f} s; load avg {os.getloadavg()}"
        )
        with llm:
            llm.generate([prompt], SamplingParams(max_tokens=2))  # warm-up
            first = first_token_times(llm, adapter, args.first_token, prompt)
            print("first token:", first, flush=True)
            samples = cycles(llm, adapter, args.cycles, args.every, args.new_tokens, prompt)
    warm, last = samples[min(1, len(samples) - 1)], samples[-1]
    report = {
        "benchmark": "lora_lifecycle",
        "model": str(base),
        "rank": args.rank,
        "load_avg_1m": os.getloadavg()[0],
        "first_token": first,
        "cycles": args.cycles,
        "samples": samples,
        "rss_growth_after_warmup_mib": round(last["rss_mib"] - warm["rss_mib"], 1),
        "kv_blocks_free_change": last["kv_blocks_free"] - samples[0]["kv_blocks_free"],
        "adapters_held_at_end": last["adapters_held"],
        "adapter_roots_at_end": last["adapter_roots"],
    }
    print({k: v for k, v in report.items() if k != "samples"})
    write_json(args.out, report)


if __name__ == "__main__":
    main()
