"""A GPTQ or AWQ checkpoint checked before the loader builds a projection: every shape and dtype
from the files' headers first, then GPTQ's g_idx (a few bytes an input), read and checked."""

from __future__ import annotations

import torch
from sloserve.errors import CheckpointError
from sloserve.models.gptq_awq import PackedScheme, expected_tensors
from sloserve.models.gptq_awq_projection import act_order
from sloserve.models.quant_check import (
    TensorSource,
    check_expected,
    expert_names,
    projection_groups,
)
from sloserve.models.spec import ModelSpec


def check_packed(spec: ModelSpec, src: TensorSource, scheme: PackedScheme, read) -> int:
    """CheckpointError naming the tensor or field at the first thing sloserve cannot load;
    `read(name, shape, dtype)` reads the g_idx tensors, after every header has been checked.
    Returns how many quantized Linears the model keeps in float (MoE routers and experts)."""
    if src.has("lm_head.qweight"):
        raise CheckpointError(
            f"{src.folder}: lm_head is quantized; sloserve reads an unquantized LM head "
            "(quantize without lm_head)"
        )
    act_ordered, in_float = [], 0
    for i in range(spec.num_layers):
        if i in spec.moe_layers:
            for name in expert_names(spec, i):
                if src.has(name + ".qweight"):
                    _check_module(src, name, _expert_shape(spec, name), scheme, kept=False)
                    in_float += 1
        for group in projection_groups(spec, i):
            quantized = {src.has(module + ".qweight") for module, _ in group}
            if len(quantized) > 1:
                names = ", ".join(module for module, _ in group)
                raise CheckpointError(
                    f"{src.folder}: {names} are not all quantized; sloserve fuses them into one "
                    "projection"
                )
            for module, shape in group:
                _check_module(src, module, shape, scheme if True in quantized else None)
            if True in quantized and src.has(group[0][0] + ".g_idx"):
                act_ordered.append(group)
    for group in act_ordered:
        _check_g_idx(src, group, scheme, read)
    return in_float


def _expert_shape(spec: ModelSpec, name: str) -> tuple[int, int]:
    """[out, in] of a router or routed expert's Linear (a name from quant_check.expert_names)."""
    h, inter = spec.hidden_size, spec.moe_intermediate_size
    last = name.rsplit(".", 1)[1]
    if last == "gate":
        return (spec.num_experts, h)
    if last == "shared_expert_gate":
        return (1, h)
    return (h, inter) if last in ("w2", "down_proj") else (inter, h)


def _check_module(
    src: TensorSource,
    module: str,
    shape: tuple[int, int],
    scheme: PackedScheme | None,
    *,
    kept: bool = True,
) -> None:
    if scheme is None:
        expected = {"weight": (shape, ())}
    else:
        try:
            expected = expected_tensors(scheme, *shape, kept=kept)
        except ValueError as exc:
            raise CheckpointError(
                f"{src.folder}: {module} ({scheme.describe()}) cannot run: {exc}"
            ) from None
        if scheme.method == "gptq" and src.has(module + ".g_idx"):
            expected["g_idx"] = ((shape[1],), (torch.int32, torch.int64))
    check_expected(src, module, expected)


def _check_g_idx(src: TensorSource, group: list, scheme: PackedScheme, read) -> None:
    """The fused modules' g_idx are one order, whose groups hold group_size inputs each."""
    in_f = group[0][1][1]
    names = [module + ".g_idx" for module, _ in group]
    if not all(src.has(name) for name in names):
        raise CheckpointError(f"{src.folder}: {', '.join(names)} are not all present")
    first = read(names[0], (in_f,), None)
    try:
        act_order(first, scheme.group_size or in_f)
    except ValueError as exc:
        raise CheckpointError(f"{src.folder}: {group[0][0]}: {exc}") from None
    for name in names[1:]:
        if not (read(name, (in_f,), None) == first).all():
            raise CheckpointError(
                f"{src.folder}: {name} differs from {names[0]}; sloserve fuses these projections "
                "and runs one input order for them (GPTQ gives modules that share an input the "
                "same order)"
            )
