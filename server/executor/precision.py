"""Which dtype a model runs in: what `--dtype` asks, what the checkpoint holds, what the CPU has.

On a GPU `auto` is bfloat16. On a CPU `auto` keeps a float32 (or unlabelled) checkpoint in float32
(its exact equality with transformers holds), and serves a bf16 checkpoint in bf16 where the CPU
has bf16 dot-product units (AVX512-BF16 or AMX-BF16) and a start-up probe, torch's own `linear`
in both dtypes at a prefill-like shape, finds bf16 faster; float32 otherwise. Nothing is assumed
from the vendor or the model name (how much bf16 gains differs by machine, and without the units
torch emulates bf16, several times slower: docs/design/cpu-decode.md).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from sloserve.layers.linear import onednn_available, onednn_product

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The CPU flags (Linux /proc/cpuinfo) of units that run bf16 products natively.
BF16_UNITS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}
# bf16 also halves the bytes a decode step reads, so a tie in the probe goes to bf16.
MIN_BF16_SPEEDUP = 1.0
# The probe's product: [rows, hidden] x [hidden, out], ~0.5 GFLOP (3 ms in float32 at 0.18 TFLOP/s).
_PROBE_SHAPE = (256, 1024, 1024)
_PROBE_REPS = 5


@dataclass(slots=True, frozen=True)
class DtypeChoice:
    """The dtype weights, activations and KV pages run in, and why."""

    dtype: torch.dtype
    reason: str
    bf16_speedup: float | None = None  # the probe's float32 time over its bf16 time, if it ran


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo is not there to read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def bf16_units(flags: frozenset[str] | None = None) -> list[str]:
    """The bf16 dot-product units this CPU has, by name (AMX first)."""
    flags = cpu_flags() if flags is None else flags
    return [name for flag, name in BF16_UNITS.items() if flag in flags]


def checkpoint_dtype(folder: Path) -> torch.dtype | None:
    """The dtype config.json declares (`torch_dtype`, or `dtype` as newer transformers write it)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("torch_dtype") or config.get("dtype")
    return DTYPES.get(str(name).removeprefix("torch.")) if name else None


def probe_bf16_speedup() -> float:
    """float32 time over bf16 time of one product at a prefill-like shape (best of a few), on the
    kernels the projections run: oneDNN where torch has it, else torch's `linear`."""
    rows, k, n = _PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    product = onednn_product if onednn_available() else F.linear
    xb, wb = x.bfloat16(), w.bfloat16()
    times: dict[torch.dtype, float] = {torch.float32: math.inf, torch.bfloat16: math.inf}
    with torch.inference_mode():
        for rep in range(_PROBE_REPS + 1):  # alternating, so drift hits both; the first builds
            for a, b in ((x, w), (xb, wb)):
                started = time.perf_counter()
                product(a, b)
                if rep:
                    times[a.dtype] = min(times[a.dtype], time.perf_counter() - started)
    return times[torch.float32] / times[torch.bfloat16]


def choose_dtype(
    name: str,
    device: torch.device,
    stored: torch.dtype | None,
    *,
    probe: bool = True,
    flags: frozenset[str] | None = None,
) -> DtypeChoice:
    """The dtype for `--dtype name` on `device`, for a checkpoint stored in `stored` (None: unknown).

    `probe` False decides by the CPU's units alone (tensor-parallel ranks: each probes its own
    timing, and ranks must agree). An explicit bfloat16 on a CPU without bf16 units is an error.
    """
    if name not in ("auto", *DTYPES):
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}, got {name!r}")
    if device.type != "cpu":
        if name == "auto":
            return DtypeChoice(torch.bfloat16, f"--dtype auto on {device.type}")
        return DtypeChoice(DTYPES[name], f"--dtype {name}")
    units = bf16_units(flags)
    if name == "bfloat16" and not units:
        raise ValueError(
            "--dtype bfloat16 on a CPU needs bf16 dot-product units (AVX512-BF16 or AMX-BF16); "
            "this CPU has neither, so torch would emulate them several times slower than "
            "float32: use --dtype float32 (or --dtype auto)"
        )
    if name != "auto":
        return DtypeChoice(
            DTYPES[name], f"--dtype {name}" + (f" ({', '.join(units)})" * bool(units))
        )
    if stored != torch.bfloat16:
        held = "an unlabelled" if stored is None else str(stored).removeprefix("torch.")
        return DtypeChoice(torch.float32, f"--dtype auto on a CPU: {held} checkpoint runs float32")
    if not units:
        return DtypeChoice(
            torch.float32,
            "--dtype auto: bf16 checkpoint, but this CPU has no AVX512-BF16 or AMX-BF16 units",
        )
    if not probe:
        return DtypeChoice(
            torch.bfloat16, f"--dtype auto: bf16 checkpoint, {', '.join(units)} (not probed)"
        )
    speedup = probe_bf16_speedup()
    dtype = torch.bfloat16 if speedup >= MIN_BF16_SPEEDUP else torch.float32
    return DtypeChoice(
        dtype,
        f"--dtype auto: bf16 checkpoint, {', '.join(units)}, probe bf16 x{speedup:.2f} of "
        f"float32 at {'x'.join(map(str, _PROBE_SHAPE))}",
        round(speedup, 3),
    )
