"""A checkpoint's `quantization_config` by its `quant_method`: compressed-tensors
(models/compressed_tensors.py), GPTQ and AWQ (models/gptq_awq.py); what the loader asks of each."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from sloserve.errors import CheckpointError
from sloserve.layers.linear import Linear
from sloserve.models import compressed_tensors
from sloserve.models.compressed_tensors import QuantConfig
from sloserve.models.ct_projection import build_projection
from sloserve.models.gptq_awq import PackedScheme, read_awq_config, read_gptq_config
from sloserve.models.gptq_awq_check import check_packed
from sloserve.models.gptq_awq_projection import build_packed, dequantized
from sloserve.models.quant_check import check_quantized as check_compressed
from sloserve.models.spec import ModelSpec, read_json

log = logging.getLogger(__name__)

METHODS = ("compressed-tensors", "gptq", "awq")
# The files AutoGPTQ and AutoAWQ save beside a config.json without `quantization_config`
SIDE_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))

# A checked quantization_config: describe() for logs and info, dequantized_at_load()
CheckpointQuant = QuantConfig | PackedScheme


def read_quant_config(folder: Path) -> CheckpointQuant | None:
    """The checked `quantization_config` of `folder/config.json` (None: an unquantized checkpoint)."""
    path = folder / "config.json"
    raw = read_json(path).get("quantization_config")
    where = f"{path}: quantization_config"
    for name, method in SIDE_FILES:
        if raw is None and (folder / name).is_file():
            path = folder / name
            raw = {"quant_method": method, **read_json(path)}
            where = f"{path}: {name.removesuffix('.json')}"
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where} must be a JSON object")
    method = raw.get("quant_method")
    if method == "gptq":
        return read_gptq_config(raw, where)
    if method == "awq":
        return read_awq_config(raw, where)
    if method != "compressed-tensors":
        raise CheckpointError(
            f"{where}.quant_method {method!r} is not supported; sloserve reads {', '.join(METHODS)}"
        )
    return compressed_tensors.read_quant_config(folder)


def check_quantized(spec: ModelSpec, src, quant: CheckpointQuant) -> None:
    """CheckpointError naming the tensor or field at the first thing sloserve cannot load."""
    if isinstance(quant, PackedScheme):
        in_float = check_packed(spec, src, quant, lambda n, s, dt: src.get(n, s, dtype=dt))
        if in_float:
            log.info(
                "%s: %d quantized MoE router and expert Linears have no packed kind: "
                "dequantized at load into the model's dtype",
                quant.label,
                in_float,
            )
    else:
        check_compressed(spec, src, quant)


def quantized_projection(
    quant: CheckpointQuant,
    src,
    modules: list[str],
    shapes: list[tuple[int, int]],
    dtype: torch.dtype,
    bias: torch.Tensor | None,
    make_dense: Callable[[torch.Tensor, torch.Tensor | None], Linear],
) -> Linear | None:
    """The projection of the Linears `modules` (joined along their output rows) in the kind their
    quantization keeps; None where the checkpoint stores them unquantized."""

    def read(name: str, shape: tuple[int, ...], dt: torch.dtype | None) -> torch.Tensor:
        return src.get(name, shape, dtype=dt)

    if isinstance(quant, PackedScheme):
        if not src.has(modules[0] + ".qweight"):
            return None
        return build_packed(read, src.has, modules, shapes, quant, dtype, bias)
    scheme = quant.scheme_for(modules[0])
    if scheme is None:
        return None
    return build_projection(read, modules, shapes, scheme, dtype, bias, make_dense)


def float_weight(
    quant: CheckpointQuant, src, name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor | None:
    """The weight `name` dequantized into `dtype` where the checkpoint quantizes a Linear the
    model keeps in float (a GPTQ or AWQ folder's MoE routers and routed experts); else None."""
    module = name.removesuffix(".weight")
    if not isinstance(quant, PackedScheme) or len(shape) != 2 or not src.has(module + ".qweight"):
        return None

    def read(tensor: str, shape: tuple[int, ...], dt: torch.dtype | None) -> torch.Tensor:
        return src.get(tensor, shape, dtype=dt)

    return dequantized(read, src.has, module, (shape[0], shape[1]), quant, dtype)
