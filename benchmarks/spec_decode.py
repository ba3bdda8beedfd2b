"""Speculative decoding on ARC-shaped tasks: c1 decode rate with drafts against without, side by side.

Each ARC task (held-out ARC-AGI-2 training tasks, else synthetic ones: server/bench/arc.py) runs
alone (concurrency 1) through an engine per arm, each arm in a process of its own, the arms
alternating task by task: `off` (no drafts), `ngram kK` (prompt lookup, K drafts a step) and
`predict` (speculation off, the request's prediction = the test input grid, which a same-shape
answer edits in a few cells) and `auto` (prompt lookup, the drafts a step as spec/auto.py's cost
model allows, at most the largest K). Every arm must give the tokens `off` gives (checked). The
decode rate is tokens after the first / time after the first (what a streaming client sees);
end-to-end time, the share of drafts accepted and the tokens per verify step are reported beside
it. With `--concurrency N` the tasks go N at a time (the decode rate is then all tokens after
each request's first over the batch's time after its first token).

    python -m benchmarks.spec_decode [--model default] [--tasks 16] [--k 4 8 16] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path

from sloserve import LLM
from sloserve.bench.arc import grid_text, synthetic_task, task_prompts
from sloserve.bench.workloads import ARC_TRACE, answer_budget
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams

from benchmarks._output import write_json


def tasks(count: int, max_len: int, seed: int, folder: Path | None) -> list[tuple[str, str, str]]:
    """(prompt, expected answer, test input grid) of `count` tasks whose answer has the test
    input's shape and that fit `max_len`: the ARC-AGI-2 training tasks the built-in model never
    saw (the last 100 by file name, docs/design/builtin-model.md) when `folder` has them, else
    synthetic ones."""
    if folder is not None and folder.is_dir():
        candidates = [json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))[-100:]]
    else:
        rng = random.Random(seed)
        candidates = (synthetic_task(rng) for _ in range(100_000))
    found = []
    for task in candidates:
        test = task["test"][0]
        if "output" not in test or len(test["output"]) != len(test["input"]):
            continue
        if len(test["output"][0]) != len(test["input"][0]):
            continue
        prompt, expected = task_prompts(task, "task")[0]
        if len(prompt) + answer_budget(expected) + 8 > max_len:
            continue
        found.append((prompt, expected, grid_text(test["input"])))
        if len(found) == count:
            break
    return found


def run_batch(llm: LLM, jobs: list[tuple[str, str, int, str | None]]) -> list[dict]:
    """Requests (id, prompt, max_tokens, prediction) at once: each one's tokens, decode and
    end-to-end seconds and draft counts, and (on the first) the batch's verify steps."""
    core = llm._core
    counters = core.scheduler.counters
    verifies = counters.spec_drafts_total
    began = time.perf_counter()
    for rid, prompt, max_tokens, prediction in jobs:
        ids = llm.tokenizer.encode(prompt)
        predicted = None if prediction is None else llm.tokenizer.encode(prediction, False)
        core.add(NewRequest(rid, ids, SamplingParams(max_tokens=max_tokens), prediction=predicted))
    runs = {rid: {"tokens": [], "first": began, "last": began} for rid, *_ in jobs}
    while core.has_work():
        for out in core.step():
            run = runs[out.request_id]
            if out.new_token_ids:
                if not run["tokens"]:
                    run["first"] = time.perf_counter()
                run["tokens"] += out.new_token_ids
                run["last"] = time.perf_counter()
            if out.finished:
                run["drafted"], run["accepted"] = out.num_drafted_tokens, out.num_accepted_tokens
    results = [
        {
            "tokens": run["tokens"],
            "decode_s": run["last"] - run["first"],
            "e2e_s": run["last"] - began,
            "drafted": run["drafted"],
            "accepted": run["accepted"],
            "verifies": 0,
        }
        for run in runs.values()
    ]
    results[0]["verifies"] = counters.spec_drafts_total - verifies
    return results


def serve_arm(options: dict, conn: Connection) -> None:
    """A child process: one arm's engine, running the requests it is sent one at a time."""
    llm = LLM(**options)
    conn.send("ready")
    while (jobs := conn.recv()) is not None:
        conn.send(run_batch(llm, jobs))
    llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8, 16], help="drafts per step")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=1, help="tasks sent at once")
    parser.add_argument("--no-predict", action="store_true", help="leave out the prediction arm")
    parser.add_argument("--json", action="store_true", help="write the report to --out")
    parser.add_argument(
        "--arc",
        type=Path,
        default=ARC_TRACE.parent / "training",
        help="ARC-AGI-2 training tasks (the held-out last 100 are used); synthetic if absent",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "spec_decode.json"
    )
    args = parser.parse_args()
    common = dict(
        model=args.model,
        device="cpu",
        max_model_len=args.max_model_len,
        max_batch=args.concurrency,
    )
    arms: dict[str, tuple[dict, bool]] = {"off": (common, False)}
    for k in args.k:
        arms[f"ngram k{k}"] = (
            {**common, "speculation": "ngram", "num_speculative_tokens": k},
            False,
        )
    most = {"num_speculative_tokens": max(args.k)}
    arms[f"auto k{max(args.k)}"] = ({**common, "speculation": "auto", **most}, False)
    if not args.no_predict:
        arms[f"predict k{max(args.k)}"] = ({**common, **most}, True)
    work = tasks(args.tasks, args.max_model_len, args.seed, args.arc)
    print(
        f"{args.model}: {len(work)} tasks, prompts median "
        f"{statistics.median(len(p) for p, _, _ in work)} tokens, answers median "
        f"{statistics.median(len(e) for _, e, _ in work)}, concurrency {args.concurrency}, load "
        f"{os.getloadavg()[0]:.1f} (arms in processes of their own, alternating batch by batch)"
    )
    # NOTE: one engine per process: torch's thread count is process-wide and each runner sets it
    context = multiprocessing.get_context("spawn")
    workers = {}
    for name, (options, _) in arms.items():
        mine, theirs = context.Pipe()
        process = context.Process(target=serve_arm, args=(options, theirs), daemon=True)
        process.start()
        workers[name] = (process, mine)
    for _, conn in workers.values():
        conn.recv()
    results: dict[str, list[dict]] = {name: [] for name in arms}
    c = args.concurrency
    for b, at in enumerate(range(0, len(work), c)):
        batch = list(enumerate(work))[at : at + c]
        for name in list(arms) if b % 2 == 0 else list(arms)[::-1]:
            jobs = [
                (f"t{i}", prompt, answer_budget(expected), grid if arms[name][1] else None)
                for i, (prompt, expected, grid) in batch
            ]
            workers[name][1].send(jobs)
            results[name] += workers[name][1].recv()
        for name in arms:
            for j, (i, _) in enumerate(batch):
                if results[name][at + j]["tokens"] != results["off"][at + j]["tokens"]:
                    raise SystemExit(f"task {i}: arm {name!r} gave other tokens than 'off'")
    for process, conn in workers.values():
        conn.send(None)
        process.join(timeout=30)
    base = _summary(results["off"])
    print(
        f"{'arm':>12} {'decode tok/s':>12} {'x off':>6} {'e2e s':>7} {'x off':>6} "
        f"{'accepted':>9} {'per verify':>10}"
    )
    report = {
        "model": args.model,
        "tasks": len(work),
        "concurrency": c,
        "load": os.getloadavg()[0],
        "arms": {},
    }
    for name, runs in results.items():
        s = _summary(runs)
        report["arms"][name] = s
        print(
            f"{name:>12} {s['decode_tok_s']:12.1f} {s['decode_tok_s'] / base['decode_tok_s']:6.2f} "
            f"{s['e2e_s']:7.3f} {base['e2e_s'] / s['e2e_s']:6.2f} {s['acceptance']:9.2f} "
            f"{s['tokens_per_verify']:10.2f}"
        )
    print(f"load {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        write_json(args.out, report)


def _summary(runs: list[dict]) -> dict:
    """Decode rate over all tasks (tokens after the first / time after the first, summed), mean
    end-to-end seconds, accepted / drafted tokens, and tokens per verify step."""
    after_first = sum(len(r["tokens"]) - 1 for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    drafted = sum(r["drafted"] for r in runs)
    accepted = sum(r["accepted"] for r in runs)
    verifies = sum(r["verifies"] for r in runs)
    return {
        "decode_tok_s": after_first / decode_s if decode_s else 0.0,
        "e2e_s": statistics.fmean(r["e2e_s"] for r in runs),
        "acceptance": accepted / drafted if drafted else 0.0,
        "drafted": drafted,
        "accepted": accepted,
        # a verify step yields its accepted drafts and the model's own token
        "tokens_per_verify": (accepted + verifies) / verifies if verifies else 0.0,
    }


if __name__ == "__main__":
    main()
