"""The in-place paged decode kernel against the machine's memory bandwidth, side by side in one run.

A decode step's attention reads every running sequence's whole K and V: at 800 tokens of
context the built-in model's float32 KV is 3.3 MB a sequence, so a batch of 64 reads ~210 MB a
step, far past any cache. That read is the kernel's floor. For each batch size and context
length this times `paged.paged_decode` layer after layer over the built-in model's 4 layers of
pages (4 query heads, 2 KV heads, head_dim 64, 16-token pages; each layer its own cache, as
served, so a small batch is not read from the last-level cache either), with the pages laid
out contiguously and shuffled through the pool as serving leaves them, and beside it a plain
streaming read (`torch.sum`) of buffers of the same sizes on the same threads. It prints the
KV bytes read per second and their ratio to the streaming rate, alternating rounds (the best
round of each counts).

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.paged_kernel [--batches 16 64] [--contexts 128 800]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import torch
from sloserve.layers.attention import paged

from benchmarks._output import OUT, write_json

HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 4, 2, 64, 16, 4


def layout(batch: int, context: int, shuffled: bool, seed: int = 0) -> tuple:
    """(q, k_cache, v_cache, block_tables, seq_lens) of one layer: `batch` sequences of `context` tokens."""
    pages = -(-context // PAGE)
    ids = list(range(1, 1 + batch * pages))  # page 0 is the pool's null page
    if shuffled:
        random.Random(seed).shuffle(ids)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1 + batch * pages, PAGE, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(1 + batch * pages, PAGE, KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    tables = torch.tensor(ids, dtype=torch.int32).view(batch, pages)
    return q, k, v, tables, torch.full((batch,), context, dtype=torch.int32)


def attention_step(layers: list[tuple]) -> None:
    """One decode step's attention: the kernel over every layer's pages."""
    for q, k, v, tables, lens in layers:
        paged.paged_decode(q, k, v, tables, lens, HEAD_DIM**-0.5)


def streaming_read(buffers: list[torch.Tensor]) -> None:
    for buffer in buffers:
        buffer.sum()


def round_seconds(step, data, repeats: int) -> float:
    """Mean seconds of step(data) over `repeats` calls, after one untimed call."""
    step(data)
    started = time.perf_counter()
    for _ in range(repeats):
        step(data)
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 800])
    parser.add_argument("--repeats", type=int, default=20, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT / "paged_kernel.json")
    args = parser.parse_args()
    if not paged.AVAILABLE:
        raise SystemExit(
            "the paged kernel extension is not built (python setup.py build_ext --inplace)"
        )
    print(
        f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(default)')}, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'batch':>5} {'context':>7} {'pages':>10} {'step ms':>8} {'KV GB/s':>8} {'stream GB/s':>11} {'ratio':>6}"
        "   (a decode step's attention: every layer)"
    )
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 4 * LAYERS  # a step's read
            streams = [torch.randn(kv_bytes // 4 // LAYERS) for _ in range(LAYERS)]
            for shuffled in (False, True):
                layers = [layout(batch, context, shuffled, seed=i) for i in range(LAYERS)]
                kernel_s, stream_s = [], []
                for _ in range(args.rounds):  # alternating; the best round of each counts
                    kernel_s.append(round_seconds(attention_step, layers, args.repeats))
                    stream_s.append(round_seconds(streaming_read, streams, args.repeats))
                kernel_gbs, stream_gbs = (
                    kv_bytes / min(kernel_s) / 1e9,
                    kv_bytes / min(stream_s) / 1e9,
                )
                row = {
                    "batch": batch,
                    "context": context,
                    "pages": "shuffled" if shuffled else "contiguous",
                    "kv_mb": round(kv_bytes / 1e6, 1),
                    "kernel_ms": round(min(kernel_s) * 1e3, 3),
                    "kernel_gb_s": round(kernel_gbs, 1),
                    "stream_gb_s": round(stream_gbs, 1),
                    "ratio": round(kernel_gbs / stream_gbs, 3),
                }
                rows.append(row)
                print(
                    f"{batch:>5} {context:>7} {row['pages']:>10} {row['kernel_ms']:>8.3f} {kernel_gbs:>8.1f} "
                    f"{stream_gbs:>11.1f} {row['ratio']:>6.2f}"
                )
    report = {
        "benchmark": "paged_kernel",
        "shape": {
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "page": PAGE,
            "layers": LAYERS,
        },
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "rows": rows,
    }
    write_json(args.out, report)


if __name__ == "__main__":
    main()
