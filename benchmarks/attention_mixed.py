"""CPU step time of a mixed step (64 decodes + one 50-token prefill) and a decode-only step, per backend.

Runs ModelRunner.execute() on a small random Llama (hidden 256, 4 layers, 4 query / 2 KV heads) with
each attention backend swapped in, in alternating rounds (the median round of each counts, so a busy
machine skews no side), and prints milliseconds per step and ratios against `reference`.
`--before FILE` adds a backend loaded from another version of sdpa.py, e.g.
`git show 8d20d1f:server/layers/attention/sdpa.py > /tmp/sdpa_before.py` (per-sequence loop in mixed steps).

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.attention_mixed [--rounds 7] [--context 64,320]
        [--before /tmp/sdpa_before.py] [--out benchmarks/out/attention_mixed.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
from sloserve.executor import ModelRunner
from sloserve.layers.attention import get_backend
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

PAGE = 16
GREEDY = SamplingParams(max_tokens=1 << 20)


def steps(
    num_decodes: int, prefill_len: int, context: tuple[int, int], seed: int = 0
) -> dict[str, SchedulerOutput]:
    """A mixed step and the same decodes alone; decode contexts drawn from `context`, pages disjoint."""
    rng = random.Random(seed)
    next_page = 1
    decodes = []
    for i in range(num_decodes):
        length = rng.randint(*context)
        pages = -(-length // PAGE)
        table = list(range(next_page, next_page + pages))
        next_page += pages
        decodes.append(
            ScheduledSequence(f"d{i}", [rng.randrange(256)], length - 1, table, True, GREEDY)
        )
    table = list(range(next_page, next_page + -(-prefill_len // PAGE)))
    prefill = ScheduledSequence(
        "p", [rng.randrange(256) for _ in range(prefill_len)], 0, table, True, GREEDY
    )
    return {"mixed": SchedulerOutput([prefill, *decodes]), "decode": SchedulerOutput(decodes)}


def load_backend_file(path: Path):
    """SdpaBackend from another version of sdpa.py."""
    spec = importlib.util.spec_from_file_location("sdpa_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SdpaBackend()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--decodes", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=50)
    parser.add_argument(
        "--context", default="64,320", help="decode context lengths: MIN,MAX tokens"
    )
    parser.add_argument(
        "--before", type=Path, default=None, help="an older sdpa.py to time beside the current one"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    from tests.checkpoints import tiny_checkpoint

    folder = tiny_checkpoint(
        "llama",
        Path(tempfile.gettempdir()) / "sloserve-bench",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.02,
    )
    config = SloserveConfig(
        model=ModelConfig(path=str(folder), device="cpu", attention_backend="reference"),
        cache=CacheConfig(block_size=PAGE, kv_pool_bytes=128 * 2**20, swap_bytes=0),
        scheduler=SchedulerConfig(
            max_batch=args.decodes + 1, max_batched_tokens=args.decodes + args.prefill
        ),
    )
    runner = ModelRunner(config)
    backends = {"reference": get_backend("reference", "cpu"), "sdpa": get_backend("sdpa", "cpu")}
    if args.before is not None:
        backends["sdpa-before"] = load_backend_file(args.before)
    context = tuple(int(x) for x in args.context.split(","))
    work = steps(args.decodes, args.prefill, context)
    times: dict[str, dict[str, list[float]]] = {
        kind: {name: [] for name in backends} for kind in work
    }
    for _ in range(args.rounds + 1):  # the first round warms up and is dropped
        for kind, out in work.items():
            for name, backend in backends.items():
                runner.model.backend = backend
                t = time.perf_counter()
                runner.execute(out)
                times[kind][name].append(time.perf_counter() - t)
    result = {
        "threads": torch.get_num_threads(),
        "decodes": args.decodes,
        "prefill": args.prefill,
        "context": list(context),
        "before": str(args.before) if args.before else None,
        "ms": {},
    }
    for kind, per in times.items():
        ms = {name: 1e3 * statistics.median(ts[1:]) for name, ts in per.items()}
        result["ms"][kind] = ms
        line = "  ".join(f"{name} {value:7.1f} ms" for name, value in ms.items())
        ratios = "  ".join(
            f"{name}/reference {value / ms['reference']:.2f}"
            for name, value in ms.items()
            if name != "reference"
        )
        print(f"{kind:7s} {line}   {ratios}")
    if "sdpa-before" in backends:
        print(
            f"mixed sdpa-before/sdpa {result['ms']['mixed']['sdpa-before'] / result['ms']['mixed']['sdpa']:.2f}"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
