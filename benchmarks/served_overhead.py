"""Where a served decode step's time goes outside the model: CPU per output token by role, arms side by side.

For each arm, round by round alternating, a fresh `sloserve serve` on one checkpoint (the peers'
358M byte-level Llama of Qwen2.5-0.5B's shape by default) takes the peers' workload (ARC prompts,
64 output tokens each, closed loop, one `sloserve bench --url` client) at each concurrency, and
the script reports:

  out tok/s, TPOT p50, TTFT p50     the client's view
  runner ms/step, wall ms/step      the engine's busy seconds / steps (its /metrics) against the
                                    run's wall time / steps: the gap is everything outside
                                    `runner.execute` (scheduling, outputs, IPC, idle between requests)
  CPU ms per output token           from /proc before and after, by role: the engine's main thread
                                    (the step loop, and a compute thread of the step itself), its
                                    other compute threads (the decode team, OpenMP), its ZeroMQ
                                    I/O thread, the front end's event loop, its other threads
                                    (gRPC pollers, ZeroMQ I/O)

and each arm's ratios to the first. On this 2-core machine every CPU-millisecond outside the
model is taken from the step's two compute threads. An arm is `NAME=SERVE FLAGS`; a flag of the
form `@module.ATTR=LITERAL` instead sets that module attribute in the server's processes (through
a sitecustomize on PYTHONPATH, so the spawned engine process gets it too):

    python -m benchmarks.served_overhead --arm bf16= --arm int8=--quantization int8 --concurrency 1 4
    python -m benchmarks.served_overhead --arm packed= \\
        --arm fused=@sloserve.executor.fused.BF16_DECODE=True --concurrency 1 4 16 --rounds 2 --json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks._output import write_json
from benchmarks.harness import free_port, machine
from benchmarks.peer_llamacpp import write_workload
from benchmarks.peers import PEER_DIR, Refused, _wait_healthy, process_tree, warm_up

ROOT = Path(__file__).resolve().parents[1]
SLOSERVE = Path(sys.executable).with_name("sloserve")
CHECKPOINT = PEER_DIR / "models" / "qwen05-bf16"
ROLES = ("engine_main", "engine_team", "engine_io", "frontend_loop", "frontend_other")
_METRIC = re.compile(r"^(sloserve_engine_(?:steps|busy_seconds)_total)(?:\{[^}]*\})? ([0-9.e+-]+)$")


@dataclass(slots=True)
class Arm:
    """One server configuration: its `sloserve serve` flags and module attributes to set."""

    name: str
    flags: list[str]
    attrs: dict[str, object] = field(default_factory=dict)


def parse_arm(text: str) -> Arm:
    """`NAME=FLAGS`, where a flag `@module.ATTR=LITERAL` sets a module attribute instead."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"an arm is NAME=FLAGS, got {text!r}")
    flags, attrs = [], {}
    for token in shlex.split(rest):
        if token.startswith("@"):
            target, eq, literal = token[1:].partition("=")
            if not eq or "." not in target:
                raise argparse.ArgumentTypeError(f"{token!r}: write @module.ATTR=LITERAL")
            attrs[target] = ast.literal_eval(literal)
        else:
            flags.append(token)
    return Arm(name, flags, attrs)


def _sitecustomize(attrs: dict[str, object], folder: Path) -> dict[str, str]:
    """Environment that sets `attrs` at start-up in every Python process of the server."""
    if not attrs:
        return {}
    lines = ["import importlib"]
    for target, value in attrs.items():
        module, attr = target.rsplit(".", 1)
        lines.append(f"setattr(importlib.import_module({module!r}), {attr!r}, {value!r})")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text("\n".join(lines) + "\n")
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": f"{folder}{os.pathsep}{path}" if path else str(folder)}


def thread_cpu(pids: list[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (thread name, user + system CPU seconds) of every thread of `pids`."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            out[(pid, int(tid))] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def engine_pid(pids: list[int]) -> int | None:
    """The engine process among the server's (multiprocessing's resource tracker is not it)."""
    for pid in pids[1:]:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in command and b"resource_tracker" not in command:
            return pid
    return None


def role(pid: int, tid: int, name: str, frontend: int, engine: int | None) -> str | None:
    """Which of ROLES a thread plays (None: neither the front end nor the engine process)."""
    if pid == frontend:
        return "frontend_loop" if tid == pid else "frontend_other"
    if pid != engine:
        return None
    if tid == pid:
        return "engine_main"
    return "engine_io" if name.startswith("ZMQ") else "engine_team"


def engine_counters(metrics_port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {m[1]: float(m[2]) for line in text.splitlines() if (m := _METRIC.match(line))}


def run_once(
    arm: Arm,
    model: Path,
    workload: Path,
    concurrency: int,
    requests: int,
    workdir: Path,
    common: list[str] = (),
) -> dict:
    """One fresh server of `arm` (after the flags every arm shares, `common`), one closed-loop
    bench run, the counters around it."""
    http_port, metrics_port = free_port(), free_port()
    command = [SLOSERVE, "serve", "--model", model, "--device", "cpu", "--port", str(free_port())]
    command += ["--http-port", str(http_port), "--metrics-port", str(metrics_port)]
    command += [*common, *arm.flags]
    env = {**os.environ, **_sitecustomize(arm.attrs, workdir / f"site-{arm.name}")}
    log = workdir / f"{arm.name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{http_port}"
    try:
        _wait_healthy(url, proc, log)
        warm_up(url)
        pids = process_tree(proc.pid)
        engine = engine_pid(pids)
        report = workdir / "bench.json"
        before, counters, began = thread_cpu(pids), engine_counters(metrics_port), time.monotonic()
        load = os.getloadavg()
        subprocess.run(
            [SLOSERVE, "bench", "--url", url, "--workload", f"jsonl:{workload}"]
            + ["--num-requests", str(requests), "--concurrency", str(concurrency)]
            + ["--ignore-eos", "--json", report],
            check=True,
            capture_output=True,
        )
        wall = time.monotonic() - began
        after, counters_after = thread_cpu(pids), engine_counters(metrics_port)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    run = json.loads(report.read_text())["runs"][0]
    tokens = run["output_tokens"]
    cpu = dict.fromkeys(ROLES, 0.0)
    for key, (name, seconds) in after.items():
        kind = role(*key, name, proc.pid, engine)
        if kind is not None:
            cpu[kind] += seconds - before.get(key, (name, 0.0))[1]
    steps = counters_after["sloserve_engine_steps_total"] - counters["sloserve_engine_steps_total"]
    busy = (
        counters_after["sloserve_engine_busy_seconds_total"]
        - counters["sloserve_engine_busy_seconds_total"]
    )
    return {
        "arm": arm.name,
        "concurrency": concurrency,
        "completed": run["completed"],
        "output_tok_s": run["output_token_throughput"],
        "tpot_p50_s": run["tpot_s"]["p50"],
        "ttft_p50_s": run["ttft_s"]["p50"],
        "steps": steps,
        "runner_ms_per_step": busy / steps * 1e3 if steps else None,
        "wall_ms_per_step": wall / steps * 1e3 if steps else None,
        "cpu_ms_per_token": {k: v / tokens * 1e3 for k, v in cpu.items()},
        "load_avg": [round(x, 2) for x in (*load, *os.getloadavg())],
    }


def _median(runs: list[dict], get) -> float | None:
    values = [v for v in map(get, runs) if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict], arms: list[Arm], concurrency: list[int]) -> list[dict]:
    """Per concurrency and arm: medians over rounds, and the ratio of each to the first arm."""
    rows = []
    for c in concurrency:
        base = None
        for arm in arms:
            mine = [r for r in runs if r["arm"] == arm.name and r["concurrency"] == c]
            if not mine:
                continue
            row = {"concurrency": c, "arm": arm.name, "rounds": len(mine)}
            for key in ("output_tok_s", "tpot_p50_s", "ttft_p50_s"):
                row[key] = _median(mine, lambda r, key=key: r[key])
            for key in ("runner_ms_per_step", "wall_ms_per_step"):
                row[key] = _median(mine, lambda r, key=key: r[key])
            row["cpu_ms_per_token"] = {
                k: _median(mine, lambda r, k=k: r["cpu_ms_per_token"][k]) for k in ROLES
            }
            row["load_avg"] = [r["load_avg"] for r in mine]
            base = base or row
            row["vs_first"] = {
                key: row[key] / base[key] if row[key] and base[key] else None
                for key in ("output_tok_s", "tpot_p50_s", "runner_ms_per_step", "wall_ms_per_step")
            }
            rows.append(row)
    return rows


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict]) -> None:
    print(
        f"{'c':>3} {'arm':>10} {'tok/s':>7} {'xfirst':>6} {'tpot ms':>7} {'runner':>7} "
        f"{'wall':>7} " + " ".join(f"{r:>14}" for r in ROLES) + "   (ms per step; CPU ms per token)"
    )
    for row in rows:
        cpu = row["cpu_ms_per_token"]
        print(
            f"{row['concurrency']:>3} {row['arm']:>10} {_f(row['output_tok_s'], '.1f'):>7} "
            f"{_f(row['vs_first']['output_tok_s'], '.3f'):>6} "
            f"{_f(row['tpot_p50_s'] and row['tpot_p50_s'] * 1e3, '.1f'):>7} "
            f"{_f(row['runner_ms_per_step'], '.1f'):>7} {_f(row['wall_ms_per_step'], '.1f'):>7} "
            + " ".join(f"{_f(cpu[r]):>14}" for r in ROLES)
            + f"   load {row['load_avg'][0][0]:.1f}"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=CHECKPOINT)
    p.add_argument(
        "--arm", type=parse_arm, action="append", help="NAME=FLAGS (default: one arm, 'default=')"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=1, help="fresh runs of each arm, alternating")
    p.add_argument("--requests", type=int, default=None, help="default: 6 x concurrency, 6..24")
    p.add_argument("--max-prompt-chars", type=int, default=950)
    p.add_argument(
        "--serve-args",
        default="--max-model-len 4096",
        help="`sloserve serve` flags of every arm (the default sizes the KV pool for the workload, "
        "not for the model's 16k context, which a busy machine's free memory may not hold)",
    )
    p.add_argument(
        "--json",
        type=Path,
        nargs="?",
        const=ROOT / "benchmarks" / "results" / "served_overhead.json",
        help="also write the runs and medians here (default path if given bare)",
    )
    args = p.parse_args(argv)
    arms = args.arm or [Arm("default", [])]
    if len({a.name for a in arms}) != len(arms):
        p.error("arm names must differ")
    if not (args.model / "config.json").is_file():
        p.error(f"{args.model} is not a checkpoint folder: run `python -m benchmarks.peers` once")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="served_overhead_") as tmp:
        workdir = Path(tmp)
        workload = workdir / "workload.jsonl"
        spec = write_workload(workload, 24, args.max_prompt_chars, 64, distinct=False)
        for c in args.concurrency:
            requests = args.requests or min(24, max(6, 6 * c))
            for r in range(args.rounds):
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    try:
                        run = run_once(
                            arm, args.model, workload, c, requests, workdir, args.serve_args.split()
                        )
                    except (Refused, subprocess.CalledProcessError) as exc:
                        print(f"c{c} {arm.name}: {exc}", flush=True)
                        continue
                    runs.append(run)
                    print(
                        f"c{c} round {r} {arm.name}: {run['output_tok_s']:.1f} tok/s, "
                        f"load {run['load_avg'][0]:.1f}",
                        flush=True,
                    )
    rows = summarize(runs, arms, args.concurrency)
    print_table(rows)
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "served_overhead",
                "model": str(args.model),
                "workload": spec,
                "arms": [{"name": a.name, "flags": a.flags, "attrs": a.attrs} for a in arms],
                "machine": machine(),
                "runs": runs,
                "summary": rows,
            },
        )


if __name__ == "__main__":
    main()
