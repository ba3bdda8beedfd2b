"""Greedy-decode the held-out ARC tasks with sloserve; report well-formed grids, EOS and exact match.

Held out = the last 10% of ARC-AGI-2 training tasks by sorted file name (never trained on). Each
test input is one prompt in the workload's format; leading train pairs are dropped until the
prompt fits in --prompt-budget tokens (the model was trained on sequences of at most 1,536 tokens).

    python -m tools.eval_default --check-hf 2    # also compare with transformers
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tools.train_default import RESULTS, grid_text, split_tasks

EOS = 257


def heldout_prompts(prompt_budget: int) -> list[dict]:
    """task_id, prompt, expected and shots kept, for every test input of every held-out task."""
    _, held = split_tasks()
    items = []
    for task_id, task in held:
        pairs = [
            "Input:\n" + grid_text(p["input"]) + "Output:\n" + grid_text(p["output"]) + "\n"
            for p in task["train"]
        ]
        for index, test in enumerate(task["test"]):
            query = "Input:\n" + grid_text(test["input"]) + "Output:\n"
            shots = list(pairs)
            while shots and 1 + len("".join(shots).encode()) + len(query) > prompt_budget:
                shots.pop(0)
            items.append(
                {
                    "task_id": task_id,
                    "test_index": index,
                    "prompt": "".join(shots) + query,
                    "expected": grid_text(test["output"]),
                    "shots": len(shots),
                    "train_pairs": len(pairs),
                }
            )
    return items


def shape(text: str) -> tuple[int, int] | None:
    from sloserve.bench.arc import parse_grid_text

    grid = parse_grid_text(text)
    return None if grid is None else (len(grid), len(grid[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt-budget", type=int, default=1024, help="prompt tokens, at most")
    parser.add_argument("--max-tokens", type=int, default=960, help="a 30x30 grid is 930 tokens")
    parser.add_argument(
        "--check-hf", type=int, default=0, help="compare N prompts with transformers"
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="only the first N prompts (a quick check)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "eval_default.json")
    args = parser.parse_args()

    import torch
    from sloserve.llm import LLM
    from sloserve.sampling_params import SamplingParams

    torch.set_num_threads(2)
    items = heldout_prompts(args.prompt_budget)[: args.limit]
    started = time.perf_counter()
    with LLM(args.model, device="cpu") as llm:
        outs = llm.generate(
            [i["prompt"] for i in items], SamplingParams(max_tokens=args.max_tokens)
        )
    elapsed = time.perf_counter() - started
    for item, out in zip(items, outs, strict=True):
        got = shape(out.text)
        item |= {
            "output": out.text,
            "tokens": len(out.token_ids),
            "finish_reason": out.finish_reason,
            "well_formed": got is not None,
            "eos": out.finish_reason == "stop",
            "shape_match": got is not None and got == shape(item["expected"]),
            "exact": out.text == item["expected"],
        }
    n = len(items)
    rate = {k: sum(i[k] for i in items) / n for k in ("well_formed", "eos", "shape_match", "exact")}
    tasks = sorted({i["task_id"] for i in items})
    solved = sum(all(i["exact"] for i in items if i["task_id"] == t) for t in tasks)
    lengths = sorted(i["tokens"] for i in items)
    summary = {
        "model": args.model,
        "heldout_tasks": len(tasks),
        "prompts": n,
        "prompt_budget": args.prompt_budget,
        "max_tokens": args.max_tokens,
        "seconds": round(elapsed, 1),
        **{f"{k}_rate": round(v, 4) for k, v in rate.items()},
        "well_formed_and_eos_rate": round(sum(i["well_formed"] and i["eos"] for i in items) / n, 4),
        "tasks_solved": solved,
        "output_tokens": {
            "min": lengths[0],
            "median": statistics.median(lengths),
            "max": lengths[-1],
            "at_max_tokens": sum(i["finish_reason"] == "length" for i in items),
        },
    }
    print(
        f"held-out: {len(tasks)} tasks, {n} test inputs, greedy, max_tokens {args.max_tokens}, "
        f"{elapsed:.0f} s"
    )
    print(
        f"well-formed grids {rate['well_formed']:.1%}  ended with EOS {rate['eos']:.1%}  "
        f"right shape {rate['shape_match']:.1%}  exact match {rate['exact']:.1%} "
        f"({sum(i['exact'] for i in items)}/{n}; tasks solved {solved}/{len(tasks)})"
    )
    print(
        f"output tokens: min {lengths[0]}, median {statistics.median(lengths):g}, max {lengths[-1]}; "
        f"{summary['output_tokens']['at_max_tokens']} stopped at max_tokens"
    )
    if args.check_hf:
        shortest = sorted(range(n), key=lambda k: len(items[k]["prompt"]))[: args.check_hf]
        summary["hf_identical"] = check_hf(
            args.model, [(items[k], outs[k].token_ids) for k in shortest], args.max_tokens
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "items": items}, indent=1) + "\n")
    print(f"wrote {args.out}")


def check_hf(model: str, runs: list[tuple[dict, list[int]]], max_tokens: int) -> list[bool]:
    """Whether transformers' greedy tokens equal sloserve's, for each (item, sloserve token ids)."""
    import torch
    from sloserve.models.loader import resolve_model_path
    from sloserve.tokenizer import Tokenizer
    from transformers import AutoModelForCausalLM

    folder = resolve_model_path(model)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = Tokenizer.from_pretrained(folder)
    equal = []
    for item, ours in runs:
        ids = torch.tensor([tok.encode(item["prompt"])])
        with torch.no_grad():
            out = hf.generate(
                ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=258
            )
        theirs = out[0, ids.shape[1] :].tolist()
        same = theirs == list(ours)
        equal.append(same)
        print(
            f"transformers vs sloserve on {item['task_id']} ({ids.shape[1]} prompt tokens, {len(theirs)} "
            f"generated): {'identical' if same else 'DIFFERENT'}",
            flush=True,
        )
    return equal


if __name__ == "__main__":
    main()
