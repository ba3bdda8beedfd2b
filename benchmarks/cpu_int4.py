"""int4 weight-only projections on a CPU: torch's int4 kernel against dequantizing a tile, and bf16.

On the 358M Llama's projection shapes ([896 -> 4864] up, [4864 -> 896] down, [896 -> 1152] qkv)
at 1, 4, 16, 64, 128, 256 and 512 rows, each candidate from an activation in the model's dtype (bf16) to its
output, with int4 weights in groups of 128 along the input, asymmetric (a zero per group):

- `bf16`: oneDNN's packed bf16 product (`PackedBf16Linear`), the baseline of the ratios;
- `int4pack`: torch's `_weight_int4pack_mm_for_cpu` on `Int4Linear`'s weight (converted once by
  `_convert_weight_to_int4pack_for_cpu`: [out, in / 2] bytes), scales and zeros [in / 128, out, 2];
- `deq_tile`: the same weight, each tile of 512 output rows unpacked and dequantized to bf16
  (`Int4Linear.dequantized`) and multiplied on torch's bf16 `linear`, tile by tile (no full copy).

`Int4Linear` runs the first below `DEQUANT_ROWS` rows and the second from there on.

Rounds alternate the candidates (the machine may be shared); the best round counts. Each
candidate's result is checked against the float32 product of the dequantized weight.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.cpu_int4 [--rounds 5] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from sloserve.layers.int4 import TILE_OUT, Int4Linear
from sloserve.layers.linear import PackedBf16Linear

from benchmarks._output import OUT, write_json

SHAPES = {"up": (4864, 896), "down": (896, 4864), "qkv": (1152, 896)}
ROWS = (1, 4, 16, 64, 128, 256, 512)
GROUP = 128


def quantize_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of GROUP inputs: signed values [out, in], scales and zero points
    [out, in / GROUP] (w = (q - zero_point) * scale, as compressed-tensors defines it)."""
    g = w.reshape(w.shape[0], -1, GROUP)
    lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero_point = torch.round(-8 - lo / scale).clamp(-8, 7)
    q = torch.round(g / scale[..., None] + zero_point[..., None]).clamp(-8, 7)
    return q.reshape(w.shape).to(torch.int8), scale, zero_point.to(torch.int8)


def candidates(w: torch.Tensor) -> tuple[dict[str, Callable], torch.Tensor]:
    """name -> a product from a bf16 activation; and the float32 weight the int4 one stands for."""
    q, s, zp = quantize_groups(w)
    proj = Int4Linear.from_signed(q, s, zp, dtype=torch.bfloat16)
    bf16 = PackedBf16Linear(w.bfloat16())

    def int4pack(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, proj.packed, proj.group_size, proj.scales_zeros
        )

    def deq_tile(x: torch.Tensor) -> torch.Tensor:
        parts = [
            F.linear(x, proj.dequantized(slice(i, i + TILE_OUT), x.dtype))
            for i in range(0, proj.out_features, TILE_OUT)
        ]
        return torch.cat(parts, dim=-1)

    return {"bf16": bf16, "int4pack": int4pack, "deq_tile": deq_tile}, proj.dequantized()


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
        kinds, dequant = candidates(w)
        for rows in ROWS:
            x = torch.randn(rows, in_f).bfloat16()
            reference = x.float() @ dequant.t()
            errors = {k: (fn(x).float() - reference).abs().max().item() for k, fn in kinds.items()}
            repeats = max(3, int(2e8 / (2 * rows * in_f * out_f)))
            best = dict.fromkeys(kinds, float("inf"))
            for _ in range(rounds):
                for k, fn in kinds.items():
                    fn(x)
                    best[k] = min(best[k], timed(lambda fn=fn, x=x: fn(x), repeats))
            table.append(
                {
                    "shape": name,
                    "out": out_f,
                    "in": in_f,
                    "rows": rows,
                    "ms": {k: round(t * 1e3, 4) for k, t in best.items()},
                    "x_bf16": {k: round(best["bf16"] / t, 2) for k, t in best.items()},
                    "max_abs_error": {k: round(e, 4) for k, e in errors.items()},
                }
            )
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
    parser.add_argument("--json", type=Path, default=OUT / "cpu_int4.json")
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
            "group_size": GROUP,
            "load_average": os.getloadavg(),
            "note": "ratios are bf16 time / candidate time (>1: faster than oneDNN's packed bf16)",
            "table": table,
        },
    )


if __name__ == "__main__":
    main()
