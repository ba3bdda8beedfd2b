"""sloserve, vLLM's CPU build and llama.cpp serving one bf16 checkpoint side by side (issue 55).

The checkpoint: a random-weight byte-level Llama made by llama.cpp's peer `make_checkpoint.py`
and saved in bf16, of Qwen2.5-0.5B's shape (`--shape qwen05`: hidden 896, 24 layers, 14 heads,
2 KV heads, FFN 4864; 358M parameters) or `--shape small` (hidden 256, 4 layers) for a quick check;
made once under PEER_DIR/models, with its GGUFs: bf16 by llama.cpp's converter, q8_0 from that by
`llama-quantize`. The workload: the ARC trace's first `--requests` requests of at most
`--max-prompt-chars` characters (else the synthetic ARC workload), attempts and the prefixes shared
within a task included, exactly `--max-tokens` output tokens each, closed loop at each
`--concurrency`. Arms (`--arms`):

  sloserve        `sloserve serve` at its defaults (--dtype auto)
  sloserve-int8   the same with --quantization int8 (skipped, with the server's reason, where
                  this build refuses the flag)
  vllm            vLLM's CPU build (../shared/peer/vllm: setup.sh once, ~3 min), bf16
  llamacpp-bf16   llama-server (../shared/peer/llamacpp: build.sh once, ~10 min) on the bf16 GGUF
  llamacpp-q8_0   the same on the q8_0 GGUF
  sloserve-w4a16  `sloserve serve` on the checkpoint's W4A16 folder (issue 56): int4 weights in
                  groups of 128, asymmetric, lm_head unquantized, made once by llm-compressor
                  (`QuantizationModifier(scheme="W4A16")`) in the venv ../shared/quant/setup.sh
                  makes (QUANT_VENV); skipped where that venv is missing
  llamacpp-q4_0   llama-server on the q4_0 GGUF (`llama-quantize` from the bf16 one)

Every run starts its server fresh, sends it one short unrelated warm-up request, and drives it with
one client, `sloserve bench --url` (its OpenAI-compatible HTTP API) and --ignore-eos; one server at
a time, the arms' order rotating from run to run; the load average is recorded around each run and
the resident memory of the server's whole process tree once the load is done (the sum of VmRSS over
the tree, which counts a page shared by two processes twice, and of Pss, which splits it: PSS is
the figure to compare). llama-server does not stream a token that ends inside a UTF-8 character, so
a streaming client's first chunk comes late for a random byte-level model; as peer_llamacpp does,
its TTFT and TPOT are the server's own timings (its log's per-request prompt and generation times),
the client's streaming TTFT kept beside them. The machine's read bandwidth (best of several sums of
a 512 MiB tensor in torch, before and after the runs) over each arm's weight bytes read per decode
token (the checkpoint's parameters besides the embedding table at the arm's bytes per weight) is
its c1 ceiling; c1 decode tok/s (1 / TPOT p50) is reported as a fraction of it.

    python -m benchmarks.peers [--shape qwen05] [--arms ...] [--concurrency 1 4 16] [--rounds 1]

Prints sloserve's ratio to each peer per concurrency (output tok/s, TTFT p50) and writes the
runs to `--json` (benchmarks/results/peers.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks._output import write_json
from benchmarks.harness import free_port, machine
from benchmarks.peer_llamacpp import PEER_DIR, PEER_SCRIPTS, convert, make_checkpoint
from benchmarks.peer_llamacpp import write_workload as write_arc_workload

ROOT = Path(__file__).resolve().parents[1]
SLOSERVE = Path(sys.executable).with_name("sloserve")
VLLM_SCRIPTS = ROOT.parent / "shared" / "peer" / "vllm"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sloserve-peer"
VLLM_VENV = Path(os.environ.get("VLLM_VENV") or CACHE / "vllm" / "venv")
VLLM_DIR = Path(os.environ.get("VLLM_PEER_DIR") or CACHE / "vllm")
LLAMA_BIN = PEER_DIR / "build" / "bin"

# make_checkpoint.py's flags
SHAPES = {
    "qwen05": {"hidden": 896, "layers": 24, "heads": 14, "kv-heads": 2, "ffn": 4864},
    "small": {"hidden": 256, "layers": 4, "heads": 4, "kv-heads": 2, "ffn": 704},
}
# bytes a decode step reads per weight, by the dtype an arm computes in
BYTES_PER_WEIGHT = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "int8": 1.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    # int4 values and a bf16 scale and zero per group of 128
    "w4a16": 0.5 + 4 / 128,
}
QUANT_VENV = Path(
    os.environ.get("QUANT_VENV")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sloserve-quant" / "venv"
)


@dataclass(frozen=True, slots=True)
class Arm:
    """One server configuration: its kind, extra `sloserve serve` flags, or llama.cpp's GGUF type."""

    name: str
    kind: str
    flags: tuple[str, ...] = ()
    gguf: str = ""
    # llm-compressor's preset the checkpoint is quantized with first (sloserve arms)
    scheme: str = ""

    @property
    def peer(self) -> bool:
        return self.kind != "sloserve"


ARMS = {
    arm.name: arm
    for arm in (
        Arm("sloserve", "sloserve"),
        Arm("sloserve-int8", "sloserve", ("--quantization", "int8")),
        Arm("vllm", "vllm"),
        Arm("llamacpp-bf16", "llamacpp", gguf="bf16"),
        Arm("llamacpp-q8_0", "llamacpp", gguf="q8_0"),
        Arm("sloserve-w4a16", "sloserve", scheme="W4A16"),
        Arm("llamacpp-q4_0", "llamacpp", gguf="q4_0"),
    )
}


class Refused(Exception):
    """A server that did not come up or serve the load: the arm is skipped, and this says why."""


def checkpoint(shape: str) -> Path:
    """The random-weight byte-level Llama of `shape` in bf16 under PEER_DIR/models (made once)."""
    folder = PEER_DIR / "models" / f"{shape}-bf16"
    if (folder / "config.json").is_file():
        return folder
    f32 = make_checkpoint(folder.with_name(f"{shape}-f32.tmp"), SHAPES[shape])
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(f32, staging, ignore=shutil.ignore_patterns("*.safetensors"))
    to_bf16(f32, staging)
    shutil.rmtree(f32)
    staging.rename(folder)
    return folder


def to_bf16(src: Path, dst: Path) -> None:
    """src's safetensors rounded to bf16 into dst, and its config saying so."""
    import torch
    from safetensors.torch import load_file, save_file

    for shard in src.glob("*.safetensors"):
        tensors = {k: v.to(torch.bfloat16) for k, v in load_file(shard).items()}
        save_file(tensors, dst / shard.name, metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index = dst / "model.safetensors.index.json"
    if index.is_file():
        meta = json.loads(index.read_text())
        meta["metadata"]["total_size"] //= 2
        index.write_text(json.dumps(meta, indent=2) + "\n")


# llm-compressor's round-to-nearest of every Linear but lm_head, saved compressed (QUANT_VENV runs it)
_QUANTIZE = """
import shutil, sys, torch, transformers
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
src, out, scheme = sys.argv[1:]
model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
model.save_pretrained(out, save_compressed=True)
for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(f"{src}/{name}", f"{out}/{name}")
"""


def quantized(folder: Path, scheme: str) -> Path:
    """folder's checkpoint quantized by llm-compressor with `scheme` (made once beside it)."""
    out = folder.with_name(f"{folder.name}.{scheme.lower()}")
    if (out / "config.json").is_file():
        return out
    python = QUANT_VENV / "bin" / "python"
    if not python.is_file():
        raise Refused(
            f"llm-compressor's venv {QUANT_VENV} is missing: run ../shared/quant/setup.sh"
        )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([python, "-c", _QUANTIZE, folder, tmp, scheme], check=True, capture_output=True)
    tmp.rename(out)
    return out


def gguf(folder: Path, kind: str) -> Path:
    """folder's GGUF of weight type `kind`: bf16 by the converter, q8_0 by llama-quantize from it."""
    bf16 = folder.with_name(folder.name + ".bf16.gguf")
    if not bf16.is_file():
        tmp = bf16.with_suffix(".tmp")
        convert(folder, tmp, "bf16").rename(bf16)
    if kind == "bf16":
        return bf16
    out = folder.with_name(f"{folder.name}.{kind}.gguf")
    if not out.is_file():
        quantize = LLAMA_BIN / "llama-quantize"
        if not quantize.is_file():
            raise Refused(
                f"{quantize} is not built: run `cmake --build {PEER_DIR / 'build'} --target "
                "llama-quantize` (after the peer's build.sh)"
            )
        tmp = out.with_suffix(".tmp")
        subprocess.run([quantize, bf16, tmp, kind.upper()], check=True, capture_output=True)
        tmp.rename(out)
    return out


def weights_per_token(folder: Path) -> int:
    """Parameters a decode step reads: every tensor of the checkpoint but the embedding table."""
    total = 0
    for shard in folder.glob("*.safetensors"):
        with shard.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__" and not name.endswith("embed_tokens.weight"):
                total += _numel(info["shape"])
    return total


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_bandwidth(mib: int = 512, repeats: int = 7) -> dict:
    """The machine's read bandwidth: the best of `repeats` torch sums (and copies) of `mib` MiB."""
    import torch

    x = torch.ones((mib << 20) // 4)
    y = torch.empty_like(x)
    best_sum = best_copy = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best_sum = min(best_sum, time.perf_counter() - t)
        t = time.perf_counter()
        y.copy_(x)
        best_copy = min(best_copy, time.perf_counter() - t)
    size = x.numel() * 4
    return {
        "read_gb_s": size / best_sum / 1e9,
        "copy_gb_s": 2 * size / best_copy / 1e9,
        "mib": mib,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
    }


def process_tree(root: int) -> list[int]:
    """root and every process descended from it (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            text = stat.read_text()
            ppid = int(text[text.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def tree_memory(root: int) -> dict:
    """Resident memory of root's process tree: sums of VmRSS, VmHWM (each process's peak) and Pss."""
    sums = {"VmRSS": 0, "VmHWM": 0, "Pss": 0}
    pids = process_tree(root)
    for pid in pids:
        with contextlib.suppress(OSError):
            for path in (f"/proc/{pid}/status", f"/proc/{pid}/smaps_rollup"):
                for line in Path(path).read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key in sums:
                        sums[key] += int(value.split()[0]) * 1024
    return {
        "processes": len(pids),
        "rss_bytes": sums["VmRSS"],
        "pss_bytes": sums["Pss"],
        "hwm_sum_bytes": sums["VmHWM"],
    }


@dataclass(slots=True)
class Server:
    """A server that is up: where to send load, its root process, its log, what it computes in."""

    url: str
    pid: int
    log: Path
    dtype: str


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Refused(f"exited with {proc.returncode}: {_tail(log)}")
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        time.sleep(0.5)
    raise Refused(f"not healthy after {timeout_s:g} s: {_tail(log)}")


def _tail(log: Path, lines: int = 3) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return " | ".join(line.strip() for line in text[-lines:])


@contextlib.contextmanager
def serve(arm: Arm, folder: Path, workdir: Path, context: int) -> Iterator[Server]:
    """arm's server, started fresh on folder's checkpoint, stopped on exit; Refused if it does not start.

    context: the tokens a request needs (prompt and output): what a llama.cpp slot and vLLM hold."""
    if arm.kind == "sloserve":
        model = quantized(folder, arm.scheme) if arm.scheme else folder
        yield from _serve_sloserve(arm, model, workdir)
    elif arm.kind == "vllm":
        yield from _serve_peer(
            [VLLM_SCRIPTS / "serve.sh", folder],
            {
                "VLLM_VENV": str(VLLM_VENV),
                "PEER_DIR": str(VLLM_DIR),
                "MAX_MODEL_LEN": str(max(4096, context)),
            },
            VLLM_DIR / "vllm-server",
            "bfloat16",
        )
    else:
        # NOTE: llama.cpp's own defaults (f16 KV cache, flash attention), as a user runs it;
        # PARITY=1 (float32 KV) is for check_equal's log-probability match, not for speed.
        yield from _serve_peer(
            [PEER_SCRIPTS / "serve.sh", gguf(folder, arm.gguf)],
            {"PEER_DIR": str(PEER_DIR), "PARITY": "0", "CTX_PER_SLOT": str(max(2048, context))},
            PEER_DIR / "llama-server",
            arm.gguf,
        )


def _serve_sloserve(arm: Arm, folder: Path, workdir: Path) -> Iterator[Server]:
    http_port = free_port()
    log = workdir / f"{arm.name}-{time.monotonic_ns()}.log"
    command = [SLOSERVE, "serve", "--model", folder, "--device", "cpu"]
    command += ["--port", str(free_port()), "--http-port", str(http_port)]
    command += ["--metrics-port", "off", *arm.flags]
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http_port}"
    try:
        _wait_healthy(url, proc, log)
        chosen = re.search(r"dtype (\w+): ", log.read_text(errors="replace"))
        dtype = "int8" if "int8" in arm.flags else (chosen.group(1) if chosen else "unknown")
        dtype = arm.scheme.lower() or dtype
        yield Server(url, proc.pid, log, dtype)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _serve_peer(script: list, env: dict[str, str], stem: Path, dtype: str) -> Iterator[Server]:
    port = free_port()
    env = {**os.environ, **env, "PORT": str(port)}
    log = stem.with_name(stem.name + ".log")
    started = subprocess.run(["bash", *script], env=env, capture_output=True, text=True)
    try:
        if started.returncode != 0:
            raise Refused(f"{script[0].name} failed: {(started.stdout + started.stderr)[-300:]}")
        pid = int(stem.with_name(stem.name + ".pid").read_text())
        yield Server(f"http://127.0.0.1:{port}", pid, log, dtype)
    finally:
        subprocess.run(["bash", script[0], "stop"], env=env, check=False)


def unavailable(arm: Arm) -> str | None:
    """Why arm's server cannot start on this machine (not installed), else None."""
    if arm.kind == "vllm" and not (VLLM_VENV / "bin" / "vllm").is_file():
        return f"vLLM is not installed at {VLLM_VENV}: run `bash {VLLM_SCRIPTS / 'setup.sh'}` once"
    if arm.kind == "llamacpp" and not (LLAMA_BIN / "llama-server").is_file():
        return (
            f"llama-server is not built under {PEER_DIR}: run `bash {PEER_SCRIPTS / 'build.sh'}` "
            "once from the project's root"
        )
    return None


LLAMA_PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
LLAMA_EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


def llama_timings(log_text: str) -> dict:
    """llama-server's own per-request timings: TTFT (prompt time) and TPOT p50, in seconds."""
    prompt = [float(ms) / 1e3 for ms, _ in LLAMA_PROMPT.findall(log_text)]
    tpot = [float(ms) / 1e3 / (int(n) - 1) for ms, n in LLAMA_EVAL.findall(log_text) if int(n) > 1]
    return {
        "requests": len(prompt),
        "ttft_p50_s": statistics.median(prompt) if prompt else None,
        "tpot_p50_s": statistics.median(tpot) if tpot else None,
    }


def warm_up(url: str) -> None:
    """One short request unrelated to the workload, as peer_llamacpp's client sends: a server's
    first-request costs (llama.cpp sizes its buffers then) stay out of the measured run."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as reply:
        model = json.loads(reply.read())["data"][0]["id"]
    body = {"model": model, "prompt": "warm up\n", "max_tokens": 4, "temperature": 0.0}
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            reply.read()
    except OSError as exc:
        raise Refused(f"the warm-up request failed: {exc}") from exc


def bench(arm: Arm, folder: Path, workload: Path, concurrency: int, workdir: Path) -> dict:
    """One fresh server of arm, one closed-loop `sloserve bench --url` run, its memory after."""
    items = [json.loads(line) for line in workload.read_text().splitlines()]
    requests = len(items)
    # byte-level: a token per UTF-8 byte, <s>, and the output
    context = max(len(i["prompt"].encode()) + 1 + i["max_tokens"] for i in items)
    with serve(arm, folder, workdir, context) as server:
        warm_up(server.url)
        report = workdir / f"bench-{time.monotonic_ns()}.json"
        log_start = server.log.stat().st_size
        load_before = os.getloadavg()
        done = subprocess.run(
            [
                SLOSERVE,
                "bench",
                "--url",
                server.url,
                "--workload",
                f"jsonl:{workload}",
                "--num-requests",
                str(requests),
                "--concurrency",
                str(concurrency),
                "--ignore-eos",
                "--json",
                report,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if done.returncode != 0:
            raise Refused(f"sloserve bench failed: {done.stderr.strip()[-300:]}")
        load_after = os.getloadavg()
        memory = tree_memory(server.pid)
        with server.log.open("rb") as f:
            f.seek(log_start)
            new_log = f.read().decode(errors="replace")
    run = json.loads(report.read_text())["runs"][0]
    result = {
        "dtype": server.dtype,
        "completed": run["completed"],
        "requests": requests,
        "output_tokens": run.get("output_tokens_per_request"),
        "output_tok_s": run["output_token_throughput"],
        "ttft_p50_s": run["ttft_s"]["p50"],
        "ttft_p99_s": run["ttft_s"]["p99"],
        "tpot_p50_s": run["tpot_s"]["p50"],
        "e2e_p50_s": run["e2e_s"]["p50"],
        "memory": memory,
        "load_avg": [round(x, 2) for x in (*load_before, *load_after)],
    }
    if arm.kind == "llamacpp":
        own = llama_timings(new_log)
        result["ttft_stream_p50_s"] = result["ttft_p50_s"]
        result["tpot_stream_p50_s"] = result["tpot_p50_s"]
        result["ttft_p50_s"], result["tpot_p50_s"] = own["ttft_p50_s"], own["tpot_p50_s"]
        result["server_timed_requests"] = own["requests"]
    return result


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(
    runs: dict[int, dict[str, list[dict]]], bandwidth: dict, weights: int
) -> tuple[list[dict], dict[str, dict]]:
    """(sloserve's ratios to each peer per concurrency, each arm's c1 decode against its ceiling)."""
    ratios = []
    for c, arms in runs.items():
        ours = [a for a in arms if not ARMS[a].peer and arms[a]]
        theirs = [a for a in arms if ARMS[a].peer and arms[a]]
        for s in ours:
            for p in theirs:
                tok = (_median(arms[s], "output_tok_s"), _median(arms[p], "output_tok_s"))
                ttft = (_median(arms[s], "ttft_p50_s"), _median(arms[p], "ttft_p50_s"))
                ratios.append(
                    {
                        "concurrency": c,
                        "sloserve": s,
                        "peer": p,
                        "output_tok_s": tok,
                        "output_tok_s_ratio": _ratio(*tok),
                        "ttft_p50_s": ttft,
                        "ttft_p50_ratio": _ratio(*ttft),
                    }
                )
    ceilings = {}
    for arm, arm_runs in runs.get(1, {}).items():
        if not arm_runs:
            continue
        dtype = arm_runs[0]["dtype"]
        per_token = weights * BYTES_PER_WEIGHT.get(dtype, float("nan"))
        ceiling = bandwidth["read_gb_s"] * 1e9 / per_token
        tpot = _median(arm_runs, "tpot_p50_s")
        decode = 1.0 / tpot if tpot else None
        ceilings[arm] = {
            "dtype": dtype,
            "weight_bytes_per_token": per_token,
            "ceiling_tok_s": ceiling,
            "decode_tok_s": decode,
            "fraction_of_ceiling": decode / ceiling if decode else None,
        }
    return ratios, ceilings


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; an error names the flag to change."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="qwen05")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=1, help="fresh runs of each arm per concurrency")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-chars", type=int, default=950)
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "peers.json")
    args = p.parse_args(argv)
    for flag in ("rounds", "requests", "max_prompt_chars"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if min(args.concurrency) < 1:
        p.error(f"--concurrency must be >= 1 each, got {args.concurrency}")
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (TPOT needs two tokens)")
    return args


def main() -> None:
    args = parse_args()
    arms = [ARMS[name] for name in args.arms]
    skipped = {a.name: why for a in arms if (why := unavailable(a))}
    for name, why in skipped.items():
        print(f"skip {name}: {why}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} (measure on a quiet machine)", flush=True)
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth['read_gb_s']:.1f} GB/s (copy {bandwidth['copy_gb_s']:.1f})")
    folder = checkpoint(args.shape)
    weights = weights_per_token(folder)
    runs: dict[int, dict[str, list[dict]]] = {
        c: {a.name: [] for a in arms} for c in args.concurrency
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        workdir = Path(tmp)
        workload = workdir / "workload.jsonl"
        spec = write_arc_workload(
            workload, args.requests, args.max_prompt_chars, args.max_tokens, distinct=False
        )
        prompts = [json.loads(line)["prompt"] for line in workload.read_text().splitlines()]
        # byte-level tokenizer: one token per UTF-8 byte, and <s>
        mean_prompt = statistics.mean(len(q.encode()) + 1 for q in prompts)
        print(f"{spec}: {len(prompts)} requests, mean prompt {mean_prompt:.0f} tokens")
        turn = 0
        for r in range(args.rounds):
            for c in args.concurrency:
                # the first to run rotates from one concurrency (and round) to the next
                turn += 1
                for arm in arms[turn % len(arms) :] + arms[: turn % len(arms)]:
                    if arm.name in skipped:
                        continue
                    try:
                        result = bench(arm, folder, workload, c, workdir)
                    except Refused as why:
                        skipped[arm.name] = str(why)
                        print(f"skip {arm.name}: {why}", flush=True)
                        continue
                    runs[c][arm.name].append(result)
                    mem = result["memory"]["pss_bytes"] / 2**20
                    print(
                        f"round {r} c={c:<3} {arm.name:14s} {result['output_tok_s']:7.1f} tok/s  "
                        f"TTFT p50 {_fmt(result['ttft_p50_s'], '.3f')} s  "
                        f"TPOT p50 {_fmt(result['tpot_p50_s'], '.4f')} s  PSS {mem:.0f} MiB  "
                        f"load {result['load_avg'][0]}->{result['load_avg'][3]}",
                        flush=True,
                    )
    # NOTE: measured again after the runs, and the better kept: the ceiling is what the machine
    # can read, and a neighbour's load during one measurement only lowers it.
    bandwidth = max(bandwidth, read_bandwidth(), key=lambda b: b["read_gb_s"])
    print(f"read bandwidth, best before and after the runs: {bandwidth['read_gb_s']:.1f} GB/s")
    ratios, ceilings = summarize(runs, bandwidth, weights)
    print(
        f"\n({args.rounds} fresh run(s) per arm and concurrency, {time.monotonic() - started:.0f} s)"
    )
    for row in ratios:
        print(
            f"c={row['concurrency']:<3} {row['sloserve']:14s} / {row['peer']:14s} "
            f"output tok/s x{_fmt(row['output_tok_s_ratio'], '.2f')}   "
            f"TTFT p50 x{_fmt(row['ttft_p50_ratio'], '.2f')}"
        )
    for arm, row in ceilings.items():
        print(
            f"c1 {arm:14s} {row['dtype']:9s} decode {_fmt(row['decode_tok_s'], '.1f')} tok/s of a "
            f"{row['ceiling_tok_s']:.1f} ceiling ({row['weight_bytes_per_token'] / 1e6:.0f} MB/token): "
            f"{_fmt(row['fraction_of_ceiling'], '.0%')}"
        )
    write_json(
        args.json,
        {
            "benchmark": "peers",
            "model": {"shape": args.shape, **SHAPES[args.shape], "checkpoint_dtype": "bfloat16"},
            "weights_per_token": weights,
            "workload": {
                "spec": spec,
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "max_prompt_chars": args.max_prompt_chars,
                "mean_prompt_tokens": mean_prompt,
                "distinct_prompts": len(set(prompts)),
            },
            "rounds": args.rounds,
            "machine": machine(),
            "bandwidth": bandwidth,
            "skipped": skipped,
            "runs": {str(c): arms for c, arms in runs.items()},
            "ratios": ratios,
            "c1_ceiling": ceilings,
            "memory_note": "after the load, summed over the server's process tree: pss_bytes "
            "(shared pages split) is the figure to compare; rss_bytes counts shared pages twice. "
            "Each server's KV cache is in it as the server sizes it (vLLM: "
            f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE', '4')} GiB)",
        },
    )


if __name__ == "__main__":
    main()
