"""A quantized checkpoint checked from its files' headers before the loader reads a tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from sloserve.errors import CheckpointError
from sloserve.models.compressed_tensors import QuantConfig, WeightScheme, expected_tensors
from sloserve.models.safetensors_file import Entry
from sloserve.models.spec import ModelSpec


class TensorSource(Protocol):
    """The loader's view of a checkpoint's files, headers only (models/loader.py's TensorSource)."""

    folder: Path

    def has(self, name: str) -> bool: ...

    def entry(self, name: str) -> Entry: ...


def projection_groups(spec: ModelSpec, i: int) -> list[list[tuple[str, tuple[int, int]]]]:
    """Layer i's Linear modules (dotted names, [out, in]) in the groups the loader fuses."""
    h, p = spec.hidden_size, f"model.layers.{i}."
    attn = p + "self_attn."
    groups = [
        [(attn + "q_proj", (spec.q_size, h))]
        + [(attn + f"{n}_proj", (spec.kv_size, h)) for n in "kv"],
        [(attn + "o_proj", (h, spec.q_size))],
    ]
    if i not in spec.moe_layers:
        mlp, inter = p + "mlp.", spec.intermediate_size
    elif spec.shared_expert_intermediate_size:
        mlp, inter = p + "mlp.shared_expert.", spec.shared_expert_intermediate_size
    else:
        return groups
    groups.append([(mlp + "gate_proj", (inter, h)), (mlp + "up_proj", (inter, h))])
    groups.append([(mlp + "down_proj", (h, inter))])
    return groups


def check_quantized(spec: ModelSpec, src: TensorSource, quant: QuantConfig) -> None:
    """CheckpointError naming the tensor or field at the first thing sloserve cannot load."""
    if src.has("lm_head.weight_packed"):
        raise CheckpointError(
            f"{src.folder}: lm_head is quantized; sloserve reads an unquantized LM head "
            "(keep lm_head in quantization_config.ignore)"
        )
    for i in range(spec.num_layers):
        if i in spec.moe_layers:
            _refuse_quantized_experts(spec, src, i)
        for group in projection_groups(spec, i):
            schemes = {quant.scheme_for(module) for module, _ in group}
            if len(schemes) > 1:
                names = ", ".join(module for module, _ in group)
                raise CheckpointError(
                    f"{src.folder}: {names} are quantized differently (quantization_config "
                    "targets and ignore); sloserve fuses them into one projection"
                )
            (scheme,) = schemes
            for module, shape in group:
                _check_module(src, module, shape, scheme)


def _check_module(
    src: TensorSource, module: str, shape: tuple[int, int], scheme: WeightScheme | None
) -> None:
    if scheme is None:
        expected = {"weight": (shape, ())}
    else:
        try:
            expected = expected_tensors(scheme, *shape)
        except ValueError as exc:
            raise CheckpointError(
                f"{src.folder}: {module} ({scheme.describe()}) cannot run: {exc}"
            ) from None
        if src.has(module + ".weight_g_idx"):
            raise CheckpointError(
                f"{src.folder}: {module}.weight_g_idx is present (activation order by group); "
                "sloserve reads checkpoints without g_idx (actorder null or weight)"
            )
    check_expected(src, module, expected)


def check_expected(src: TensorSource, module: str, expected: dict) -> None:
    """Each tensor `module.suffix` in `expected` ({suffix: (shape, dtypes or ())}) has that shape
    and one of those dtypes; CheckpointError names the first that does not."""
    for suffix, (want_shape, dtypes) in expected.items():
        entry = src.entry(f"{module}.{suffix}")
        if entry.shape != want_shape:
            raise CheckpointError(
                f"{src.folder}: tensor {module}.{suffix} has shape {entry.shape}, but config.json "
                f"and quantization_config imply {want_shape}"
            )
        if dtypes and entry.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise CheckpointError(
                f"{src.folder}: tensor {module}.{suffix} is {entry.dtype}; the format stores {allowed}"
            )


def expert_names(spec: ModelSpec, i: int) -> list[str]:
    """MoE layer i's routers and routed experts' Linear modules (dotted names), which stay
    unquantized (quantized ones are not read yet)."""
    p = f"model.layers.{i}."
    prefix = p + ("block_sparse_moe." if spec.family == "mixtral" else "mlp.")
    names = [prefix + "gate", prefix + "shared_expert_gate"]
    return names + [
        f"{prefix}experts.{x}.{w}" for x in range(spec.num_experts) for w in _EXPERT_NAMES
    ]


def _refuse_quantized_experts(spec: ModelSpec, src: TensorSource, i: int) -> None:
    for name in expert_names(spec, i):
        if src.has(name + ".weight_packed"):
            raise CheckpointError(
                f"{src.folder}: {name} is quantized; sloserve reads quantized attention and "
                "dense or shared-expert MLPs only (add the routers and experts to "
                "quantization_config.ignore)"
            )


_EXPERT_NAMES = ("w1", "w2", "w3", "gate_proj", "up_proj", "down_proj")
