"""sloserve vs llama.cpp's `llama-server` on one checkpoint, side by side: per-token cost (issue 14).

The workload of issue 14's table: a hidden-256 Llama (4 layers, 4 heads, 2 KV heads, FFN 704,
byte-level tokenizer, float32), 48 distinct ARC prompts of at most 1,500 characters, exactly
48 output tokens each (EOS ignored), closed loop at concurrency 1, 4 and 16. Both servers run
on the same CPUs, one at a time, each started fresh for every run (so neither keeps a prompt
cache from the run before); the two alternate, and the first to run switches every round.

    python -m benchmarks.peer_llamacpp [--rounds 2] [--concurrency 1 4 16]
        [--sloserve-args "" "--num-scheduler-steps 1"]

`--sloserve-args` runs one sloserve arm per string (extra `sloserve serve` flags; "" is its
defaults) beside the peer, all rotating through each round.

The peer must be built once (`../shared/peer/llamacpp/build.sh`, see its README; ~10 min). This
script makes the checkpoint with the peer's `make_checkpoint.py` and converts it to GGUF with its
`convert.py` (once, under PEER_DIR/models), proves the two serve the same model with its
`check_equal.py`, then drives llama-server with its `bench_client.py` and sloserve (started
with `sloserve serve` and its defaults, as a user would) with `sloserve bench`. Both clients
report the same fields; output tokens per second is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ServerProcess, arc_pool, free_port, machine, save

ROOT = Path(__file__).resolve().parents[1]
PEER_SCRIPTS = ROOT.parent / "shared" / "peer" / "llamacpp"
PEER_DIR = Path(
    os.environ.get("PEER_DIR")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    / "sloserve-peer"
    / "llamacpp"
)
SLOSERVE = Path(sys.executable).with_name("sloserve")


def make_checkpoint(folder: Path, shape: dict[str, int] | None = None) -> Path:
    """The peer's make_checkpoint.py: a random-weight byte-level Llama (float32) of `shape`
    (its flags without dashes: hidden, layers, heads, kv-heads, ffn; None: its defaults)."""
    flags = [f"--{k}={v}" for k, v in (shape or {}).items()]
    subprocess.run(
        [sys.executable, PEER_SCRIPTS / "make_checkpoint.py", folder, *flags], check=True
    )
    return folder


def convert(folder: Path, gguf: Path, outtype: str = "f32") -> Path:
    """The peer's convert.py (llama.cpp's own converter): the Hugging Face folder as GGUF."""
    subprocess.run(
        [
            PEER_DIR / "venv" / "bin" / "python",
            PEER_SCRIPTS / "convert.py",
            folder,
            gguf,
            "--llama-cpp",
            PEER_DIR / "llama.cpp",
            "--outtype",
            outtype,
        ],
        check=True,
    )
    return gguf


def ensure_checkpoint() -> tuple[Path, Path]:
    """The Hugging Face folder and its GGUF, made (and converted) when the folder is missing."""
    folder, gguf = PEER_DIR / "models" / "small", PEER_DIR / "models" / "small-f32.gguf"
    if not (folder / "config.json").is_file() or not gguf.is_file():
        convert(make_checkpoint(folder), gguf)
    return folder, gguf


def write_workload(
    path: Path, num_requests: int, max_chars: int, max_tokens: int, *, distinct: bool = True
) -> str:
    """num_requests ARC prompts of at most max_chars, each asking for exactly max_tokens.

    distinct: each prompt once. The trace lists two attempts per test input, and a repeated prompt
    is a prefix-cache hit for both servers, which would measure the caches instead of the
    per-token cost. Otherwise the trace's first num_requests requests as they come, attempts and
    the prefixes shared within a task included (the workload a prefix cache serves)."""
    spec, items = arc_pool(0, max_chars, max_tokens)
    prompts = [item.prompt for item in items]
    if distinct:
        prompts = list(dict.fromkeys(prompts))
    if len(prompts) < num_requests:
        raise SystemExit(
            f"{spec} has only {len(prompts)} {'distinct ' * distinct}prompts of at most "
            f"{max_chars} characters"
        )
    with path.open("w") as f:
        for prompt in prompts[:num_requests]:
            f.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
    return spec


class Peer:
    """llama-server through the peer's serve.sh (16 slots; float32 KV and no flash attention
    unless `env` says PARITY=0); `pid` and `log` once it is up."""

    def __init__(self, gguf: Path, env: dict[str, str] | None = None) -> None:
        self.gguf, self.port = gguf, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **(env or {}), "PORT": str(self.port), "PEER_DIR": str(PEER_DIR)}
        self.log = PEER_DIR / "llama-server.log"
        self.pid = 0

    def __enter__(self) -> Peer:
        subprocess.run(
            ["bash", PEER_SCRIPTS / "serve.sh", self.gguf],
            check=True,
            env=self.env,
            stdout=subprocess.DEVNULL,
        )
        self.pid = int((PEER_DIR / "llama-server.pid").read_text())
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["bash", PEER_SCRIPTS / "serve.sh", "stop"], check=False, env=self.env)


def bench_peer(gguf: Path, workload: Path, concurrency: int, max_tokens: int) -> dict:
    with Peer(gguf) as peer:
        out = subprocess.run(
            [
                PEER_DIR / "venv" / "bin" / "python",
                PEER_SCRIPTS / "bench_client.py",
                workload,
                "--url",
                peer.url,
                "--concurrency",
                str(concurrency),
                "--max-tokens",
                str(max_tokens),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    return json.loads(out.strip().splitlines()[-1])


def sloserve_server(folder: Path, extra: str = "") -> ServerProcess:
    """`sloserve serve` with its defaults, exactly as a user starts it (the CLI's OpenMP settings too)."""
    port = free_port()
    return ServerProcess(
        [
            "serve",
            "--model",
            str(folder),
            "--device",
            "cpu",
            "--port",
            str(port),
            "--metrics-port",
            "off",
            "--http-port",
            "off",
            *shlex.split(extra),
        ],
        command=(str(SLOSERVE),),
        port=port,
        label="sloserve",
        log_path=Path(tempfile.gettempdir()) / "peer_llamacpp_sloserve.log",
    )


def bench_sloserve(
    folder: Path, workload: Path, concurrency: int, max_tokens: int, extra: str = ""
) -> dict:
    with (
        sloserve_server(folder, extra) as server,
        tempfile.NamedTemporaryFile(suffix=".json") as report,
    ):
        server.wait_ready(300)
        subprocess.run(
            [
                SLOSERVE,
                "bench",
                "--server",
                server.target,
                "--workload",
                f"jsonl:{workload}",
                "--num-requests",
                str(len(workload.read_text().splitlines())),  # each line once
                "--concurrency",
                str(concurrency),
                "--max-tokens",
                str(max_tokens),
                "--ignore-eos",
                "--json",
                report.name,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(Path(report.name).read_text())["runs"][0]  # one unpaced run


def check_same_model(folder: Path, gguf: Path, workload: Path) -> str:
    """The peer's check_equal.py: identical token ids, greedy tokens and log-probabilities."""
    with Peer(gguf) as peer:
        done = subprocess.run(
            [
                PEER_DIR / "venv" / "bin" / "python",
                PEER_SCRIPTS / "check_equal.py",
                folder,
                "--url",
                peer.url,
                "--workload",
                workload,
            ],
            capture_output=True,
            text=True,
        )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    if done.returncode != 0:
        raise SystemExit(f"llama-server does not serve the same model: {summary}")
    return summary


def _p50(report: dict, key: str) -> float | None:
    value = report.get(key)
    return value.get("p50") if isinstance(value, dict) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side per concurrency")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-prompt-chars", type=int, default=1500)
    parser.add_argument(
        "--sloserve-args",
        nargs="+",
        default=[""],
        help='one sloserve arm per string of extra `sloserve serve` flags ("": its defaults)',
    )
    args = parser.parse_args()
    arms = {("sloserve " + a).strip(): a for a in args.sloserve_args}
    if not (PEER_DIR / "build" / "bin" / "llama-server").is_file():
        raise SystemExit(
            f"llama-server is not built under {PEER_DIR}: run `bash {PEER_SCRIPTS / 'build.sh'}` once "
            "(see its README), or set PEER_DIR"
        )
    print(f"load average {os.getloadavg()[0]:.2f} (measure on a quiet machine)")
    folder, gguf = ensure_checkpoint()
    workload = PEER_DIR / "peer_workload.jsonl"
    spec = write_workload(workload, args.requests, args.max_prompt_chars, args.max_tokens)
    same = check_same_model(folder, gguf, workload)
    print(f"same model: {same}")
    runs: dict[int, dict[str, list[dict]]] = {}
    started = time.monotonic()
    names = [*arms, "llama-server"]
    for c in args.concurrency:
        sides: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(args.rounds):
            # the first to run rotates
            for side in names[r % len(names) :] + names[: r % len(names)]:
                if side == "llama-server":
                    report = bench_peer(gguf, workload, c, args.max_tokens)
                else:
                    report = bench_sloserve(folder, workload, c, args.max_tokens, arms[side])
                sides[side].append(report)
                print(
                    f"  c={c:<3} round {r} {side:<12} {report['output_token_throughput']:7.0f} output tok/s, "
                    f"TTFT p50 {(_p50(report, 'ttft_s') or 0) * 1e3:6.1f} ms",
                    flush=True,
                )
        runs[c] = sides
    print(f"\n(median of {args.rounds} fresh runs each; {time.monotonic() - started:.0f} s)")
    rows = []
    for c, sides in runs.items():
        theirs = statistics.median(r["output_token_throughput"] for r in sides["llama-server"])
        for arm in arms:
            ours = statistics.median(r["output_token_throughput"] for r in sides[arm])
            rows.append(
                {
                    "concurrency": c,
                    "arm": arm,
                    "sloserve_tok_s": ours,
                    "llama_server_tok_s": theirs,
                    "ratio": ours / theirs,
                    "sloserve_ttft_p50_s": statistics.median(
                        _p50(r, "ttft_s") or 0 for r in sides[arm]
                    ),
                    "llama_server_ttft_p50_s": statistics.median(
                        _p50(r, "ttft_s") or 0 for r in sides["llama-server"]
                    ),
                }
            )
            print(
                f"c={c:<3} {arm:<40} {ours:>7.0f} tok/s   llama-server {theirs:>7.0f}   x{ours / theirs:.2f}"
            )
    path = save(
        "peer_llamacpp",
        {
            "benchmark": "peer_llamacpp",
            "workload": spec,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "max_prompt_chars": args.max_prompt_chars,
            "same_model": same,
            "machine": machine(),
            "load_average": os.getloadavg(),
            "rows": rows,
            "runs": {str(c): s for c, s in runs.items()},
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
