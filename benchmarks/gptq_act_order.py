"""What GPTQ's activation order costs a product: `ActOrderLinear` (the activation's columns gathered
into the weight's order, then `Int4Linear`) against the same `Int4Linear` on inputs in order.

On the 358M Llama's projection shapes ([896 -> 4864] up, [4864 -> 896] down, [896 -> 1152] qkv),
int4 groups of 128, asymmetric, bf16 activations, at 1, 4, 16, 64 and 256 rows. Rounds alternate
the two (the machine may be shared); the best round counts. The ratio is the plain kind's time
over the act-order one's (1.0: the gather costs nothing; below 1: it costs that share).

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.gptq_act_order [--rounds 5] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from sloserve.layers.act_order import ActOrderLinear
from sloserve.layers.int4 import Int4Linear

from benchmarks._output import write_json
from benchmarks.cpu_int4 import SHAPES, quantize_groups, timed

ROWS = (1, 4, 16, 64, 256)
RESULTS = Path(__file__).resolve().parent / "results" / "gptq_act_order.json"


def run(rounds: int) -> list[dict]:
    """One row per (shape, rows): both kinds' best times and their ratio."""
    table = []
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f) / in_f**0.5
        q, s, zp = quantize_groups(w)
        plain = Int4Linear.from_signed(q, s, zp, dtype=torch.bfloat16)
        ordered = ActOrderLinear(plain, torch.randperm(in_f))
        for rows in ROWS:
            x = torch.randn(rows, in_f).bfloat16()
            repeats = max(3, int(2e8 / (2 * rows * in_f * out_f)))
            kinds = {"plain": plain, "act_order": ordered}
            best = dict.fromkeys(kinds, float("inf"))
            for _ in range(rounds):
                for k, fn in kinds.items():
                    fn(x)
                    best[k] = min(best[k], timed(lambda fn=fn, x=x: fn(x), repeats))
            ratio = best["plain"] / best["act_order"]
            table.append(
                {
                    "shape": name,
                    "rows": rows,
                    "ms": {k: round(t * 1e3, 4) for k, t in best.items()},
                    "plain_over_act_order": round(ratio, 3),
                }
            )
            print(
                f"{name:4} {rows:4} rows  plain {best['plain'] * 1e3:7.3f}ms  act_order "
                f"{best['act_order'] * 1e3:7.3f}ms  x{ratio:.3f}",
                flush=True,
            )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", action="store_true", help=f"write {RESULTS}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()}")
    with torch.inference_mode():
        table = run(args.rounds)
    if args.json:
        write_json(
            RESULTS,
            {
                "torch": torch.__version__,
                "threads": args.threads,
                "rounds": args.rounds,
                "load_average": os.getloadavg(),
                "table": table,
            },
        )


if __name__ == "__main__":
    main()
