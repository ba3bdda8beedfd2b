"""sloserve against what a user would otherwise run: Hugging Face transformers on the same checkpoint.

Same model folder, same ARC requests (token ids from the checkpoint's tokenizer), every request
generating exactly its max_tokens (EOS ignored) greedily, all requests submitted at t=0:

  hf-sequential   model.generate on one request at a time
  hf-static       model.generate on padded batches of --batch-size (left padding)
  hf-continuous   transformers' continuous batching manager (the engine of generate_batch),
                  per-request max_new_tokens, token timestamps recorded
  sloserve        the full server in a subprocess, over gRPC (`sloserve bench` client)

Output tokens/s counts only the tokens each request asked for (padding and overshoot in static
batches do not count). Goal: sloserve >= 2x the best transformers mode.

    python -m benchmarks.peer_hf               # ~5 min on a 2-core CPU with the default model
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
from sloserve.bench.client import LoadSpec
from sloserve.bench.stats import summarise, summary

from benchmarks import harness

GOAL = 2.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument(
        "--workload", default=None, help="default: the ARC trace if present, else synthetic-arc"
    )
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-prompt-chars", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=12, help="tokens each request generates (cap)")
    p.add_argument("--batch-size", type=int, default=4, help="hf-static batch size")
    p.add_argument(
        "--sequential-requests",
        type=int,
        default=None,
        help="requests for hf-sequential (default: all); its tokens/s is per-request work",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--streams", type=int, default=4)
    return p.parse_args(argv)


def load_hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def figures(
    name: str, tokens: int, wall_s: float, e2e: list[float], ttft: list[float] | None
) -> dict:
    return {
        "mode": name,
        "requests": len(e2e),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_token_throughput": tokens / wall_s,
        "request_throughput": len(e2e) / wall_s,
        "e2e_s": summary(e2e),
        "ttft_s": summary(ttft or []),
    }


@torch.no_grad()
def hf_sequential(model, prompts: list[list[int]], lengths: list[int], pad: int) -> dict:
    start, e2e = time.perf_counter(), []
    for ids, n in zip(prompts, lengths, strict=True):
        x = torch.tensor([ids])
        model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=pad,
        )
        e2e.append(time.perf_counter() - start)
    return figures("hf-sequential", sum(lengths), time.perf_counter() - start, e2e, None)


@torch.no_grad()
def hf_static(model, prompts: list[list[int]], lengths: list[int], pad: int, batch: int) -> dict:
    start, e2e = time.perf_counter(), []
    for k in range(0, len(prompts), batch):
        group, ns = prompts[k : k + batch], lengths[k : k + batch]
        width = max(len(p) for p in group)
        x = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        model.generate(
            x,
            attention_mask=mask,
            max_new_tokens=max(ns),
            min_new_tokens=max(ns),
            do_sample=False,
            pad_token_id=pad,
        )
        e2e += [time.perf_counter() - start] * len(group)
    return figures(
        f"hf-static (batch {batch})", sum(lengths), time.perf_counter() - start, e2e, None
    )


@torch.no_grad()
def hf_continuous(model, prompts: list[list[int]], lengths: list[int], pad: int) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max(lengths), do_sample=False, eos_token_id=-1, pad_token_id=pad
    )
    longest = max(len(p) for p in prompts) + max(lengths)
    cb = ContinuousBatchingConfig(
        page_size=16, num_blocks=max(64, len(prompts) * (longest // 16 + 2)), max_batch_tokens=512
    )
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb, warmup=False
    ) as manager:
        start = time.perf_counter()
        for i, (ids, n) in enumerate(zip(prompts, lengths, strict=True)):
            manager.add_request(ids, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True)
        done = {}
        while len(done) < len(prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
        wall = time.perf_counter() - start
    bad = [r.error for r in done.values() if r.error]
    if bad:
        raise RuntimeError(f"transformers continuous batching failed: {bad[0]}")
    tokens = sum(len(r.generated_tokens) for r in done.values())
    return figures(
        "hf-continuous",
        tokens,
        wall,
        [r.lifespan[1] - start for r in done.values()],
        [r.timestamps[0] - start for r in done.values() if r.timestamps],
    )


def sloserve_run(model: str, items: list, streams: int, seed: int) -> tuple[dict, dict]:
    with harness.launch("full", model, harness.LOGS / "peer_hf_server.log") as server:
        info = server.wait_ready(600)
        harness.run(harness.send(server.target, items[:2], LoadSpec(ignore_eos=True)))  # warm up
        result = harness.run(
            harness.send(
                server.target, items, LoadSpec(streams=streams, seed=seed, ignore_eos=True)
            )
        )
    run = summarise(result.records, result.duration_s, None, None)
    if run["completed"] != len(items):
        raise SystemExit(f"sloserve completed {run['completed']}/{len(items)}: {run['refusals']}")
    out = figures(
        "sloserve (gRPC)",
        run["output_tokens"],
        result.duration_s,
        [r.e2e for r in result.records],
        [r.ttft for r in result.records],
    )
    out["prefix_hit_tokens"] = run["prefix_hit_tokens"]
    return out, info


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from sloserve.models.loader import resolve_model_path
    from sloserve.tokenizer import Tokenizer

    folder = resolve_model_path(args.model)
    spec, items = harness.arc_items(
        args.num_requests, args.seed, args.max_prompt_chars, args.max_tokens, args.workload
    )
    tokenizer = Tokenizer.from_pretrained(folder)
    prompts = [tokenizer.encode(i.prompt) for i in items]
    lengths = [i.max_tokens for i in items]
    print(
        f"model {folder}; workload {spec}: {len(items)} requests, prompt tokens median "
        f"{int(np.median([len(p) for p in prompts]))}, {sum(lengths)} output tokens; "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    model = load_hf(folder)
    pad = next(
        (
            t
            for t in (model.config.pad_token_id, model.config.eos_token_id, 0)
            if isinstance(t, int)
        ),
        0,
    )
    n_seq = args.sequential_requests or len(prompts)
    print("running hf-sequential ...", flush=True)
    rows = [hf_sequential(model, prompts[:n_seq], lengths[:n_seq], pad)]
    print("running hf-static ...", flush=True)
    rows.append(hf_static(model, prompts, lengths, pad, args.batch_size))
    print("running hf-continuous ...", flush=True)
    rows.append(hf_continuous(model, prompts, lengths, pad))
    del model  # free its memory before the server starts
    print("running sloserve ...", flush=True)
    row, info = sloserve_run(args.model, items, args.streams, args.seed)
    rows.append(row)
    best_hf = max(rows[:-1], key=lambda r: r["output_token_throughput"])
    ratio = row["output_token_throughput"] / best_hf["output_token_throughput"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1000 * v:.0f}"

    header = (
        "mode",
        "requests",
        "out tok/s",
        "vs best HF",
        "e2e p50 ms",
        "e2e p90 ms",
        "e2e p99 ms",
        "TTFT p50 ms",
        "TTFT p99 ms",
    )
    table = [header] + [
        (
            r["mode"],
            str(r["requests"]),
            f"{r['output_token_throughput']:.1f}",
            f"x{r['output_token_throughput'] / best_hf['output_token_throughput']:.2f}",
            ms(r["e2e_s"]["p50"]),
            ms(r["e2e_s"]["p90"]),
            ms(r["e2e_s"]["p99"]),
            ms(r["ttft_s"]["p50"]),
            ms(r["ttft_s"]["p99"]),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    print()
    for line in table:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(line, widths, strict=True))
            )
        )
    verdict = "meets" if ratio >= GOAL else "misses"
    print(
        f"\nsloserve / best transformers mode ({best_hf['mode']}): x{ratio:.2f} — {verdict} the x{GOAL:g} goal"
    )
    path = harness.save(
        "peer_hf",
        {
            "machine": harness.machine(),
            "model": str(folder),
            "server_info": info,
            "workload": spec,
            "args": vars(args),
            "rows": rows,
            "best_hf": best_hf["mode"],
            "ratio_vs_best_hf": ratio,
            "goal": GOAL,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
