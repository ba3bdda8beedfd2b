"""Where TTFT goes in a burst: the scheduler alone on a simulated clock, arm by arm (issue 55).

The peers' c16 workload (the ARC trace's first 24 requests of at most 950 characters, attempts and
the prefixes shared within a task included, 64 output tokens, closed loop at 16) is fed to
`Scheduler` with no model: each step costs what a step-cost model says (overhead + per prompt
token + per decoding sequence; the defaults are the 358M's bf16 steps on this 2-core EPYC, ~1 ms a
prompt token), and the sampled token is a constant. So an arm's figures are its scheduling alone,
the same on a loaded machine as on a quiet one: TTFT p50/p99, output tok/s, prompt tokens computed
against the distinct ones the prompts hold, steps; `--trace` prints each step's chunks. It prices a
mixed step's decodes per sequence, not as the separate decode pass the runner makes beside a prompt
chunk: served, `shortest` cost output tok/s that the simulation does not show
(docs/design/deadline-steps.md), so `--served` decides.

    python -m benchmarks.prefill_order [--concurrency 16] [--requests 24] [--trace ARM]
    python -m benchmarks.prefill_order --served 3 [--json]

`--served ROUNDS` then serves the same workload for real, as `benchmarks.peers` does (its bf16
358M checkpoint, a fresh `sloserve serve --prefill-order ARM` per run, one warm-up request, one
`sloserve bench --url` closed loop), the arms alternating ABBA round by round so that a shared
machine's drift hits both alike; it prints each run with the load average around it and the
medians' ratios, and writes the runs to benchmarks/results/prefill_order.json with --json.

Arms: `arrival` (prefill in the slo plan's order with arrival breaking slack ties, each prompt's
chunk capped at prefill_chunk: every prompt of a burst advances together) against `shortest`
(opt-in: least remaining prefill first among equal slack, the step's prompt tokens on one
prompt until it is done).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

from sloserve.config import SloserveConfig
from sloserve.engine.priming import priming_shapes
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import StepResult
from sloserve.sched.scheduler import Scheduler

from benchmarks._output import write_json
from benchmarks.harness import arc_items, machine

RESULTS = Path(__file__).resolve().parent / "results" / "prefill_order.json"
SERVED_KEYS = ("ttft_p50_s", "ttft_p99_s", "output_tok_s", "tpot_p50_s")

ARMS = {
    "arrival": {"prefill_order": "arrival"},
    "shortest": {"prefill_order": "shortest"},
}


@dataclasses.dataclass(slots=True)
class StepCost:
    """Seconds a step takes: overhead + per prompt token + per decoding sequence + per prompt
    chunk (the per-sequence work of a prefill: its attention calls, its inputs)."""

    overhead_s: float
    per_token_s: float
    per_decode_s: float
    per_chunk_s: float = 0.0

    def __call__(self, prompt: int, decodes: int, steps: int, chunks: int = 0) -> float:
        if prompt == 0:
            return steps * (self.overhead_s + self.per_decode_s * decodes)
        return (
            self.overhead_s
            + self.per_token_s * prompt
            + self.per_decode_s * decodes
            + self.per_chunk_s * chunks
        )


def simulate(
    arm: dict,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    cost: StepCost,
    trace: bool = False,
) -> dict:
    """One closed-loop run of `prompts` through a fresh scheduler with `arm`'s settings."""
    config = SloserveConfig()
    config.scheduler = dataclasses.replace(config.scheduler, **arm)
    clock = [0.0]
    sched = Scheduler(
        config, num_blocks=4096, block_size=16, max_model_len=4096, clock=lambda: clock[0]
    )
    # priming, then every step, feeds the step-cost model as the engine does (engine/priming.py,
    # EngineCore.update): the deadline plan prices steps with it
    for seqs, each in priming_shapes(config.scheduler, 4096):
        prompt, decodes = (0, seqs) if each == 1 else (seqs * each, 0)
        sched.admission.on_compute(seqs * each, cost(prompt, decodes, 1), decodes=decodes)
    sent, open_ids, reqs = 0, set(), {}

    def send() -> None:
        nonlocal sent
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        new = NewRequest(request_id=str(sent), token_ids=prompts[sent], params=params)
        reqs[new.request_id] = sched.add_request(new)
        open_ids.add(new.request_id)
        sent += 1

    while sent < min(concurrency, len(prompts)):
        send()
    steps = 0
    while open_ids:
        out = sched.schedule()
        prompt, decodes = sched._step_load()
        chunks = sum(len(q.token_ids) > 1 for q in out.sequences)
        seconds = cost(prompt, decodes, out.num_steps, chunks)
        if trace:
            chunks = " ".join(
                f"{s.req_id}:{len(s.token_ids)}" for s in out.sequences if len(s.token_ids) > 1
            )
            print(f"  t={clock[0]:7.3f}s step {steps:3d} {decodes:2d} decoding, prompt {chunks}")
        clock[0] += seconds
        for _ in range(out.num_steps if out.sequences else 0):
            sched.admission.on_compute(out.num_tokens, seconds / out.num_steps, out.num_decodes)
        steps += 1
        tokens = [[7] * out.num_steps if s.sample else [] for s in out.sequences]
        sched.update(out, StepResult(tokens=tokens))
        for rid in [r for r in open_ids if reqs[r].is_finished]:
            open_ids.discard(rid)
            if sent < len(prompts):
                send()
    served = [r for r in reqs.values() if r.first_token_time is not None]
    ttft = sorted(r.first_token_time - r.arrival_time for r in served)
    counters = sched.counters.counters()
    return {
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "output_tok_s": sum(r.num_output_tokens for r in reqs.values()) / clock[0],
        "seconds": clock[0],
        "steps": steps,
        "prompt_tokens_computed": counters["computed_prompt_tokens_total"],
        # refused (the queue timeout) or cut short: left out of the TTFT figures
        "unserved": len(reqs) - len(served),
    }


def distinct_tokens(prompts: list[list[int]], block: int = 16) -> int:
    """Prompt tokens once per distinct full-block prefix (what a perfect prefix cache computes)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for p in prompts:
        for i in range(0, len(p), block):
            key = tuple(p[: i + block])
            if key not in seen or i + block > len(p):
                seen.add(key)
                total += min(block, len(p) - i)
    return total


def served(rounds: int, concurrency: int, args: argparse.Namespace) -> dict[str, list[dict]]:
    """`rounds` ABBA rounds of each arm's fresh server on the peers' checkpoint and workload."""
    import tempfile

    from benchmarks import peers

    folder = peers.checkpoint("qwen05")
    runs: dict[str, list[dict]] = {name: [] for name in args.arms}
    with tempfile.TemporaryDirectory(prefix="prefill-order-") as tmp:
        workdir = Path(tmp)
        workload = workdir / "workload.jsonl"
        peers.write_arc_workload(
            workload, args.requests, args.max_prompt_chars, args.max_tokens, distinct=False
        )
        for r in range(rounds):
            order = args.arms if r % 2 == 0 else args.arms[::-1]
            for name in order:
                arm = peers.Arm(f"sloserve-{name}", "sloserve", ("--prefill-order", name))
                run = peers.bench(arm, folder, workload, concurrency, workdir)
                runs[name].append(run)
                print(
                    f"  round {r} {name:>9}: TTFT p50 {run['ttft_p50_s']:.2f} s p99 "
                    f"{run['ttft_p99_s']:.2f} s, {run['output_tok_s']:.1f} out tok/s, TPOT p50 "
                    f"{run['tpot_p50_s'] * 1e3:.0f} ms, load {run['load_avg'][0]:.1f} before "
                    f"{run['load_avg'][3]:.1f} after",
                    flush=True,
                )
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-prompt-chars", type=int, default=950)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--per-token-ms", type=float, default=1.0)
    p.add_argument("--overhead-ms", type=float, default=20.0)
    p.add_argument("--per-decode-ms", type=float, default=2.0)
    p.add_argument("--per-chunk-ms", type=float, default=0.0, help="per prompt chunk in a step")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--trace", choices=list(ARMS), help="print this arm's steps")
    p.add_argument("--served", type=int, default=0, metavar="ROUNDS", help="then serve for real")
    p.add_argument(
        "--json", action="store_true", help="write benchmarks/results/prefill_order.json"
    )
    args = p.parse_args(argv)
    _, items = arc_items(args.requests, 0, args.max_prompt_chars, args.max_tokens)
    prompts = [list(item.prompt.encode()) for item in items]
    cost = StepCost(
        args.overhead_ms / 1e3,
        args.per_token_ms / 1e3,
        args.per_decode_ms / 1e3,
        args.per_chunk_ms / 1e3,
    )
    print(
        f"{len(prompts)} requests, mean prompt {statistics.mean(map(len, prompts)):.0f} tokens, "
        f"{distinct_tokens(prompts)} distinct prompt tokens, c{args.concurrency}, "
        f"{args.max_tokens} out; step = {args.overhead_ms:g} ms + {args.per_token_ms:g} ms a "
        f"prompt token + {args.per_decode_ms:g} ms a decoding sequence + {args.per_chunk_ms:g} ms "
        "a prompt chunk (simulated clock)"
    )
    runs = {}
    for name in args.arms:
        runs[name] = simulate(
            ARMS[name], prompts, args.concurrency, args.max_tokens, cost, args.trace == name
        )
        r = runs[name]
        print(
            f"{name:>9}: TTFT p50 {r['ttft_p50_s']:.2f} s p99 {r['ttft_p99_s']:.2f} s, "
            f"{r['output_tok_s']:.1f} out tok/s, {r['prompt_tokens_computed']} prompt tokens "
            f"computed, {r['steps']} steps"
            + (f", {r['unserved']} refused" if r["unserved"] else "")
        )
    if len(runs) == 2:
        (na, a), (nb, b) = runs.items()
        print(
            f"{nb} / {na}: TTFT p50 x{b['ttft_p50_s'] / a['ttft_p50_s']:.2f}, p99 "
            f"x{b['ttft_p99_s'] / a['ttft_p99_s']:.2f}, out tok/s "
            f"x{b['output_tok_s'] / a['output_tok_s']:.2f}"
        )
    report = {"benchmark": "prefill_order", "args": vars(args), "simulated": runs}
    if args.served:
        print(f"served, {args.served} rounds (load average {os.getloadavg()[0]:.1f} now):")
        report["served"] = live = served(args.served, args.concurrency, args)
        report["machine"] = machine()
        med = {
            name: {k: statistics.median(r[k] for r in rs) for k in SERVED_KEYS}
            for name, rs in live.items()
        }
        for name, m in med.items():
            print(
                f"{name:>9} median: TTFT p50 {m['ttft_p50_s']:.2f} s p99 {m['ttft_p99_s']:.2f} s, "
                f"{m['output_tok_s']:.1f} out tok/s, TPOT p50 {m['tpot_p50_s'] * 1e3:.0f} ms"
            )
        if len(med) == 2:
            (na, a), (nb, b) = med.items()
            print(
                f"{nb} / {na} (medians): "
                + ", ".join(f"{k} x{b[k] / a[k]:.2f}" for k in SERVED_KEYS)
            )
    if args.json:
        write_json(RESULTS, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
