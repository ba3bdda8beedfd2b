"""Prefill on a CPU with freed memory kept in the heap (the default) against glibc's defaults.

`sloserve.executor.host_memory` raises glibc's mmap and trim thresholds when a model loads on a
CPU, so a step's activations reuse heap pages instead of faulting in fresh ones. This script
runs prompts of each length through `LLM.generate` (one output token: the prefill is what is
timed) in child processes, the two arms alternating round by round, and reports per arm the
median time, the page faults per prompt (`ru_minflt`) and the peak RSS. The arms are
`--host-malloc keep` (the default) and `system` (glibc as it is). glibc's thresholds are per
process and its own adapt to what the process freed before, hence fresh children, several rounds.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.host_memory [--lengths 300 800 1500] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._output import OUT, write_json

ARMS = ("keep", "system")  # --host-malloc
ROW = "0123456789012345678901234\n"  # 26 characters: the byte tokenizer's 26 tokens


def prompt(length: int, tag: int) -> str:
    """A grid-like prompt of about `length` tokens whose first characters differ by `tag` (no prefix-cache hit)."""
    return f"{tag:04d} Input:\n" + ROW * max(1, (length - 20) // len(ROW)) + "Output:\n"


def child(arm: str, lengths: list[int], prompts: int) -> dict:
    """One process, one arm: per length the median seconds and faults per prompt, then peak RSS."""
    from sloserve.llm import LLM
    from sloserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    result: dict = {"lengths": {}}
    with LLM("default", device="cpu", host_malloc=arm) as llm:
        for warm, length in enumerate(lengths * 2):  # every chunk shape seen before timing
            llm.generate([prompt(length, 9000 + warm)], params)
        for length in lengths:
            times, faults = [], []
            for i in range(prompts):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                started = time.perf_counter()
                llm.generate([prompt(length, i)], params)
                times.append(time.perf_counter() - started)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            result["lengths"][str(length)] = {
                "median_ms": 1e3 * statistics.median(times),
                "faults": statistics.median(faults),
            }
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[300, 800, 1500])
    parser.add_argument(
        "--rounds", type=int, default=6, help="child processes per arm, alternating"
    )
    parser.add_argument("--prompts", type=int, default=12, help="prompts per length in each child")
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=OUT / "host_memory.json")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.lengths, args.prompts)))
        return
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                arm,
                "--prompts",
                str(args.prompts),
                "--lengths",
                *map(str, args.lengths),
            ]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            runs[arm].append(json.loads(out.strip().splitlines()[-1]))
            print(
                f"round {r} {arm}: "
                + ", ".join(
                    f"{n}: {v['median_ms']:.1f} ms {v['faults']:.0f} faults"
                    for n, v in runs[arm][-1]["lengths"].items()
                ),
                flush=True,
            )
    summary: dict = {"rounds": args.rounds, "prompts": args.prompts, "lengths": {}}
    print(f"\nmedian over {args.rounds} rounds (each round's median of {args.prompts} prompts)")
    print(
        f"{'tokens':>7} {'keep ms':>8} {'system ms':>9} {'ratio':>6} {'pairs won':>9} {'keep faults':>11} "
        f"{'system faults':>13}"
    )
    for n in map(str, args.lengths):
        keep = [run["lengths"][n]["median_ms"] for run in runs["keep"]]
        system = [run["lengths"][n]["median_ms"] for run in runs["system"]]
        won = sum(k < b for k, b in zip(keep, system, strict=True))
        row = {
            "keep_ms": statistics.median(keep),
            "system_ms": statistics.median(system),
            "keep_faults": statistics.median(run["lengths"][n]["faults"] for run in runs["keep"]),
            "system_faults": statistics.median(
                run["lengths"][n]["faults"] for run in runs["system"]
            ),
            "pairs_won": won,
        }
        row["ratio"] = row["keep_ms"] / row["system_ms"]
        summary["lengths"][n] = row
        print(
            f"{n:>7} {row['keep_ms']:8.1f} {row['system_ms']:9.1f} {row['ratio']:6.3f} {won:>5}/{args.rounds} "
            f"{row['keep_faults']:11.0f} {row['system_faults']:13.0f}"
        )
    for arm in ARMS:
        summary[f"{arm}_peak_rss_mib"] = statistics.median(run["peak_rss_mib"] for run in runs[arm])
    print(
        f"peak RSS: keep {summary['keep_peak_rss_mib']:.0f} MiB, system {summary['system_peak_rss_mib']:.0f} MiB"
    )
    write_json(args.out, {"summary": summary, "runs": runs}, indent=1)


if __name__ == "__main__":
    main()
