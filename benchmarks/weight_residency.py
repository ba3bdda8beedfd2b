"""Resident weight bytes over the checkpoint's bytes, on a CPU: each weight held once?

Builds (once, under benchmarks/out/) a random-weight Llama of Qwen2.5-0.5B's shape (hidden 896,
24 layers, 14 heads, 2 KV heads, intermediate 4864, tied embeddings; `--vocab`, 151,936 by default),
then per arm, in a child process of its own, builds a `ModelRunner` and reports two ratios over the
bytes of the checkpoint's distinct parameters in the dtype it is stored in: the bytes the model's
weights hold (`ModelWeights.nbytes`, a packed copy at its own size) and the process's RSS growth
over the build (with and without its KV pool of 32 MiB; the rest of what is not weights: the
step's buffers, imports, warm-up activations). Arms on the float32 checkpoint: `auto` (the default:
the fused C step reads the plain weights and oneDNN reads them in place), `packed`
(SLOSERVE_NO_EXTENSIONS=1: no fused step, only oneDNN's packed copy kept), `blas` (`--cpu-gemm
blas`, torch's F.linear); on the same model saved in bf16: `bf16` (`--dtype bfloat16`, oneDNN's
packed bf16 copy; needs a CPU with AVX512-BF16 or AMX-BF16) and `int8` (`--quantization int8`:
every projection, the embedding and the LM head as int8 rows with a float32 scale per row).

    python -m benchmarks.weight_residency [--vocab 151936] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks._output import OUT, write_json

SHAPE = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
# arm -> (--cpu-gemm, environment, the checkpoint's and the runner's dtype, --quantization)
ARMS = {
    "auto": ("auto", {}, "float32", "none"),
    "packed": ("auto", {"SLOSERVE_NO_EXTENSIONS": "1"}, "float32", "none"),
    "blas": ("blas", {}, "float32", "none"),
    "bf16": ("auto", {}, "bfloat16", "none"),
    "int8": ("auto", {}, "bfloat16", "int8"),
}


def checkpoint(vocab: int, dtype: str = "float32") -> Path:
    """The Qwen2.5-0.5B-shape random-weight Llama saved in `dtype` (built once under benchmarks/out)."""
    from tests.checkpoints import tiny_checkpoint

    return tiny_checkpoint("llama", OUT / "checkpoints", vocab_size=vocab, dtype=dtype, **SHAPE)


def rss_bytes() -> int:
    """This process's resident set now (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(folder: str, cpu_gemm: str, dtype: str, quantization: str) -> dict:
    """One runner built in this process: what its weights hold and how much RSS grew."""
    import torch
    from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
    from sloserve.executor import ModelRunner

    torch.set_num_threads(1)
    config = SloserveConfig(
        model=ModelConfig(
            path=folder,
            device="cpu",
            cpu_gemm=cpu_gemm,
            dtype=dtype,
            quantization=quantization,
            max_model_len=512,
        ),
        cache=CacheConfig(kv_pool_bytes=32 << 20, swap_bytes=0),
        scheduler=SchedulerConfig(max_batch=4, max_batched_tokens=256),
    )
    before = rss_bytes()
    runner = ModelRunner(config)
    grown = rss_bytes() - before
    weights = runner.model.weights
    stored = weights.num_parameters() * runner.dtype.itemsize  # the checkpoint's bytes
    pool = runner.pool.total_bytes  # zeroed at allocation: resident
    layer = weights.layers[0]
    return {
        "dtype": str(runner.dtype).removeprefix("torch."),
        "projection_kind": type(layer.qkv).__name__,
        "embedding_kind": type(weights.embed).__name__,
        "fused_step": runner.decode_step is not None and runner.decode_step.fused is not None,
        "parameters": weights.num_parameters(),
        "checkpoint_bytes": stored,
        "held_bytes": weights.nbytes(),
        "held_ratio": round(weights.nbytes() / stored, 4),
        "rss_growth_bytes": grown,
        "rss_ratio": round(grown / stored, 4),
        "pool_bytes": pool,
        "rss_less_pool_ratio": round((grown - pool) / stored, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--json", default=str(OUT / "weight_residency.json"))
    parser.add_argument(
        "--child",
        nargs=4,
        metavar=("FOLDER", "CPU_GEMM", "DTYPE", "QUANTIZATION"),
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    report = {"model": {"vocab_size": args.vocab, **SHAPE}, "arms": {}}
    for arm in args.arms:
        cpu_gemm, env, dtype, quantization = ARMS[arm]
        folder = checkpoint(args.vocab, dtype)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.weight_residency",
                "--child",
                str(folder),
                cpu_gemm,
                dtype,
                quantization,
            ],
            env={**os.environ, **env},
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        result = json.loads(out.strip().splitlines()[-1])
        report["arms"][arm] = result
        print(
            f"{arm:7s} {result['projection_kind']:16s} held/checkpoint {result['held_ratio']:.3f}  "
            f"RSS growth/checkpoint {result['rss_ratio']:.3f} "
            f"(less the KV pool {result['rss_less_pool_ratio']:.3f})"
        )
    write_json(Path(args.json), report)


if __name__ == "__main__":
    main()
