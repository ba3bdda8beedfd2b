"""compressed-tensors' int-quantized W8A8: int8 weight rows, each activation row quantized as it comes.

`TokenW8A8Linear` reads what `Int8Linear` reads (int8 [out, in], a float32 scale per output row)
and rounds the activations the way the checkpoint's reference does, at every row count: each row's
scale is its absmax / 127.5 (compressed-tensors' symmetric int8 range, -128..127), the values
rounded half to even and clamped to -128..127, the int32 sums of `torch._int_mm` scaled by both
scales. `Int8Linear` (--quantization int8) divides by 127 and runs weight-only at 2-4 rows: its
tokens drift from a W8A8 checkpoint's reference.
"""

from __future__ import annotations

import torch
from sloserve.layers.quant import Int8Linear, rescale

# float32's machine epsilon: the scale of an all-zero row (compressed-tensors' choice)
_EPS = torch.finfo(torch.float32).eps


class TokenW8A8Linear(Int8Linear):
    """`Int8Linear`'s int8 rows and scales, activations quantized per token as compressed-tensors does."""

    __slots__ = ()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        if x2.shape[0] == 0:  # no row to compute (a step that samples nothing)
            return x.new_empty((*lead, self.out_features))
        xs = x2.abs().amax(dim=1) / 127.5
        xs = torch.where(xs == 0, _EPS, xs)
        xq = torch.round(x2 / xs[:, None]).clamp_(-128, 127).to(torch.int8)
        y = rescale(torch._int_mm(xq, self.qweight.t()), xs, self.scale, self.bias, x.dtype)
        return y.reshape(*lead, self.out_features)
