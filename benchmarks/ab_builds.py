"""Two builds of sloserve side by side: greedy tokens, served throughput and TTFT, on one machine.

A refactoring must leave behaviour alone. This script takes two virtualenvs (each with its own
`pip install -e` checkout, e.g. main before and after a change) and, alternating the arms round
by round so that drift on a shared machine hits both alike:

  tokens   the offline `LLM` of each build, greedy, on the same ARC-like prompts (the built-in
           model by default): every token id must be identical
  served   `sloserve serve` of each build, driven by the same `sloserve bench` closed loop
           (the ARC-AGI-2 trace if present, else synthetic-arc): output tok/s, TTFT p50/p99

    python -m benchmarks.ab_builds --a /work/wt-before/.venv --b .venv [--rounds 3]

Only the command-line interfaces and `sloserve.LLM` are used, so any two builds compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks._output import OUT, write_json
from benchmarks.harness import bench_fresh_server

TOKENS_SCRIPT = r"""
import json, sys
from sloserve import LLM, SamplingParams
from sloserve.bench.workloads import load_workload

model, n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
items = load_workload("synthetic-arc", seed=0, num_requests=n)
with LLM(model) as llm:
    outs = llm.generate([i.prompt for i in items], SamplingParams(max_tokens=max_tokens, temperature=0))
print(json.dumps([o.token_ids for o in outs]))
"""


def greedy_tokens(venv: Path, model: str, n: int, max_tokens: int) -> list[list[int]]:
    """Every prompt's greedy token ids from this build's offline LLM."""
    done = subprocess.run(
        [str(venv / "bin/python"), "-c", TOKENS_SCRIPT, model, str(n), str(max_tokens)],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def served(venv: Path, model: str, bench_args: list[str], workdir: Path) -> dict:
    """One fresh server of this build, one closed-loop bench run against it: the bench's summary."""
    run = bench_fresh_server(
        venv / "bin/sloserve", ["--model", model], bench_args, workdir / "serve.log"
    )
    return {
        "output_tok_s": run["output_token_throughput"],
        "ttft_p50_s": run["ttft_s"]["p50"],
        "ttft_p99_s": run["ttft_s"]["p99"],
        "completed": run["completed"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--a", type=Path, required=True, help="virtualenv of build A (before)")
    p.add_argument("--b", type=Path, required=True, help="virtualenv of build B (after)")
    p.add_argument("--model", default="default")
    p.add_argument("--prompts", type=int, default=16, help="prompts of the token check")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="served runs per build, alternating")
    p.add_argument(
        "--bench-args",
        default="--workload synthetic-arc --num-requests 64 --concurrency 8 --max-tokens 48",
        help="what `sloserve bench` gets besides --server and --json",
    )
    p.add_argument("--out", type=Path, default=OUT / "ab_builds.json")
    args = p.parse_args()

    arms = {"a": args.a.resolve(), "b": args.b.resolve()}
    tokens = {
        k: greedy_tokens(v, args.model, args.prompts, args.max_tokens) for k, v in arms.items()
    }
    identical = tokens["a"] == tokens["b"]
    print(f"greedy tokens of {args.prompts} prompts identical: {identical}", flush=True)

    runs: dict[str, list[dict]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for k in ("a", "b") if r % 2 == 0 else ("b", "a"):
                runs[k].append(served(arms[k], args.model, args.bench_args.split(), Path(tmp)))
                print(f"round {r} {k}: {json.dumps(runs[k][-1])}", flush=True)

    def med(k: str, field: str) -> float:
        return statistics.median(x[field] for x in runs[k])

    summary = {
        f: {"a": med("a", f), "b": med("b", f), "b/a": med("b", f) / med("a", f)}
        for f in ("output_tok_s", "ttft_p50_s", "ttft_p99_s")
    }
    for f, s in summary.items():
        print(f"{f:14s} a {s['a']:.4g}  b {s['b']:.4g}  b/a x{s['b/a']:.3f}")
    write_json(
        args.out,
        {
            "arms": {k: str(v) for k, v in arms.items()},
            "tokens_identical": identical,
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "bench_args": args.bench_args,
            "runs": runs,
            "median": summary,
        },
    )


if __name__ == "__main__":
    main()
