"""int8 weight-only projections (W8A16), as weight-only checkpoints define them: activations unquantized.

`W8A16Linear` keeps the plain [out, in] int8 weight, a float32 scale per output row and, for an
asymmetric checkpoint, an integer zero point per row: w = (q - zero_point) * scale. Unlike
`Int8Linear` (layers/quant.py), which quantizes its activations at most row counts, it never
rounds an activation, so it computes what the checkpoint's own reference computes.

Products by row count (docs/design/cpu-decode.md "int8 on the CPU" measured both kernels: at 16
rows the int8 kernel ran x2.2 faster than bf16 tiles dequantized, at 64 x0.76 as fast):
fewer than DEQUANT_ROWS rows run torch's `_weight_int8pack_mm` on the int8 rows; more dequantize
a tile of int4.TILE_OUT output rows at a time into the activation's dtype for torch's `linear`. A zero
point subtracts zero_point * scale * sum(x) from each output, so it costs one row sum.
"""

from __future__ import annotations

import torch
from sloserve.layers.int4 import tiled_product

# Products of this many rows and more dequantize a tile at a time (see the module docstring).
DEQUANT_ROWS = 64


class W8A16Linear:
    """int8 weight [out, in], a float32 scale (and optionally a zero point) per output row."""

    __slots__ = ("qweight", "scale", "zero_scale", "bias", "out_features", "in_features")

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        if qweight.dim() != 2 or qweight.dtype != torch.int8 or qweight.device.type != "cpu":
            raise ValueError(
                f"W8A16Linear takes a 2-D int8 CPU weight, got {tuple(qweight.shape)} "
                f"{qweight.dtype} on {qweight.device}"
            )
        self.qweight, self.scale = qweight.contiguous(), scale.float().reshape(-1).contiguous()
        # zero_point * scale per row: what a zero point takes off each unit of sum(x)
        self.zero_scale = (
            None if zero_point is None else zero_point.float().reshape(-1) * self.scale
        )
        self.bias = bias
        self.out_features, self.in_features = qweight.shape

    @property
    def weight(self) -> None:
        return None

    def nbytes(self) -> int:
        tensors = (self.qweight, self.scale, self.zero_scale, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def dequantized(
        self, rows: slice = slice(None), dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The weight rows `rows` in `dtype` (a tile for a product, or a reference; never kept)."""
        w = self.qweight[rows].to(dtype) * self.scale[rows, None].to(dtype)
        if self.zero_scale is not None:
            w = w - self.zero_scale[rows, None].to(dtype)
        return w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:  # no row to compute (a step that samples nothing)
            return x.new_empty((*lead, self.out_features))
        if x2.shape[0] < DEQUANT_ROWS:
            y = torch._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scale.to(x.dtype))
            if self.zero_scale is not None:
                y = y - x2.sum(dim=1, keepdim=True) * self.zero_scale.to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = tiled_product(x2, self.dequantized, self.bias, self.out_features)
        return y.reshape(*lead, self.out_features)
