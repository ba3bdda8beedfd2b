"""int8 projections: the weight quantized at load, held once as int8 rows with a scale per row.

`Int8Linear` keeps the plain [out, in] int8 weight and a float32 scale per output channel
(symmetric: absmax / 127), the layout a fused decode step reads too. Products by row count,
chosen by measurement (`benchmarks/cpu_int8.py`, docs/design/cpu-decode.md "int8 on the CPU"):

- W8A8 (1 row, and 5 rows and more): each activation row quantized to int8 with a scale of its
  own (per token, dynamic), `torch._int_mm` sums in int32, the sums scaled by both scales;
- W8A16 (2 to 4 rows): torch's `_weight_int8pack_mm`, the activation as it is (bf16 or float32)
  against the int8 weight, each output scaled by its channel's scale (rounded to the
  activation's dtype); the only row counts where it measured faster than W8A8.

Both kernels read the same plain int8 weight; neither needs another copy. An embedding [vocab,
hidden] is such a weight too: `lookup` gathers its rows (a tied LM head is the same object, so one
int8 copy serves both). `_int_mm` runs
oneDNN's s8 GEMM, dispatched on the CPU's features (VNNI or AMX where present, plain AVX2/AVX-512
int8 arithmetic without, slower), so nothing here needs an instruction set to run.
"""

from __future__ import annotations

import torch
from sloserve.hotpath import USING_EXTENSIONS

try:
    if not USING_EXTENSIONS:
        raise ImportError("SLOSERVE_NO_EXTENSIONS forces the torch ops")
    from sloserve.hotpath._cpu_ops import int8_rescale as _rescale
except ImportError:  # not built, or forced off: the torch ops in `_w8a8`
    _rescale = None

# Row counts whose products run weight-only (W8A16); every other count quantizes its activations too.
W8A16_ROWS = range(2, 5)
# Products (rows x columns) whose W8A8 rescale runs in C: the one-thread pass wins only on products
# this large (docs/design/cpu-decode.md, "int8 on the CPU" and the peers section).
RESCALE_C_ELEMENTS = 1 << 21
# Rows of a weight quantized at a time at load: the float32 temporaries stay this small.
_QUANTIZE_ROWS = 4096


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row (absmax / 127, round half to even) and each row's float32 scale."""
    t = t.float()
    scale = t.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(t / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear:
    """The int8 weight [out, in] with a float32 scale per output row; W8A8 or W8A16 by row count."""

    __slots__ = ("qweight", "scale", "bias", "out_features", "in_features")

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        if qweight.dim() != 2 or qweight.dtype != torch.int8 or qweight.device.type != "cpu":
            raise ValueError(
                f"Int8Linear takes a 2-D int8 CPU weight, got {tuple(qweight.shape)} "
                f"{qweight.dtype} on {qweight.device}"
            )
        self.qweight, self.scale, self.bias = qweight.contiguous(), scale.float(), bias
        self.out_features, self.in_features = qweight.shape

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """Quantize a float weight [out, in] a few thousand rows at a time (peak memory stays low)."""
        if weight.dim() != 2 or not weight.is_floating_point() or weight.device.type != "cpu":
            raise ValueError(
                f"int8 quantizing takes a 2-D float CPU weight, got {tuple(weight.shape)} "
                f"{weight.dtype} on {weight.device}"
            )
        out_f, in_f = weight.shape
        qweight = torch.empty((out_f, in_f), dtype=torch.int8)
        scale = torch.empty(out_f, dtype=torch.float32)
        with torch.inference_mode():
            for start in range(0, out_f, _QUANTIZE_ROWS):
                rows = slice(start, start + _QUANTIZE_ROWS)
                qweight[rows], scale[rows] = quantize_rows(weight[rows])
        return cls(qweight, scale, bias)

    @property
    def weight(self) -> None:
        return None

    def dequantized(self) -> torch.Tensor:
        """The float32 weight these int8 rows stand for (tests and references; not kept)."""
        return self.qweight.float() * self.scale[:, None]

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of this weight as an embedding: int8 rows times their scales, in `dtype`."""
        rows = self.qweight.index_select(0, ids.reshape(-1)).float()
        rows = rows * self.scale.index_select(0, ids.reshape(-1))[:, None]
        return rows.to(dtype).reshape(*ids.shape, self.in_features)

    def nbytes(self) -> int:
        tensors = (self.qweight, self.scale, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:  # no row to compute (a step that samples nothing)
            return x.new_empty((*lead, self.out_features))
        if x2.shape[0] in W8A16_ROWS:
            y = torch._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scale.to(x.dtype))
            if self.bias is not None:
                y = y + self.bias
        else:
            y = self._w8a8(x2)
        return y.reshape(*lead, self.out_features)

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x quantized per token, int32 sums, rescaled to x's dtype (+ bias)."""
        xq, xs = quantize_rows(x)
        return rescale(torch._int_mm(xq, self.qweight.t()), xs, self.scale, self.bias, x.dtype)


def rescale(
    acc: torch.Tensor,
    xs: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`(acc * (xs[:, None] * ws)).to(dtype) + bias`: a W8A8 product's int32 sums [rows, cols]
    scaled by each row's (token's) and each column's (channel's) float32 scale.

    NOTE: a product of RESCALE_C_ELEMENTS or more takes one C pass where built (the same bits):
    torch's ops make three temporaries of the product's size. The pass runs on one thread, so on
    smaller products torch's two threads are as fast or faster (docs/design/cpu-decode.md).
    """
    if (
        _rescale is not None
        and acc.numel() >= RESCALE_C_ELEMENTS
        and dtype in (torch.float32, torch.bfloat16)
        and (bias is None or (bias.dtype == dtype and bias.is_contiguous()))
        and acc.is_contiguous()
        and xs.dtype == ws.dtype == torch.float32
        and xs.is_contiguous()
        and ws.is_contiguous()
        and not torch.compiler.is_compiling()
    ):
        out = torch.empty(acc.shape, dtype=dtype)
        rows, cols = acc.shape
        _rescale(
            acc.data_ptr(),
            xs.data_ptr(),
            ws.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            cols,
            dtype == torch.bfloat16,
        )
        return out
    y = (acc * (xs[:, None] * ws)).to(dtype)
    return y if bias is None else y + bias
