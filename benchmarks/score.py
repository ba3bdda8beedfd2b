"""Scoring K candidates after one ARC prompt: LLM.score against K separate echo+logprobs requests.

Each round builds a fresh ARC-shaped prompt of about --prompt-tokens tokens (synthetic tasks of
sloserve.bench.arc, byte-level: a token per character) and K candidate answer grids of 60-900
tokens, then runs both arms in alternating order, each on its own engine so neither finds the
other's blocks cached: `score` (LLM.score: the prompt computed once, its blocks shared) and
`echo` (K requests of prompt + candidate with max_tokens 0 and prompt logprobs from position 0,
which keep prefix reuse off, as a completions call with echo and logprobs does today). Printed
side by side: wall and CPU seconds (this process's, all threads: steadier than wall time on a
shared machine), tokens computed, and the largest logprob difference between arms.

    python -m benchmarks.score [--rounds 3] [--prompt-tokens 2000] [--candidates 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from sloserve import LLM
from sloserve.bench.arc import grid_text, synthetic_task, task_prompts
from sloserve.sampling_params import SamplingParams

from benchmarks.harness import machine, save


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--candidates", type=int, default=8)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default; 1 is steadier on a shared machine)",
    )
    args = p.parse_args(argv)
    if min(args.rounds, args.prompt_tokens, args.candidates) < 1:
        p.error("every count must be >= 1")
    return args


def arc_prompt(rng: random.Random, tokens: int) -> str:
    """Train pairs of synthetic ARC tasks while they fit in `tokens` characters, then a test input
    grid that fills the rest, ending in "Output:\n"."""
    text = ""
    while True:
        prompt, _ = task_prompts(synthetic_task(rng), "synthetic")[0]
        pairs = [p + "\n\n" for p in prompt.split("\n\n")[:-1]]
        fitting = [p for p in pairs if len(text) + len(p) <= tokens - 64]
        if not fitting:
            break
        text += "".join(fitting[:1])
    left = tokens - len(text) - len("Input:\nOutput:\n")
    width = min(30, max(1, left // 3))
    grid = [[rng.randrange(10) for _ in range(width)] for _ in range(max(1, left // (width + 1)))]
    return text + "Input:\n" + grid_text(grid) + "Output:\n"


def candidates(rng: random.Random, k: int) -> list[str]:
    """K answer grids of 60-900 characters (square-ish grids of digits, a row per line)."""
    out = []
    for i in range(k):
        target = 60 + (840 * i) // max(k - 1, 1)
        w = rng.randint(5, 30)
        h = max(1, round(target / (w + 1)))
        out.append(grid_text([[rng.randrange(10) for _ in range(w)] for _ in range(h)]))
    return out


def run_score(llm: LLM, prompt: list[int], cands: list[list[int]]) -> tuple:
    counters = llm.engine.scheduler.counters
    before = counters.computed_prompt_tokens_total
    started, cpu = time.perf_counter(), time.process_time()
    outs = llm.score(prompt, cands)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    computed = counters.computed_prompt_tokens_total - before
    return wall, computed, [o.token_logprobs for o in outs], cpu


def run_echo(llm: LLM, prompt: list[int], cands: list[list[int]]) -> tuple:
    counters = llm.engine.scheduler.counters
    before = counters.computed_prompt_tokens_total
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    started, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([prompt + c for c in cands], params)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    logprobs = [
        [e.logprob for e in o.prompt_logprobs[-len(c) :]] for o, c in zip(outs, cands, strict=True)
    ]
    return wall, counters.computed_prompt_tokens_total - before, logprobs, cpu


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    options = dict(
        device="cpu",
        dtype="float32",
        max_model_len=args.prompt_tokens + 1024,
        max_batched_tokens=args.max_batched_tokens,
    )
    scorer = LLM(args.model, **options)
    plain = LLM(args.model, **options)
    tok = scorer.tokenizer
    rng = random.Random(0)
    rows = []
    try:
        # warm both engines (first-call costs) on a prompt no round uses
        warm = tok.encode(arc_prompt(random.Random(-1), args.prompt_tokens))
        run_score(scorer, warm, [[49, 10]])
        run_echo(plain, warm, [[49, 10]])
        for r in range(args.rounds):
            prompt = tok.encode(arc_prompt(rng, args.prompt_tokens))
            cands = [tok.encode(c, False) for c in candidates(rng, args.candidates)]
            arms = [("score", run_score, scorer), ("echo", run_echo, plain)]
            got = {}
            for name, fn, llm in arms if r % 2 == 0 else arms[::-1]:
                got[name] = fn(llm, prompt, cands)
            diff = max(
                abs(a - b)
                for xs, ys in zip(got["score"][2], got["echo"][2], strict=True)
                for a, b in zip(xs, ys, strict=True)
            )
            row = {
                "round": r,
                "prompt_tokens": len(prompt),
                "candidate_tokens": sum(map(len, cands)),
                "score_s": got["score"][0],
                "echo_s": got["echo"][0],
                "score_cpu_s": got["score"][3],
                "echo_cpu_s": got["echo"][3],
                "score_computed": got["score"][1],
                "echo_computed": got["echo"][1],
                "max_abs_logprob_diff": diff,
            }
            rows.append(row)
            need = row["prompt_tokens"] + row["candidate_tokens"]
            print(
                f"round {r}: P={row['prompt_tokens']} sum C={row['candidate_tokens']} | "
                f"score {row['score_s']:.3f}s, {row['score_computed']} tokens "
                f"({row['score_computed'] / need:.3f} x (P + sum C)) | "
                f"echo {row['echo_s']:.3f}s, {row['echo_computed']} tokens | "
                f"echo/score wall x{row['echo_s'] / row['score_s']:.2f}, "
                f"cpu x{row['echo_cpu_s'] / row['score_cpu_s']:.2f} | "
                f"max |dlogprob| {diff:.2e}",
                flush=True,
            )
    finally:
        scorer.close()
        plain.close()
    speedup = statistics.median(r["echo_s"] / r["score_s"] for r in rows)
    cpu = statistics.median(r["echo_cpu_s"] / r["score_cpu_s"] for r in rows)
    ratio = max(r["score_computed"] / (r["prompt_tokens"] + r["candidate_tokens"]) for r in rows)
    print(
        f"median echo/score wall x{speedup:.2f}, cpu x{cpu:.2f}; "
        f"worst tokens computed / (P + sum C) {ratio:.3f}"
    )
    path = save("score", {"args": vars(args), "machine": machine(), "rounds": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
