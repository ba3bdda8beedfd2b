"""Each quantized Linear of a GPTQ or AWQ checkpoint built into its projection kind (the layouts:
models/gptq_awq.py): the packed words are unpacked a slice of output rows at a time into the
[out, in] values the kinds take, never into a float copy of the weight."""

from __future__ import annotations

from collections.abc import Callable

import torch
from sloserve.errors import CheckpointError
from sloserve.layers.act_order import ActOrderLinear
from sloserve.layers.int4 import Int4Linear
from sloserve.layers.linear import Linear
from sloserve.layers.w8a16 import W8A16Linear
from sloserve.models.gptq_awq import AWQ_ORDER, PackedScheme, expected_tensors

# Output rows unpacked at a time at load: the int32 temporaries stay this small.
_UNPACK_ROWS = 512
# AWQ's fields back in column order: field AWQ_ORDER.index(j) holds column j of each eight.
_AWQ_COLUMNS = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])

# read(name, shape, dtype): a checkpoint tensor (in its file's dtype when dtype is None)
Read = Callable[[str, tuple[int, ...], torch.dtype | None], torch.Tensor]


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 fields of int32 `words` [..., n] along the last dim, lowest bits first: [..., n * 32 / bits]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return fields.to(torch.uint8).flatten(-2)


def _values(read: Read, module: str, scheme: PackedScheme, out_f: int, in_f: int) -> torch.Tensor:
    """The unsigned values [out, in] (uint8) of `module.qweight`."""
    shape = expected_tensors(scheme, out_f, in_f)["qweight"][0]
    packed = read(module + ".qweight", shape, None)
    values = torch.empty((out_f, in_f), dtype=torch.uint8)
    if scheme.method == "gptq":
        # [in / per_word, out]: a slice of output columns is a slice of rows of the transpose
        for start in range(0, out_f, _UNPACK_ROWS):
            words = packed[:, start : start + _UNPACK_ROWS].t()
            values[start : start + _UNPACK_ROWS] = unpack_words(words, scheme.bits)
        return values
    # AWQ [in, out / 8]: eight output columns a word, in AWQ_ORDER
    for start in range(0, out_f, _UNPACK_ROWS):
        words = packed[:, start // 8 : (start + _UNPACK_ROWS) // 8]
        fields = unpack_words(words, 4).unflatten(-1, (-1, 8))[..., _AWQ_COLUMNS]
        values[start : start + _UNPACK_ROWS] = fields.flatten(-2).t()
    return values


def _zeros(read: Read, module: str, scheme: PackedScheme, out_f: int, in_f: int) -> torch.Tensor:
    """The zero points [out, groups] (int32), the format's offset added."""
    shape = expected_tensors(scheme, out_f, in_f)["qzeros"][0]
    fields = unpack_words(read(module + ".qzeros", shape, None), scheme.bits)
    if scheme.method == "awq":
        fields = fields.unflatten(-1, (-1, 8))[..., _AWQ_COLUMNS].flatten(-2)
    return fields[:, :out_f].t().to(torch.int32) + scheme.zero_offset


def act_order(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The input order that makes `g_idx`'s groups contiguous (None: they already are);
    ValueError when its groups are not `group_size` inputs each."""
    g_idx = g_idx.to(torch.int64)
    contiguous = torch.arange(g_idx.numel()) // group_size
    if torch.equal(g_idx, contiguous):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], contiguous):
        raise ValueError(f"its g_idx does not put {group_size} inputs in each group")
    return perm


def build_packed(
    read: Read,
    has: Callable[[str], bool],
    modules: list[str],
    shapes: list[tuple[int, int]],
    scheme: PackedScheme,
    dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> Linear:
    """The projection of the quantized Linears `modules` joined along their output rows (their
    g_idx, checked equal by models/gptq_awq_check.py, gives one input order for all)."""
    values, scales, zeros = [], [], []
    for module, (out_f, in_f) in zip(modules, shapes, strict=True):
        values.append(_values(read, module, scheme, out_f, in_f))
        shape = expected_tensors(scheme, out_f, in_f)["scales"][0]
        scales.append(read(module + ".scales", shape, torch.float32).t())
        zeros.append(_zeros(read, module, scheme, out_f, in_f))
    value = values[0] if len(values) == 1 else torch.cat(values)
    del values
    scale, zero = torch.cat(scales), torch.cat(zeros)
    in_f = shapes[0][1]
    perm = None
    if has(modules[0] + ".g_idx"):
        g_idx = read(modules[0] + ".g_idx", (in_f,), None)
        perm = act_order(g_idx, scheme.group_size or in_f)
    if perm is not None:
        value = value.index_select(1, perm)
    if scheme.bits == 4:
        # w = (v - z) * scale = (v - 8) * scale + (8 - z) * scale: Int4Linear's form
        proj = Int4Linear(value, scale, (8 - zero) * scale, bias, dtype)
    else:
        q = (value.to(torch.int16) - 128).to(torch.int8)
        zero_point = zero - 128
        proj = W8A16Linear(q, scale, None if not zero_point.any() else zero_point, bias)
    return proj if perm is None else ActOrderLinear(proj, perm)


def dequantized(
    read: Read,
    has: Callable[[str], bool],
    module: str,
    shape: tuple[int, int],
    scheme: PackedScheme,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A quantized Linear's weight [out, in] in `dtype`, for what the model keeps in float (MoE
    routers and routed experts, which no packed kind runs): w = (v - z) * scale, each input by
    its g_idx group, _UNPACK_ROWS rows at a time."""
    out_f, in_f = shape
    values = _values(read, module, scheme, out_f, in_f)
    zeros = _zeros(read, module, scheme, out_f, in_f)
    groups = zeros.shape[1]
    scales = read(module + ".scales", (groups, out_f), torch.float32).t()
    if has(module + ".g_idx"):
        group = read(module + ".g_idx", (in_f,), None).to(torch.int64)
        if group.numel() and (group.min() < 0 or group.max() >= groups):
            raise CheckpointError(f"{module}.g_idx names groups outside 0..{groups - 1}")
    else:
        group = torch.arange(in_f) // (scheme.group_size or in_f)
    weight = torch.empty((out_f, in_f), dtype=dtype)
    for start in range(0, out_f, _UNPACK_ROWS):
        rows = slice(start, start + _UNPACK_ROWS)
        w = (values[rows].float() - zeros[rows][:, group]) * scales[rows][:, group]
        weight[rows] = w
    return weight
