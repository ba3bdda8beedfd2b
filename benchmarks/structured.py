"""Structured output: schema-valid rate, decode step time with and without the grammar mask, ARC grid grammar.

Three parts, each optional (--parts):

- valid: N sampled answers under a JSON schema (response_format json_schema's path: the grammar's
  token mask in the sampler); the share that parse and validate, and that end in EOS.
- step: `ModelRunner.execute` of one decode step of B sequences (each on pages of its own at
  --context), greedy, without a grammar and with one per sequence (a JSON schema; fresh matchers
  each round, so they are mid-document), in alternating rounds; the best round of each counts.
  Two masked arms: the mask filled in a worker thread while the forward runs (served on a GPU),
  and inline before the forward (served on a CPU, whose cores the forward already uses); each is
  applied before sampling. The goal (issue 42): masked <= 1.1x plain at batch 16.
- arc: the built-in ARC model, greedy, on the ARC-AGI-2 training tasks held out from its training
  (tools/train_default.py's split): the share of well-formed grids ending in EOS with and without
  the ARC grid grammar.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.structured                      # all parts, default sizes
    python -m benchmarks.structured --parts step --batches 1 16 --steps 30 --rounds 5 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
from sloserve.executor import ModelRunner
from sloserve.llm import LLM
from sloserve.models.default import BUILTIN_MODELS, ensure_default_model
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput
from sloserve.structured import arc_grid_grammar, grammar_for

from benchmarks._output import OUT, write_json

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "colour", "tags", "ok"],
    "additionalProperties": False,
}
# step part: strings without a bound keep every matcher mid-document for the whole round
STEP_SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["notes"],
}


def valid_rate(model: str, device: str, n: int, temperature: float, max_tokens: int) -> dict:
    """Share of N sampled answers under SCHEMA that parse, validate, and end in EOS."""
    import jsonschema

    grammar = grammar_for("json_schema", SCHEMA)
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, grammar=grammar)
        for i in range(n)
    ]
    with LLM(model, device=device) as llm:
        outs = llm.generate([f"Describe thing {i} as JSON:\n" for i in range(n)], params)
    valid = eos = 0
    for out in outs:
        eos += out.finish_reason == "stop"
        try:
            jsonschema.validate(json.loads(out.text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {
        "answers": n,
        "valid_rate": valid / n,
        "eos_rate": eos / n,
        "temperature": temperature,
        "max_tokens": max_tokens,
    }


def make_runner(model: str, device: str, batch: int, context: int) -> ModelRunner:
    path = str(ensure_default_model(model)) if model in BUILTIN_MODELS else model
    longest = context + 64
    config = SloserveConfig(
        model=ModelConfig(path=path, device=device, max_model_len=longest),
        cache=CacheConfig(kv_pool_bytes=(batch + 1) * longest * 16 * 2**10, swap_bytes=0),
        scheduler=SchedulerConfig(max_batch=batch, max_batched_tokens=max(256, batch)),
    )
    runner = ModelRunner(config)
    runner.warmup()
    return runner


def decode_step(
    runner: ModelRunner, batch: int, context: int, grammar: str | None, tag: str
) -> SchedulerOutput:
    pages = -(-(context + 1) // runner.block_size)
    params = SamplingParams(max_tokens=1 << 20, grammar=grammar)
    return SchedulerOutput(
        [
            ScheduledSequence(
                f"{tag}{i}",
                [ord("{")],
                context,
                list(range(1 + i * pages, 1 + (i + 1) * pages)),
                True,
                params,
            )
            for i in range(batch)
        ]
    )


def seconds_per_step(runner: ModelRunner, out: SchedulerOutput, steps: int) -> float:
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        runner.execute(out)
    sync()
    return (time.perf_counter() - started) / steps


def step_ratio(
    model: str, device: str, batches: list[int], context: int, steps: int, rounds: int
) -> list[dict]:
    """Decode step time with a grammar per sequence over without, per batch: the mask filled in a worker
    thread during the forward (as served) and, for comparison, inline before it."""
    grammar = grammar_for("json_schema", STEP_SCHEMA)
    runner = make_runner(model, device, max(batches), context)
    served = runner.grammar.overlap  # the device's default: overlapped on a GPU, inline on a CPU
    rows = []
    for batch in batches:
        plain = decode_step(runner, batch, context, None, "plain")
        best = {"plain": float("inf"), "overlapped": float("inf"), "inline": float("inf")}
        arms = ["plain", "overlapped", "inline"]
        for r in range(rounds):
            for arm in arms[r % 3 :] + arms[: r % 3]:  # each arm leads in turn
                if arm == "plain":
                    best["plain"] = min(best["plain"], seconds_per_step(runner, plain, steps))
                    continue
                runner.grammar.overlap = arm == "overlapped"
                masked = decode_step(runner, batch, context, grammar, f"{arm}{r}b{batch}-")
                # the matchers are made outside the timing (the compile is cached)
                runner.execute(masked)
                best[arm] = min(best[arm], seconds_per_step(runner, masked, steps))
                runner.grammar.drop([s.req_id for s in masked.sequences])
        runner.grammar.overlap = served
        row = {
            "batch": batch,
            **{f"{arm}_ms": round(t * 1e3, 3) for arm, t in best.items()},
            "masked_over_plain": round(best["overlapped"] / best["plain"], 3),
            "inline_over_plain": round(best["inline"] / best["plain"], 3),
        }
        rows.append(row)
        print(
            f"  batch {batch:>3}: {best['plain'] * 1e3:8.2f} ms plain, {best['overlapped'] * 1e3:8.2f} ms masked "
            f"(x{row['masked_over_plain']:.3f}), {best['inline'] * 1e3:8.2f} ms with the mask inline "
            f"(x{row['inline_over_plain']:.3f})",
            flush=True,
        )
    return rows


def heldout_arc(data: Path, prompt_budget: int, limit: int | None) -> list[dict]:
    """The held-out ARC test inputs as prompts (tools/eval_default.py's format and budget)."""
    from tools.train_default import grid_text, split_tasks

    _, held = split_tasks(data)
    items = []
    for task_id, task in held:
        pairs = [
            "Input:\n" + grid_text(p["input"]) + "Output:\n" + grid_text(p["output"]) + "\n"
            for p in task["train"]
        ]
        for test in task["test"]:
            query = "Input:\n" + grid_text(test["input"]) + "Output:\n"
            shots = list(pairs)
            while shots and 1 + len("".join(shots).encode()) + len(query) > prompt_budget:
                shots.pop(0)
            items.append({"task_id": task_id, "prompt": "".join(shots) + query})
    return items[:limit]


def arc_rates(device: str, data: Path, limit: int | None, max_tokens: int) -> dict:
    """Well-formed grids ending in EOS, greedy, without and with the ARC grid grammar."""
    from sloserve.bench.arc import parse_grid_text

    items = heldout_arc(data, 1024, limit)
    prompts = [i["prompt"] for i in items]
    result = {
        "prompts": len(items),
        "tasks": len({i["task_id"] for i in items}),
        "max_tokens": max_tokens,
    }
    with LLM("default", device=device, max_model_len=2048) as llm:
        for arm, grammar in (("free", None), ("grammar", arc_grid_grammar())):
            outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, grammar=grammar))
            good = sum(
                o.finish_reason == "stop" and parse_grid_text(o.text) is not None for o in outs
            )
            result[f"{arm}_well_formed_eos_rate"] = good / len(outs)
            print(f"  {arm:>7}: {good}/{len(outs)} well-formed grids ending in EOS", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts", nargs="+", default=["valid", "step", "arc"], choices=["valid", "step", "arc"]
    )
    parser.add_argument("--model", default="default", help="checkpoint of the valid and step parts")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--answers", type=int, default=64, help="valid: sampled answers")
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="valid: sampling temperature"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="valid: tokens per answer, at most"
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="step: batch sizes")
    parser.add_argument(
        "--context", type=int, default=256, help="step: tokens before the step, every sequence"
    )
    parser.add_argument("--steps", type=int, default=30, help="step: steps per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="step: rounds per arm")
    parser.add_argument(
        "--arc-data", type=Path, default=Path("/work/shared/data/arc-agi-2/training")
    )
    parser.add_argument(
        "--arc-limit", type=int, default=None, help="arc: only the first N held-out prompts"
    )
    parser.add_argument(
        "--arc-max-tokens", type=int, default=960, help="arc: a 30x30 grid and EOS are 931"
    )
    parser.add_argument("--out", type=Path, default=OUT / "structured.json")
    args = parser.parse_args()
    report: dict = {"device": args.device, "model": args.model, "load": os.getloadavg()[0]}
    if "valid" in args.parts:
        print("schema-valid rate:")
        report["valid"] = valid_rate(
            args.model, args.device, args.answers, args.temperature, args.max_tokens
        )
        print(f"  {report['valid']}", flush=True)
    if "step" in args.parts:
        print(f"decode step with and without the mask (context {args.context}):")
        report["step"] = step_ratio(
            args.model, args.device, args.batches, args.context, args.steps, args.rounds
        )
    if "arc" in args.parts:
        print("ARC grid grammar on the held-out training tasks:")
        report["arc"] = arc_rates(args.device, args.arc_data, args.arc_limit, args.arc_max_tokens)
    write_json(args.out, report, indent=1)


if __name__ == "__main__":
    main()
