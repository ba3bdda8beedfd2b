"""Operations per second of the compiled hot path vs its pure-Python twin, side by side.

Run: python -m benchmarks.hotpath [--sizes 10000,100000] [--out FILE]

For each live-entry count it measures, on both implementations with identical inputs:
- queue  push+pop: pop the most urgent and push a new request (the queue stays at N);
- queue  remove:   cancel every queued handle in random order (the twin's remove is a lazy
                   dict pop whose heap clean-up comes later, so only a full drain counts it);
- queue  rekey:    one re-key pass over all N entries (entries per second);
- blocks allocate(8)+free: one request's blocks in and out, counted per call;
- blocks api:      free a random request tail first, look up its prefix hash (touch or incref on
                   a hit), allocate the rest, hash the first block; counted per API call;
- queue/blocks core: the `_bench_*` churns (the compiled one runs in one nogil section; the
                   twin makes the same calls through its API); counted per churn op.
Arguments are generated before the clock starts, so the timed loops only call the API. Every
figure is the best of --repeat runs, the two implementations alternating. The last line printed
is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

from sloserve.hotpath import _bench, _bench_py, _blocks, _blocks_py, _queue, _queue_py

IMPLS = {"cython": (_queue, _blocks, _bench), "python": (_queue_py, _blocks_py, _bench_py)}


def best_of_interleaved(
    repeat: int, runs: dict[str, Callable[[], tuple[int, float]]]
) -> dict[str, float]:
    """Highest ops/s of each implementation; runs alternate so both see the same machine load."""
    best = dict.fromkeys(runs, 0.0)
    for _ in range(repeat):
        for name, run in runs.items():
            ops, secs = run()
            best[name] = max(best[name], ops / secs)
    return best


def filled_queue(mod, n: int, rng: random.Random):
    q = mod.RequestQueue(capacity=n)
    for h in range(n):
        q.push(h, rng.uniform(0.0, 2.0), rng.randrange(4096), 0.0)
    return q


def queue_push_pop(mod, n: int, ops: int, seed: int) -> tuple[int, float]:
    rng = random.Random(seed)
    q = filled_queue(mod, n, rng)
    deadlines = [rng.uniform(0.0, 2.0) for _ in range(ops)]
    tokens = [rng.randrange(4096) for _ in range(ops)]
    push, pop = q.push, q.pop
    start = time.perf_counter()
    for i in range(ops):
        pop()
        push(n + i, deadlines[i], tokens[i], 0.0)
    return 2 * ops, time.perf_counter() - start


def queue_remove(mod, n: int, ops: int, seed: int) -> tuple[int, float]:
    """Cancel every queued handle in random order, so deferred clean-up is counted too."""
    rng = random.Random(seed)
    q = filled_queue(mod, n, rng)
    victims = list(range(n))
    rng.shuffle(victims)
    remove = q.remove
    start = time.perf_counter()
    for h in victims:
        remove(h)
    return n, time.perf_counter() - start


def queue_rekey(mod, n: int, passes: int, seed: int) -> tuple[int, float]:
    q = filled_queue(mod, n, random.Random(seed))
    start = time.perf_counter()
    for i in range(passes):
        q.rekey(0.001 * (i + 1))
    return n * passes, time.perf_counter() - start


def blocks_api(mod, live: int, ops: int, seed: int) -> tuple[int, float]:
    """Requests of 8 blocks; num_blocks = 1.25 x live so frees feed both lists and evictions."""
    rng = random.Random(seed)
    per_req = 8
    n_req = live // per_req
    a = mod.BlockAllocator(live + live // 4 + 1)
    held = [a.allocate(per_req) for _ in range(n_req)]
    for i, blocks in enumerate(held):
        a.set_hash(blocks[0], i)
    picks = [rng.randrange(n_req) for _ in range(ops)]
    queries = [rng.randrange(n_req + ops) for _ in range(ops)]
    free, allocate, lookup, set_hash = a.free, a.allocate, a.lookup, a.set_hash
    ref_count, touch, incref, record = a.ref_count, a.touch, a.incref, a.record_lookup
    calls = 0
    start = time.perf_counter()
    for i in range(ops):
        j = picks[i]
        free(held[j][::-1])
        b = lookup(queries[i])
        record(b >= 0)
        if b >= 0:
            if ref_count(b) > 0:
                incref(b)
            else:
                touch(b)
            blocks = [b, *allocate(per_req - 1)]
            calls += 6
        else:
            blocks = allocate(per_req)
            set_hash(blocks[0], n_req + i)
            calls += 5
        held[j] = blocks
    return calls, time.perf_counter() - start


def blocks_alloc_free(mod, live: int, ops: int, seed: int) -> tuple[int, float]:
    """allocate(8) then free it tail first, with `live` blocks held by other requests."""
    a = mod.BlockAllocator(live + live // 4 + 1)
    a.allocate(live)
    allocate, free = a.allocate, a.free
    start = time.perf_counter()
    for _ in range(ops):
        free(allocate(8)[::-1])
    return 2 * ops, time.perf_counter() - start


def queue_core(mod, n: int, ops: int, seed: int) -> tuple[int, float]:
    start = time.perf_counter()
    mod._bench_queue(n, ops, seed)
    return ops, time.perf_counter() - start


def blocks_core(mod, live: int, ops: int, seed: int) -> tuple[int, float]:
    start = time.perf_counter()
    mod._bench_blocks(2 * live, live // 4, ops, seed)
    return ops, time.perf_counter() - start


# (structure, workload, function, index of the module in IMPLS, ops for the compiled, for the twin)
WORKLOADS = [
    ("queue", "push+pop", queue_push_pop, 0, 400_000, 40_000),
    ("queue", "remove", queue_remove, 0, 5_000, 5_000),
    ("queue", "rekey", queue_rekey, 0, 20, 2),
    ("queue", "core churn (nogil)", queue_core, 2, 2_000_000, 40_000),
    ("blocks", "allocate(8)+free", blocks_alloc_free, 1, 200_000, 20_000),
    ("blocks", "api calls", blocks_api, 1, 100_000, 20_000),
    ("blocks", "core churn (nogil)", blocks_core, 2, 2_000_000, 40_000),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000", help="live entries, comma separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for size in sizes:
        for structure, workload, fn, which, ops_c, ops_py in WORKLOADS:
            runs = {
                name: functools.partial(fn, mods[which], size, ops, 7)
                for (name, mods), ops in zip(IMPLS.items(), (ops_c, ops_py), strict=True)
            }
            rates = best_of_interleaved(args.repeat, runs)
            row = {
                "structure": structure,
                "workload": workload,
                "live": size,
                "cython_ops_s": round(rates["cython"]),
                "python_ops_s": round(rates["python"]),
                "ratio": round(rates["cython"] / rates["python"], 1),
            }
            rows.append(row)
            print(
                f"{structure:6s} {workload:20s} live={size:>7,d}  cython {row['cython_ops_s']:>12,d}/s"
                f"  python {row['python_ops_s']:>10,d}/s  ratio {row['ratio']:>6.1f}x",
                flush=True,
            )
    summary = {
        "benchmark": "hotpath",
        "rows": rows,
        "min_ratio": {
            s: min(r["ratio"] for r in rows if r["structure"] == s) for s in ("queue", "blocks")
        },
    }
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
