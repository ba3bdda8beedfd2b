"""GPTQ and AWQ checkpoints of the tiny test models, packed here as the tools pack them, and their
oracle: the same weights dequantized in plain torch, w = (v - z) * scale, in float32.

gptqmodel, auto-gptq and autoawq build CUDA kernels (or pin a CUDA torch) and do not install on
this CPU, so each weight is quantized round-to-nearest (min-max per group, GPTQ's own min-max
quantizer without its error feedback, which changes the values chosen, not their layout) and packed
following the libraries' documented packing, read (not copied) from:

- GPTQ: AutoGPTQ/AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda.py, `QuantLinear.__init__`
  (buffer shapes, g_idx = i // group_size) and `QuantLinear.pack` (qweight words along the input
  dim, fields lowest bits first; v1's `zeros -= 1` before qzeros are packed along the output dim);
  ModelCloud/GPTQModel gptqmodel/utils/model.py, `convert_gptq_v1_to_v2_format_module` (gptq_v2's
  zero points are v1's plus one) and gptqmodel/quantization/config.py (`checkpoint_format`,
  `dynamic` with "-:" for modules left unquantized);
- AWQ: casper-hansen/AutoAWQ awq/modules/linear/gemm.py, `WQLinear_GEMM.__init__` and
  `from_linear` (qweight [in, out / 8], order_map [0, 2, 4, 6, 1, 3, 5, 7], qzeros the same way),
  and awq/utils/packing_utils.py (AWQ_REVERSE_ORDER).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from tests.checkpoints import tiny_checkpoint

# every Linear of the attention and of a dense MLP (a shared expert's and routed experts' not)
DENSE = r".*(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj$"
ATTENTION = r".*self_attn\.(q|k|v|o)_proj$"
# the attention, dense MLPs, shared and routed experts (not the routers, whose few rows the
# tools leave alone)
EXPERTS = r".*_proj$|.*\.w[123]$"
# projections fused into one (they share an input, so GPTQ orders their inputs alike)
_FUSED = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Packing:
    """One GPTQ or AWQ scheme, as its quantization_config says."""

    method: str = "gptq"
    bits: int = 4
    group_size: int = 32  # -1: per channel
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"
    targets: str = DENSE

    def config(self) -> dict:
        """The `quantization_config` transformers' GPTQConfig / AwqConfig save."""
        if self.method == "awq":
            return {
                "quant_method": "awq",
                "bits": self.bits,
                "group_size": self.group_size,
                "zero_point": True,
                "version": "gemm",
                "backend": "autoawq",
                "modules_to_not_convert": ["experts", "gate"]
                if self.targets == ATTENTION
                else None,
            }
        config = {
            "quant_method": "gptq",
            "bits": self.bits,
            "group_size": self.group_size,
            "desc_act": self.desc_act,
            "sym": self.sym,
            "damp_percent": 0.01,
            "true_sequential": True,
            "static_groups": False,
            "lm_head": False,
            "checkpoint_format": self.checkpoint_format,
        }
        if self.targets == ATTENTION:
            config["dynamic"] = {"-:.*(mlp|block_sparse_moe)\\..*": {}}
        return config


def _quantized(weight, packing: Packing, perm):
    """(values [out, in], scale [out, groups] float16-rounded, zero [out, groups], g_idx [in]) of
    a float32 weight, its inputs grouped in `perm`'s order."""
    import torch

    out_f, in_f = weight.shape
    size = in_f if packing.group_size == -1 else packing.group_size
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[perm] = torch.arange(in_f, dtype=torch.int32) // size
    grouped = weight[:, perm].reshape(out_f, -1, size)
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    maxq = 2**packing.bits - 1
    if packing.sym:
        scale = torch.maximum(-low, high) * 2 / maxq
        zero = torch.full_like(scale, (maxq + 1) // 2, dtype=torch.int32)
    else:
        scale = (high - low) / maxq
        zero = torch.round(-low / scale).to(torch.int32)
        # NOTE: v1 stores z - 1 in bits fields: a zero point of 0 would wrap (the format's known
        # overflow, which its kernels read as 2^bits), so these checkpoints keep z >= 1
        zero = zero.clamp(1 if packing.checkpoint_format == "gptq" else 0, maxq)
    scale = scale.clamp(min=1e-4).half().float()
    per_input = scale[:, g_idx.long()], zero[:, g_idx.long()]
    values = torch.clamp(torch.round(weight / per_input[0]) + per_input[1], 0, maxq)
    return values.to(torch.int32), scale, zero, g_idx


def _pack(fields, bits: int):
    """int32 words of `fields` [..., n] (0..2^bits - 1) along the last dim, lowest bits first."""
    import torch

    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (fields.to(torch.int64).unflatten(-1, (-1, per_word)) << shifts).sum(-1)
    # uint32 -> int32 with wrap-around, as numpy's astype(np.int32) in AutoGPTQ's pack
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def packed_tensors(module: str, weight, packing: Packing, perm) -> tuple[dict, object]:
    """The checkpoint tensors of one quantized Linear, and its dequantized weight (float32)."""
    import torch

    values, scale, zero, g_idx = _quantized(weight, packing, perm)
    dequantized = (values - zero[:, g_idx.long()]) * scale[:, g_idx.long()]
    scales = scale.t().contiguous().half()
    if packing.method == "awq":
        order = torch.tensor(_AWQ_ORDER)
        columns = torch.arange(values.shape[0]).reshape(-1, 8)[:, order].reshape(-1)
        tensors = {
            "qweight": _pack(values.t()[:, columns], 4),
            "qzeros": _pack(zero.t()[:, columns], 4),
            "scales": scales,
        }
    else:
        stored = zero - (1 if packing.checkpoint_format == "gptq" else 0)
        tensors = {
            "qweight": _pack(values, packing.bits).t(),
            "qzeros": _pack(stored.t(), packing.bits),
            "scales": scales,
            "g_idx": g_idx,
        }
    return {f"{module}.{k}": v.contiguous() for k, v in tensors.items()}, dequantized


def packed_checkpoint(arch: str, tmp_root: Path, packing: Packing, **overrides) -> Path:
    """Folder of a GPTQ or AWQ checkpoint of the tiny `arch` model (built once per arguments),
    inside it `dequantized/`: the same model as an ordinary float32 checkpoint, each quantized
    weight replaced by its dequantized value."""
    import torch
    from safetensors.torch import load_file, save_file

    base = tiny_checkpoint(arch, tmp_root, **overrides)
    key = json.dumps([base.name, packing.config(), packing.targets], sort_keys=True)
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    folder = Path(tmp_root) / f"{packing.method}-{arch}-{digest}"
    if (folder / "config.json").is_file():
        return folder
    tensors, perms = load_file(base / "model.safetensors"), {}
    oracle = dict(tensors)
    gen = torch.Generator().manual_seed(1)
    for name in sorted(tensors):
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or not re.fullmatch(packing.targets, module):
            continue
        in_f = tensors[name].shape[1]
        owner = module.rsplit(".", 1)[0] + "." + _FUSED.get(module.rsplit(".", 1)[1], "")
        shared = owner if owner.endswith("_proj") else module
        if shared not in perms:
            perms[shared] = (
                torch.randperm(in_f, generator=gen) if packing.desc_act else torch.arange(in_f)
            )
        packed, oracle[name] = packed_tensors(module, tensors.pop(name), packing, perms[shared])
        tensors.update(packed)
    staging = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(base, staging, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(base, staging / "dequantized", ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(oracle, staging / "dequantized" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((staging / "config.json").read_text())
    config["quantization_config"] = packing.config()
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.rename(folder)
    return folder


def dequantized_model(folder: Path):
    """transformers' float32 model of the folder's dequantized twin (its oracle)."""
    from tests.checkpoints import load_hf_model

    return load_hf_model(folder / "dequantized")
