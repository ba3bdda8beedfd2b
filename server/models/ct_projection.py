"""Each quantized Linear of a compressed-tensors checkpoint built into its projection kind
(the layouts: models/compressed_tensors.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from sloserve.errors import CheckpointError
from sloserve.layers.int4 import Int4Linear
from sloserve.layers.linear import Linear
from sloserve.layers.w8a8 import TokenW8A8Linear
from sloserve.layers.w8a16 import W8A16Linear
from sloserve.models.compressed_tensors import WeightScheme, expected_tensors
from sloserve.models.ct_fp8 import fp8_dequantized, fp8_scale_shape

# Rows unpacked at a time at load: the int32 temporaries stay this small.
_UNPACK_ROWS = 1024


def unpack_int32(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """Signed int8 values [rows, columns] of words packed along dim 1 (see the module docstring)."""
    per_word, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    out = torch.empty((packed.shape[0], columns), dtype=torch.int8)
    for start in range(0, packed.shape[0], _UNPACK_ROWS):
        words = packed[start : start + _UNPACK_ROWS]
        values = ((words[..., None] >> shifts) & mask).reshape(words.shape[0], -1)
        out[start : start + _UNPACK_ROWS] = values[:, :columns] - (1 << (bits - 1))
    return out


def build_projection(
    read,
    modules: list[str],
    shapes: list[tuple[int, int]],
    scheme: WeightScheme,
    dtype: torch.dtype,
    bias: torch.Tensor | None,
    make_dense: Callable[[torch.Tensor, torch.Tensor | None], Linear],
) -> Linear:
    """The projection of the quantized Linears `modules` joined along their output rows.

    `read(name, shape, dtype)` returns a checkpoint tensor (in its file's dtype when dtype is None).
    FP8 weights are dequantized into `dtype` and handed to `make_dense` (the unquantized path).
    """
    if scheme.float8:
        weight = torch.empty((sum(s[0] for s in shapes), shapes[0][1]), dtype=dtype)
        at = 0
        for module, (out_f, in_f) in zip(modules, shapes, strict=True):
            fp8 = read(module + ".weight", (out_f, in_f), None)
            shape = fp8_scale_shape(scheme.strategy, scheme.block, out_f, in_f)
            scale = read(module + ".weight_scale", shape, torch.float32)
            weight[at : at + out_f] = fp8_dequantized(fp8, scale, scheme.strategy, scheme.block)
            at += out_f
        return make_dense(weight, bias)
    if scheme.activations:
        pairs = list(zip(modules, shapes, strict=True))
        weight = torch.cat([read(m + ".weight", s, None) for m, s in pairs])
        scale = torch.cat([read(m + ".weight_scale", (s[0], 1), torch.float32) for m, s in pairs])
        return TokenW8A8Linear(weight, scale.reshape(-1), bias)
    qs, scales, zero_points = [], [], []
    for module, (out_f, in_f) in zip(modules, shapes, strict=True):
        tensors = expected_tensors(scheme, out_f, in_f)
        stored = read(module + ".weight_shape", (2,), None).tolist()
        if stored != [out_f, in_f]:
            raise CheckpointError(
                f"{module}.weight_shape is {stored}, but config.json implies {[out_f, in_f]}"
            )
        packed = read(module + ".weight_packed", tensors["weight_packed"][0], None)
        qs.append(unpack_int32(packed, scheme.bits, in_f))
        del packed
        scales.append(read(module + ".weight_scale", tensors["weight_scale"][0], torch.float32))
        if not scheme.symmetric:
            zp = read(module + ".weight_zero_point", tensors["weight_zero_point"][0], None)
            zero_points.append(unpack_int32(zp.t().contiguous(), scheme.bits, out_f).t())
    q = qs[0] if len(qs) == 1 else torch.cat(qs)
    del qs
    scale = torch.cat(scales)
    zero_point = torch.cat(zero_points) if zero_points else None
    if scheme.bits == 4:
        return Int4Linear.from_signed(q, scale, zero_point, bias, dtype)
    return W8A16Linear(q, scale, zero_point, bias)
