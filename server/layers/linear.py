"""Projection objects: each owns its weight in the form its kernel reads and is called as `proj(x)`.

A kind per kernel, each holding its weight once (nothing keeps a second copy):

- `DenseLinear`: the plain weight, `F.linear` (GPUs, other dtypes, `--cpu-gemm blas`);
- `OneDnnLinear`: the plain weight, products of MIN_PACKED_ROWS rows and more through oneDNN
  reading it in place: where something else reads the plain weight too (the fused C decode step,
  torch.compile);
- `PackedLinear`: only oneDNN's packed copy (the plain one is released), every product on oneDNN;
- `PackedBf16Linear`: the same in bf16, on oneDNN's bf16 kernels (AVX512-BF16 or AMX tiles, sums
  in float32), in row tiles down to one row: a decode row is never padded to more;
- `OneDnnBf16Linear`: `OneDnnLinear` in bf16: the plain bf16 weight that the fused C decode step
  reads, oneDNN's bf16 kernels reading it in place for products of MIN_PACKED_ROWS rows and more.

torch's CPU `F.linear` calls MKL's sgemm, which on AMD CPUs takes its non-Intel (AVX2) path;
oneDNN (bundled with torch, dispatched on CPU features, not on the vendor) runs AVX-512 there,
about twice as fast (docs/design/cpu-decode.md, `benchmarks/cpu_gemm.py`). It is fastest on
weights reordered to its blocked layout; on the plain weight it gives the same bits at 70-95 % of
that speed (fewer rows lose more; measured on an AMD EPYC, 896-wide projections).

oneDNN builds (and caches) a primitive for every row count it sees, each holding memory of its
own, so memory grows with every new row count. So a product runs in row tiles of the few sizes
in TILE_ROWS (the last one padded): the memory stops growing after the first pass, at a little
less speed than one untiled call (docs/design/cpu-decode.md). Each tile is an OpenMP region,
which under passive waiting wakes the second thread.

Numerics: oneDNN sums in another order than MKL, so logits differ in the last bits. A row's
result does not depend on how many rows share a oneDNN product (measured from 1 to 1024 rows);
`OneDnnLinear` runs products of fewer than MIN_PACKED_ROWS rows on MKL, whose sums differ from
oneDNN's (MKL's own one-row product already differed from its many-row one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

CPU_GEMMS = ("auto", "onednn", "blas")
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)

# The packed layout is chosen for products of about this many rows (the largest tile); products of
# other sizes read it correctly, at most a little slower.
_PACK_ROWS_HINT = 512
# Row tiles of a packed product, largest first (see the module docstring).
TILE_ROWS = (512, 256, 128, 64, 32, 16)
# bf16 row tiles: down to one row, so nothing is padded (a padded decode row costs more than it
# saves: docs/design/cpu-decode.md, "bf16 on the CPU").
BF16_TILE_ROWS = (*TILE_ROWS, 8, 4, 2, 1)
# Fewer rows than this run F.linear: oneDNN's packed product loses to MKL below it
# (docs/design/cpu-decode.md).
MIN_PACKED_ROWS = 16


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN linear operators (private to torch, used by Inductor)."""
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_linear_pointwise")
        and hasattr(mkldnn, "_reorder_linear_weight")
    )


def cpu_gemm_reason(choice: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `choice` cannot pack this model's projections for oneDNN (None: it can)."""
    if choice not in CPU_GEMMS:
        raise ValueError(f"cpu gemm must be one of {', '.join(CPU_GEMMS)}, got {choice!r}")
    if choice == "blas":
        return "--cpu-gemm blas"
    if device.type != "cpu" or dtype not in ONEDNN_DTYPES:
        return (
            "oneDNN packing serves float32 and bfloat16 on a CPU "
            f"(this model runs {dtype} on {device.type})"
        )
    if not onednn_available():
        return "this torch build has no oneDNN linear operators"
    return None


class Linear(Protocol):
    """A projection y = x W^T + b, whatever form it keeps W in."""

    bias: torch.Tensor | None
    out_features: int
    in_features: int

    @property
    def weight(self) -> torch.Tensor | None:
        """The plain [out, in] weight where this kind keeps one (None: only another form)."""
        ...

    def nbytes(self) -> int:
        """Bytes this projection holds (weight in its form, and bias)."""
        ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True)
class DenseLinear:
    """The plain weight through `F.linear`."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def nbytes(self) -> int:
        return _nbytes(self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(slots=True)
class OneDnnLinear(DenseLinear):
    """The plain weight, read in place by oneDNN for products of MIN_PACKED_ROWS rows or more."""

    def __post_init__(self) -> None:
        _check_cpu_matrix(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (
            torch.compiler.is_compiling()  # traced graphs keep torch's own linear
            or x.dim() != 2
            or x.shape[0] < MIN_PACKED_ROWS
        ):
            return F.linear(x, self.weight, self.bias)
        return onednn_product(x, self.weight, self.bias)


@dataclass(slots=True)
class OneDnnBf16Linear(OneDnnLinear):
    """The plain bf16 weight, read in place by oneDNN's bf16 kernels for products of
    MIN_PACKED_ROWS rows or more."""

    def __post_init__(self) -> None:
        _check_cpu_matrix(self.weight, torch.bfloat16)


class PackedLinear:
    """Only oneDNN's packed copy of the weight (the plain one is not kept); every product on oneDNN."""

    __slots__ = ("packed", "bias", "out_features", "in_features")
    dtype = torch.float32  # of the weight it packs, and of the activations it takes
    tiles = TILE_ROWS

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        _check_cpu_matrix(weight, self.dtype)
        self.out_features, self.in_features = weight.shape
        with torch.inference_mode():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(
                weight.contiguous(), _PACK_ROWS_HINT
            )
        self.bias = bias

    @property
    def weight(self) -> None:
        return None

    def nbytes(self) -> int:
        packed = int(torch.ops.mkldnn._nbytes(self.packed))
        return packed + (0 if self.bias is None else _nbytes(self.bias))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if x.numel() == 0:  # no row to compute (a step that samples nothing)
            return x.new_empty((*lead, self.out_features))
        y = onednn_product(x.reshape(-1, self.in_features), self.packed, self.bias, self.tiles)
        return y.reshape(*lead, self.out_features)


class PackedBf16Linear(PackedLinear):
    """Only oneDNN's packed bf16 copy; bf16 in and out, sums in float32 inside oneDNN."""

    __slots__ = ()
    dtype = torch.bfloat16
    tiles = BF16_TILE_ROWS


def on_onednn(proj: Linear) -> bool:
    """Whether this projection's products of MIN_PACKED_ROWS rows and more run on oneDNN."""
    return isinstance(proj, OneDnnLinear | PackedLinear)


def onednn_product(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: tuple[int, ...] = TILE_ROWS,
) -> torch.Tensor:
    """oneDNN's product of a 2-D `x` and a plain or packed weight, whatever the row count, in
    row tiles of the sizes in `tiles`."""
    rows = x.shape[0]
    parts = []
    for start, size in row_tiles(rows, tiles):
        if start + size <= rows:
            parts.append(
                torch.ops.mkldnn._linear_pointwise(
                    x[start : start + size], weight, bias, "none", [], ""
                )
            )
        else:  # the last, short tile: padded with zeros to the smallest size
            pad = x.new_zeros((size, x.shape[1]))
            pad[: rows - start] = x[start:]
            parts.append(
                torch.ops.mkldnn._linear_pointwise(pad, weight, bias, "none", [], "")[
                    : rows - start
                ]
            )
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _check_cpu_matrix(w: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    if w.dim() != 2 or w.dtype != dtype or w.device.type != "cpu":
        name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"only 2-D {name} CPU weights run on this oneDNN kind, got {tuple(w.shape)} "
            f"{w.dtype} on {w.device}"
        )


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def row_tiles(rows: int, sizes: tuple[int, ...] = TILE_ROWS) -> list[tuple[int, int]]:
    """(start, size) of each tile covering `rows` rows: as many of the largest size as fit, then
    at most one of each smaller size, then one smallest tile that runs past the end (padded)."""
    tiles, start = [], 0
    while rows - start >= sizes[0]:
        tiles.append((start, sizes[0]))
        start += sizes[0]
    for size in sizes[1:]:
        if rows - start >= size:
            tiles.append((start, size))
            start += size
    if start < rows:
        tiles.append((start, sizes[-1]))
    return tiles
