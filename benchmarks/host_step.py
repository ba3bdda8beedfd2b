"""The host's share of a GPU decode step, timed on the CPU: before (general path) and after (bucketed).

    python -m benchmarks.host_step [--steps 200]

A 16-layer Llama with tiny dimensions in bfloat16 (the dtype a GPU runs), so the arithmetic is
negligible and what is timed is host work. Per decode step of B sequences:
  before   InputBuilder.build (flat metadata, every step) + the eager forward over it (on a GPU:
           ~20 kernel launches per layer from Python) + sampling
  after    InputBuilder.build_decode (persistent, bucket-padded rows, written in place) + one
           replay of the captured step (on a GPU: one graph launch; here not timed, see below)
           + sampling
The eager forward is printed for reference: it is the host time a CUDA graph replaces with one
launch. Both sides run in one process, alternating, and the ratio is printed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _checkpoint(folder: Path) -> None:
    from sloserve.tokenizer import save_byte_level_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=False,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    save_byte_level_tokenizer(folder, 4096)


def _ms(fn, steps: int) -> float:
    """Median milliseconds of fn over `steps` calls (after 5 warm ones)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batches", default="1,32,128")
    args = parser.parse_args()
    from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
    from sloserve.executor import ModelRunner
    from sloserve.executor.graphs import graph_buckets
    from sloserve.sampling_params import SamplingParams
    from sloserve.sched.output import ScheduledSequence

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="host_step_"))
    _checkpoint(folder)
    runner = ModelRunner(
        SloserveConfig(
            model=ModelConfig(
                path=str(folder),
                device="cpu",
                dtype="bfloat16",
                attention_backend="sdpa",
                max_model_len=1024,
            ),
            cache=CacheConfig(block_size=16, kv_pool_bytes=128 * 1024**2, swap_bytes=0),
            scheduler=SchedulerConfig(max_batch=128, max_batched_tokens=2048),
        )
    )
    buckets = graph_buckets(128)
    greedy = SamplingParams(max_tokens=10**6, ignore_eos=True)
    print(
        f"{'batch':>5} {'build before':>13} {'build after':>12} {'sample':>8} {'host before':>12} "
        f"{'host after':>11} {'ratio':>6} {'eager forward':>14}"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        seqs = [
            ScheduledSequence(
                f"r{i}", [7], 250 + i % 50, list(range(1 + 20 * i, 21 + 20 * i)), True, greedy
            )
            for i in range(batch)
        ]
        bucket = next(b for b in buckets if b >= batch)
        build_before = _ms(lambda seqs=seqs: runner.inputs.build(seqs), args.steps)
        build_after = _ms(
            lambda seqs=seqs, bucket=bucket: runner.inputs.build_decode(seqs, bucket), args.steps
        )
        step = runner.inputs.build(seqs)
        logits = runner.model.forward(
            step.input_ids, step.positions, step.meta, runner.kv, step.sample_idx
        )
        params, ids = [s.sampling for s in seqs], [s.req_id for s in seqs]
        sample = _ms(
            lambda logits=logits, params=params, ids=ids: runner.sampler.sample(
                logits, params, ids
            ),
            args.steps,
        )
        forward = _ms(
            lambda step=step: runner.model.forward(
                step.input_ids, step.positions, step.meta, runner.kv, step.sample_idx
            ),
            max(10, args.steps // 10),
        )
        before, after = build_before + sample, build_after + sample
        print(
            f"{batch:>5} {build_before:>11.3f}ms {build_after:>10.3f}ms {sample:>6.3f}ms {before:>10.3f}ms "
            f"{after:>9.3f}ms {after / before:>6.2f} {forward:>12.2f}ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
