"""A Llama-2-7B-shape random-weight checkpoint served on this machine: peak memory and c1 decode tok/s.

Builds (once, under benchmarks/out/checkpoints/) a random-weight Llama of Llama-2-7B's shape
(hidden 4096, 32 layers, 32 heads, intermediate 11008, vocab 32000; bf16 on disk, ~12.6 GiB),
writing it shard by shard so the whole model is never in memory, with the byte-level
tokenizer. Then per arm a fresh `sloserve serve` at the default dtype plus the arm's flags, its
whole process tree's RSS sampled from /proc from launch to stop, and one short closed loop at
concurrency 1 (`sloserve bench --url ... --ignore-eos`, `--requests` x `--max-tokens` tokens).
An arm whose flags the server refuses (an option this build lacks, an instruction set this CPU
lacks) is recorded as skipped with the server's last log line as the reason.

    python -m benchmarks.big_model [--shape 7b|small] [--layers N]
        [--arm NAME=FLAGS ...]  (default: bf16= and int8=--quantization int8)

`--shape small` (~1B parameters, ~1.9 GiB) checks the script end to end; the 7B shape needs a
quiet machine with ~16 GiB free and ~13 GiB of disk. Never run in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks._output import OUT, write_json

SHAPES = {
    "7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    ),
    "small": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
    ),
}
ARMS = {"bf16": "", "int8": "--quantization int8"}
RESULTS = Path(__file__).resolve().parent / "results"
SHARD_BYTES = 2 * 2**30
GIB = 2**30


def config(shape: dict) -> dict:
    """The config.json of a Llama of `shape`, saved in bf16, byte-level special tokens."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
        "bos_token_id": 256,
        "eos_token_id": 257,
        "pad_token_id": 258,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    }


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor in Hugging Face naming, in the order they are written."""
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def write_checkpoint(folder: Path, cfg: dict, shard_bytes: int = SHARD_BYTES, seed: int = 0) -> int:
    """Write a random bf16 checkpoint of `cfg` into `folder`, one shard in memory at a time; its bytes."""
    import torch
    from safetensors.torch import save_file
    from sloserve.models.default import write_tokenizer_files

    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    held = total = 0

    def flush() -> None:
        nonlocal held
        save_file(pending, str(folder / f"part-{len(written)}"), metadata={"format": "pt"})
        written.append(list(pending))
        pending.clear()
        held = 0

    for name, shape in tensor_shapes(cfg):
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
        nbytes = t.numel() * t.element_size()
        if pending and held + nbytes > shard_bytes:
            flush()
        pending[name] = t
        held += nbytes
        total += nbytes
    flush()
    weight_map: dict[str, str] = {}
    for i, names in enumerate(written):
        file = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        (folder / f"part-{i}").rename(folder / file)
        weight_map |= dict.fromkeys(names, file)
    index = {
        "metadata": {"total_size": total},
        "weight_map": weight_map,
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer_files(folder, cfg)
    return total


def checkpoint(shape: dict, cache: Path) -> Path:
    """The random checkpoint of `shape`, built once under `cache` (atomically: a staging folder renamed)."""
    cfg = config(shape)
    digest = hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:8]
    folder = cache / f"llama-bf16-{digest}"
    if (folder / "config.json").is_file():
        return folder
    staging = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    started = time.monotonic()
    nbytes = write_checkpoint(staging, cfg)
    staging.rename(folder)
    print(f"wrote {folder} ({nbytes / GIB:.2f} GiB) in {time.monotonic() - started:.0f}s")
    return folder


def checkpoint_bytes(folder: Path) -> int:
    """Bytes of the folder's safetensors files."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


class TreeRss:
    """Samples the summed VmRSS of a process and all its descendants every `every_s`; keeps the peak."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        from sloserve.testing.procfs import process_tree, vm_bytes

        self._tree, self._vm = process_tree, vm_bytes
        self.pid, self.every_s = pid, every_s
        self.peak = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> int:
        return sum(self._vm(p, "VmRSS:") or 0 for p in self._tree(self.pid))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            self.samples += 1
            self._stop.wait(self.every_s)

    def by_process(self) -> dict[str, float]:
        """GiB resident now per process of the tree, keyed `pid command`."""
        out = {}
        for pid in self._tree(self.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            command = " ".join(a.decode(errors="replace") for a in argv if a)
            out[f"{pid} {command[:80]}"] = round((self._vm(pid, "VmRSS:") or 0) / GIB, 3)
        return out

    def hwm_sum(self) -> int:
        """The sum of each live process's own VmHWM: an upper bound on the tree's peak at one moment."""
        return sum(self._vm(p, "VmHWM:") or 0 for p in self._tree(self.pid))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def sloserve_bin() -> list[str]:
    """`sloserve` run by this interpreter."""
    return [sys.executable, "-m", "sloserve.cli.main"]


def run_arm(name: str, flags: list[str], folder: Path, args, workdir: Path) -> dict:
    """One fresh server with `flags`: peak tree RSS through load and the c1 run, and its tok/s."""
    from sloserve.bench.local_server import LocalServer, free_port

    from benchmarks.harness import engine_info

    grpc_port, http_port = free_port(), free_port()
    serve = [
        *sloserve_bin(),
        "serve",
        "--model",
        str(folder),
        "--host",
        "127.0.0.1",
        "--port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--metrics-port",
        "off",
        "--grace",
        "1",
        *shlex.split(args.common_flags),
        *flags,
    ]
    log_path = workdir / f"serve_{name}.log"
    started = time.monotonic()
    server = LocalServer(serve, grpc_port, log_path, label=f"{name} server")
    rss = TreeRss(server.proc.pid)
    result: dict = {"flags": flags, "log": str(log_path)}
    try:
        try:
            server.wait_ready(args.ready_timeout)
        except RuntimeError:
            lines = [x for x in log_path.read_text().splitlines() if x.strip()]
            result["skipped"] = lines[-1] if lines else f"exit {server.proc.returncode}"
            return result
        result["ready_s"] = round(time.monotonic() - started, 1)
        result["rss_after_load_gib"] = round(rss.now() / GIB, 3)
        result["peak_rss_load_gib"] = round(rss.peak / GIB, 3)
        result["rss_by_process_gib"] = rss.by_process()
        full = asyncio.run(engine_info(server.target))
        result["info"] = {
            k: full.get(k) for k in ("dtype", "dtype_reason", "weight_resident_bytes")
        }
        report = workdir / f"bench_{name}.json"
        bench = [
            *sloserve_bin(),
            "bench",
            "--url",
            f"http://127.0.0.1:{http_port}",
            "--workload",
            f"fixed:{args.prompt_tokens},{args.max_tokens}",
            "--num-requests",
            str(args.requests),
            "--concurrency",
            "1",
            "--ignore-eos",
            "--json",
            str(report),
        ]
        subprocess.run(bench, check=True, capture_output=True, timeout=3600)
        run = json.loads(report.read_text())["runs"][0]
        result |= {
            "decode_tok_s": round(1.0 / run["tpot_s"]["p50"], 3),
            "output_tok_s": round(run["output_token_throughput"], 3),
            "ttft_p50_s": round(run["ttft_s"]["p50"], 3),
            "completed": run["completed"],
        }
        result["peak_rss_gib"] = round(max(rss.peak, rss.now()) / GIB, 3)
        result["vmhwm_sum_gib"] = round(rss.hwm_sum() / GIB, 3)
        result["rss_samples"] = rss.samples
        return result
    finally:
        rss.stop()
        server.stop()


def parse_arm(text: str) -> tuple[str, list[str]]:
    """NAME=FLAGS -> (NAME, the flags split as a shell would)."""
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"an arm is NAME=FLAGS (FLAGS may be empty), got {text!r}")
    return name, shlex.split(flags)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="7b")
    p.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    p.add_argument(
        "--arm",
        type=parse_arm,
        action="append",
        dest="arms",
        help="NAME=FLAGS, repeated (default: "
        + ", ".join(f"{k}={v}" for k, v in ARMS.items())
        + ")",
    )
    p.add_argument(
        "--common-flags",
        default="--max-model-len 1024 --kv-pool-size 1GiB",
        help="server flags every arm gets",
    )
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ready-timeout", type=float, default=1800.0)
    p.add_argument("--cache", type=Path, default=OUT / "checkpoints")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    shape = dict(SHAPES[args.shape])
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    arms = dict(args.arms) if args.arms else {k: shlex.split(v) for k, v in ARMS.items()}
    folder = checkpoint(shape, args.cache)
    ckpt = checkpoint_bytes(folder)
    print(f"checkpoint {folder}: {ckpt / GIB:.2f} GiB", flush=True)
    workdir = OUT / "big_model"
    workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, flags in arms.items():
        results[name] = r = run_arm(name, flags, folder, args, workdir)
        if "skipped" not in r:
            r["peak_rss_over_checkpoint"] = round(r["peak_rss_gib"] * GIB / ckpt, 3)
        print(f"{name}: {json.dumps(r)}", flush=True)
    label = args.shape if args.layers is None else f"{args.shape}-{args.layers}l"
    write_json(
        args.json or RESULTS / f"big_model_{label}.json",
        {
            "model": {**config(shape), "checkpoint_gib": round(ckpt / GIB, 3)},
            "workload": f"fixed:{args.prompt_tokens},{args.max_tokens} x {args.requests} at "
            "concurrency 1, --ignore-eos, over HTTP",
            "common_flags": args.common_flags,
            "load_avg_1m": os.getloadavg()[0],
            "arms": results,
        },
    )


if __name__ == "__main__":
    main()
