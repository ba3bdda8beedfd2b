"""int8 projections on a CPU: each candidate kernel's time against oneDNN's packed bf16 and float32.

On two projections of Qwen2.5-0.5B's shape (an up projection [4864, 896] and a down one
[896, 4864]) at 1, 2, 4, 8, 16, 64 and 512 rows, the candidates, each from an activation in the
model's dtype (bf16) to its output (casts and activation quantizing included):

- `f32`: oneDNN's packed float32 product (`PackedLinear`), float32 in and out;
- `bf16`: oneDNN's packed bf16 product (`PackedBf16Linear`), the baseline of the ratios;
- `w8a16`: torch's `_weight_int8pack_mm` on the plain [out, in] int8 weight, bf16 activations,
  per-channel scales (weight-only);
- `w8a8_int_mm`: per-token dynamic activation scales, `torch._int_mm` (int32 sums) on the plain
  int8 weight, rescaled by both scales;
- `deq_bf16`: the int8 weight dequantized to bf16 in row tiles of 512 output rows, each tile's
  product on torch's bf16 `linear`.

oneDNN's quantized linear (`torch.ops.onednn.qlinear_pointwise` on `qlinear_prepack`'s weight,
activation scale 1 and float32 out, rescaled by the token scales) is no candidate: in torch 2.13
on this AMD EPYC it took 115 ms at one row and 4 s at 64 (x0.002 of bf16 and less), a reference
path, and it needs a prepacked copy that no other kernel reads.

Rounds alternate the candidates (the machine may be shared); the best round counts. Each
candidate's result is checked against the float32 product of the dequantized weight.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.cpu_int8 [--rounds 5] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from sloserve.layers.linear import PackedBf16Linear, PackedLinear

from benchmarks._output import OUT, write_json

SHAPES = {"up": (4864, 896), "down": (896, 4864)}
ROWS = (1, 2, 4, 8, 16, 64, 512)
DEQ_TILE = 512


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row (absmax / 127) and the float32 scale of each row."""
    scale = t.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(t.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def candidates(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """name -> a product from a bf16 activation, for the weight `w` (float32 [out, in])."""
    q, s = quantize_rows(w)
    f32, bf16 = PackedLinear(w), PackedBf16Linear(w.bfloat16())
    s_bf16 = s.bfloat16()

    def w8a16(x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, q, s_bf16)

    def w8a8_int_mm(x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows(x)
        return (torch._int_mm(xq, q.t()) * (xs[:, None] * s)).to(x.dtype)

    def deq_bf16(x: torch.Tensor) -> torch.Tensor:
        parts = [
            F.linear(x, (q[i : i + DEQ_TILE].to(torch.bfloat16) * s_bf16[i : i + DEQ_TILE, None]))
            for i in range(0, q.shape[0], DEQ_TILE)
        ]
        return torch.cat(parts, dim=-1)

    return {
        "f32": lambda x: f32(x.float()),
        "bf16": bf16,
        "w8a16": w8a16,
        "w8a8_int_mm": w8a8_int_mm,
        "deq_bf16": deq_bf16,
    }


def timed(fn: Callable[[], object], repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def run(rounds: int) -> list[dict]:
    """One row per (shape, rows): each candidate's best time and its ratio to bf16."""
    table = []
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f) / in_f**0.5
        kinds = candidates(w)
        q, s = quantize_rows(w)
        for rows in ROWS:
            x = torch.randn(rows, in_f).bfloat16()
            reference = x.float() @ (q.float() * s[:, None]).t()
            errors = {k: (fn(x).float() - reference).abs().max().item() for k, fn in kinds.items()}
            repeats = max(3, int(4e8 / (2 * rows * in_f * out_f)))
            best = dict.fromkeys(kinds, float("inf"))
            for _ in range(rounds):
                for k, fn in kinds.items():
                    fn(x)
                    best[k] = min(best[k], timed(lambda fn=fn, x=x: fn(x), repeats))
            row = {
                "shape": name,
                "out": out_f,
                "in": in_f,
                "rows": rows,
                "ms": {k: round(t * 1e3, 4) for k, t in best.items()},
                "x_bf16": {k: round(best["bf16"] / t, 2) for k, t in best.items()},
                "max_abs_error": {k: round(e, 4) for k, e in errors.items()},
            }
            table.append(row)
            print(
                f"{name:4} {rows:4} rows  "
                + "  ".join(
                    f"{k} {t * 1e3:7.3f}ms (x{best['bf16'] / t:4.2f})" for k, t in best.items()
                ),
                flush=True,
            )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, default=OUT / "cpu_int8.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        table = run(args.rounds)
    write_json(
        args.json,
        {
            "torch": torch.__version__,
            "threads": args.threads,
            "rounds": args.rounds,
            "load_average": os.getloadavg(),
            "note": "ratios are bf16 time / candidate time (>1: faster than oneDNN's packed bf16)",
            "table": table,
        },
    )


if __name__ == "__main__":
    main()
