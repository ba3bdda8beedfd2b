"""Dense projections on a CPU through oneDNN, with the weights packed once at load.

torch's CPU `F.linear` calls MKL's sgemm, which on AMD CPUs takes its non-Intel (AVX2) path;
oneDNN (bundled with torch, dispatched on CPU features, not on the vendor) runs AVX-512 there,
about twice as fast (docs/design/cpu-decode.md, `benchmarks/cpu_gemm.py`). oneDNN is fastest
on weights reordered to its blocked layout, so
`PackedLinears` holds that copy of every dense projection next to the plain one. The plain
weights stay: the fused decode kernel, tensor-parallel shards, GPUs and `torch.compile` read them.
Memory: the dense projections are held twice on a CPU (`--cpu-gemm blas` holds them once).

oneDNN builds (and caches) a primitive for every row count it sees, each holding memory of its
own, so memory grows with every new row count. So a product runs in row tiles of the few sizes
in TILE_ROWS (the last one padded): the memory stops growing after the first pass, at a little
less speed than one untiled call (docs/design/cpu-decode.md). Each tile is an OpenMP region,
which under passive waiting wakes the second thread.

Numerics: oneDNN sums in another order than MKL, so logits differ in the last bits. A row's
result does not depend on how many rows share a packed product (measured from 1 to 1024 rows);
products of fewer than MIN_PACKED_ROWS rows run MKL, whose sums differ from oneDNN's (MKL's own
one-row product already differed from its many-row one).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

CPU_GEMMS = ("auto", "onednn", "blas")

# The packed layout is chosen for products of about this many rows (the largest tile); products of
# other sizes read it correctly, at most a little slower.
_PACK_ROWS_HINT = 512
# Row tiles of a packed product, largest first (see the module docstring).
TILE_ROWS = (512, 256, 128, 64, 32, 16)
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
    if device.type != "cpu" or dtype != torch.float32:
        return f"oneDNN packing serves float32 on a CPU (this model runs {dtype} on {device.type})"
    if not onednn_available():
        return "this torch build has no oneDNN linear operators"
    return None


class PackedLinears:
    """oneDNN-packed copies of dense projection weights, looked up by the plain tensor."""

    def __init__(self, weights: Iterable[torch.Tensor]) -> None:
        # id(plain) -> (plain, packed): holding the plain tensor keeps its id from being reused
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.inference_mode():
            for w in weights:
                if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
                    raise ValueError(
                        f"only 2-D float32 CPU weights are packed, got {tuple(w.shape)} {w.dtype} "
                        f"on {w.device}"
                    )
                self._packed[id(w)] = (
                    w,
                    torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _PACK_ROWS_HINT),
                )

    def __len__(self) -> int:
        return len(self._packed)

    def nbytes(self) -> int:
        """Bytes of the plain weights the packed copies mirror (the packed ones take about as many)."""
        return sum(w.numel() * w.element_size() for w, _ in self._packed.values())

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        """F.linear(x, w, b) for a 2-D float32 CPU `x`, through the packed copy of `w` when one exists."""
        if (
            torch.compiler.is_compiling()  # traced graphs keep torch's own linear
            or x.dim() != 2
            or x.shape[0] < MIN_PACKED_ROWS
            or id(w) not in self._packed
        ):
            return F.linear(x, w, b)
        return self.packed_product(x, w, b)

    def packed_product(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        """oneDNN's product on the packed copy of `w`, whatever the row count, in tiles of TILE_ROWS."""
        packed, rows = self._packed[id(w)][1], x.shape[0]
        parts = []
        for start, size in row_tiles(rows):
            if start + size <= rows:
                parts.append(
                    torch.ops.mkldnn._linear_pointwise(
                        x[start : start + size], packed, b, "none", [], ""
                    )
                )
            else:  # the last, short tile: padded with zeros to the smallest size
                pad = x.new_zeros((size, x.shape[1]))
                pad[: rows - start] = x[start:]
                parts.append(
                    torch.ops.mkldnn._linear_pointwise(pad, packed, b, "none", [], "")[
                        : rows - start
                    ]
                )
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def row_tiles(rows: int) -> list[tuple[int, int]]:
    """(start, size) of each tile covering `rows` rows: as many of the largest size as fit, then
    at most one of each smaller size, then one smallest tile that runs past the end (padded)."""
    tiles, start = [], 0
    while rows - start >= TILE_ROWS[0]:
        tiles.append((start, TILE_ROWS[0]))
        start += TILE_ROWS[0]
    for size in TILE_ROWS[1:]:
        if rows - start >= size:
            tiles.append((start, size))
            start += size
    if start < rows:
        tiles.append((start, TILE_ROWS[-1]))
    return tiles
