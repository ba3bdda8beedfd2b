"""compressed-tensors checkpoints of the tiny test models, made by compressed-tensors itself, and
their oracle: the same model with each weight fake-quantized by compressed-tensors, in float32.

A checkpoint is quantized the way llm-compressor's round-to-nearest does it (min-max observers,
compressed-tensors' `calculate_qparams`), compressed by its `ModelCompressor` and saved as users
download such folders (`save_pretrained` + `update_config`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tests.checkpoints import tiny_checkpoint


@dataclass(frozen=True)
class Scheme:
    """One weight scheme of a compressed-tensors config group."""

    bits: int = 4
    group_size: int | None = 32  # None: per channel
    symmetric: bool = False
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)
    extra: dict = field(default_factory=dict, hash=False)
    # W8A8: activations quantized per token, dynamically (format int-quantized)
    activations: bool = False
    # FP8 e4m3 weights per "tensor" or "channel" (format float-quantized), with FP8 activations
    # per token when `activations`
    fp8: str | None = None

    @property
    def format(self) -> str:
        if self.fp8:
            return "float-quantized"
        return "int-quantized" if self.activations else "pack-quantized"

    def config(self) -> dict:
        """compressed-tensors' QuantizationConfig as a plain dict."""
        weights = {
            "num_bits": self.bits,
            "type": "int",
            "symmetric": self.symmetric,
            "strategy": "channel" if self.group_size is None else "group",
            **({} if self.group_size is None else {"group_size": self.group_size}),
            **self.extra,
        }
        if self.fp8:
            weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": self.fp8}
        group = {"targets": list(self.targets), "weights": weights}
        if self.activations:
            kind = {"type": "float"} if self.fp8 else {}
            group["input_activations"] = {**TOKEN_ACTIVATIONS, **kind}
        return {"config_groups": {"group_0": group}, "ignore": list(self.ignore)}


# compressed-tensors' W8A8 preset's activations: int8 per token, scales computed as they come
TOKEN_ACTIVATIONS = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": "token",
    "dynamic": True,
}


def _minmax(weight, args):
    """Per-group (or per-row) min and max of a weight, as llm-compressor's min-max observer takes them."""
    if args.group_size:
        grouped = weight.unflatten(-1, (-1, args.group_size))
        return grouped.amin(dim=-1), grouped.amax(dim=-1)
    if args.strategy == "tensor":
        return weight.amin().reshape(1), weight.amax().reshape(1)
    return weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True)


def quantized_checkpoint(arch: str, tmp_root: Path, scheme: Scheme, **overrides) -> Path:
    """Folder of a compressed-tensors checkpoint (`scheme.format`) of the tiny `arch` model (built
    once per arguments), beside it `oracle.safetensors.bin`: the fake-quantized float32 weights."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file
    from sloserve.tokenizer import save_byte_level_tokenizer
    from transformers import AutoModelForCausalLM

    base = tiny_checkpoint(arch, tmp_root, **overrides)
    key = json.dumps([base.name, scheme.format, scheme.config()], sort_keys=True)
    folder = Path(tmp_root) / f"ct-{arch}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    if (folder / "config.json").is_file():
        return folder
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    apply_quantization_config(model, QuantizationConfig(**scheme.config()), show_progress=False)
    oracle = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            qscheme = getattr(module, "quantization_scheme", None)
            if qscheme is None:
                continue
            args = qscheme.weights
            low, high = _minmax(module.weight, args)
            scale, zero_point = calculate_qparams(low, high, args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
            oracle[name + ".weight"] = fake_quantize(
                module.weight, module.weight_scale, module.weight_zero_point, args
            ).contiguous()
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=scheme.format)
    compressor.compress_model(model)
    staging = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    compressor.update_config(staging)
    save_byte_level_tokenizer(staging, 1024)
    save_file(oracle, staging / "oracle.safetensors.bin")
    staging.rename(folder)
    return folder


def fake_quantized_model(
    folder: Path, arch: str, tmp_root: Path, *, quantize_inputs: bool = True, **overrides
):
    """transformers' float32 model of the unquantized tiny checkpoint with each quantized weight
    replaced by its fake-quantized value and, for W8A8 (`quantize_inputs`), each quantized
    Linear's input fake-quantized per token by compressed-tensors' own dynamic path (the oracle
    of the folder)."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from safetensors.torch import load_file

    from tests.checkpoints import load_hf_model

    model = load_hf_model(tiny_checkpoint(arch, tmp_root, **overrides))
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    activations = config["config_groups"]["group_0"].get("input_activations")
    args = QuantizationArgs(**activations) if activations and quantize_inputs else None

    def quantize_input(module, inputs):
        (x,) = inputs
        scale, zero_point = compute_dynamic_scales_and_zp(x, args, module)
        return (fake_quantize(x, scale, zero_point, args),)

    with torch.no_grad():
        for name, weight in load_file(folder / "oracle.safetensors.bin").items():
            params[name].copy_(weight)
            if args is not None:
                modules[name.removesuffix(".weight")].register_forward_pre_hook(quantize_input)
    return model
