"""Read a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) against a base
model's spec: every field and every tensor shape is checked before a tensor is read."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from sloserve.errors import AdapterError
from sloserve.lora.adapter import LoraAdapter, LoraDelta
from sloserve.models.spec import ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module name -> (the fused projection it is part of, which of its parts)
MODULES = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
# NOTE: adapters on these are the later work; refused by name, never silently skipped
LATER_MODULES = ("embed_tokens", "lm_head")
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


@dataclass(slots=True, frozen=True)
class AdapterConfig:
    """The fields of adapter_config.json that decide how the adapter is applied."""

    rank: int
    alpha: float
    rslora: bool

    @property
    def scale(self) -> float:
        """LoRA's alpha / r, or rsLoRA's alpha / sqrt(r)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def read_config(folder: Path, max_rank: int) -> AdapterConfig:
    """adapter_config.json, checked: a LoRA adapter of rank <= max_rank on supported modules."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(
            f"{folder} has no {CONFIG_FILE}: save the adapter with PEFT's save_pretrained"
        )
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path} must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type must be LORA, got {cfg.get('peft_type')!r}")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= max_rank:
        raise AdapterError(
            f"{path}: r must be an integer in [1, {max_rank}] (--max-lora-rank), got {rank!r}"
        )
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{path}: lora_alpha must be a finite number, got {alpha!r}")
    for key, allowed in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if cfg.get(key, allowed) not in (allowed, None):
            raise AdapterError(f"{path}: {key} must be {allowed!r}, got {cfg[key]!r}")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            raise AdapterError(f"{path}: {key} is not supported yet, got {cfg[key]!r}")
    targets = cfg.get("target_modules") or []
    named = [targets] if isinstance(targets, str) else list(targets)
    for module in LATER_MODULES:
        if any(module in str(t) for t in named):
            raise AdapterError(
                f"{path}: target_modules names {module!r}; sloserve applies LoRA to "
                f"{', '.join(MODULES)} only so far"
            )
    return AdapterConfig(rank, float(alpha), bool(cfg.get("use_rslora", False)))


def module_dims(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in features, out features) of the base model."""
    h, q, kv, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def _offsets(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Fused projection -> where each of its parts starts in its output rows."""
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    return {"qkv": (0, q, q + kv), "o": (0,), "gate_up": (0, inter), "down": (0,)}


def read_adapter(
    name: str,
    folder: Path,
    spec: ModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoraAdapter:
    """The adapter in `folder` for the base model `spec`, or AdapterError naming what is wrong."""
    if spec.moe_layers:
        raise AdapterError(
            f"LoRA adapters on the MoE family {spec.architecture} are not supported yet; "
            "serve a dense model (llama, qwen2)"
        )
    if not folder.is_dir():
        raise AdapterError(f"lora path {folder} is not a folder")
    config = read_config(folder, max_rank)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        found = ", ".join(sorted(p.name for p in folder.glob("adapter_model*"))) or "nothing"
        raise AdapterError(
            f"{folder} has no {WEIGHTS_FILE} (found {found}): sloserve reads safetensors only; "
            "save with save_pretrained(safe_serialization=True)"
        )
    try:
        with safe_open(str(path), "pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{path} is not a safetensors file: {exc}") from exc
    modules = _check_shapes(path, shapes, spec, config.rank)
    adapter = LoraAdapter(name, str(folder), config.rank)
    offsets = _offsets(spec)
    with safe_open(str(path), "pt") as f:
        by_layer: dict[int, dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]] = {}
        for layer, module, prefix in modules:
            fused, part = MODULES[module]
            a = f.get_tensor(prefix + "lora_A.weight").to(torch.float32)
            b = f.get_tensor(prefix + "lora_B.weight").to(torch.float32) * config.scale
            lo = offsets[fused][part]
            by_layer.setdefault(layer, {}).setdefault(fused, []).append((lo, a, b))
    for layer, fused_parts in by_layer.items():
        deltas = adapter.layers.setdefault(layer, {})
        for fused, parts in fused_parts.items():
            parts.sort(key=lambda p: p[0])
            a = torch.cat([p[1] for p in parts]).to(device=device, dtype=dtype)
            placed, r0 = [], 0
            for lo, part_a, b in parts:
                r1 = r0 + part_a.shape[0]
                b = b.to(device=device, dtype=dtype).contiguous()
                placed.append((lo, lo + b.shape[0], r0, r1, b))
                r0 = r1
            deltas[fused] = LoraDelta(a.contiguous(), placed)
    return adapter


def _check_shapes(
    path: Path, shapes: dict[str, tuple[int, ...]], spec: ModelSpec, rank: int
) -> list[tuple[int, str, str]]:
    """(layer, module, key prefix) of every adapted module, each with an A and a B of the shapes
    the base model and the rank need; AdapterError names the first tensor that is not."""
    dims = module_dims(spec)
    found: dict[str, tuple[int, str]] = {}
    for key in shapes:
        m = _KEY.match(key)
        if m is None:
            later = next((mod for mod in LATER_MODULES if mod in key), None)
            hint = (
                f"adapters on {later} are not supported yet"
                if later
                else f"sloserve applies LoRA to {', '.join(MODULES)} of each layer"
            )
            raise AdapterError(f"{path}: tensor {key!r} is not one sloserve can apply: {hint}")
        layer, module = int(m.group(1)), m.group(3)
        if module not in MODULES:
            raise AdapterError(
                f"{path}: tensor {key!r} targets module {module!r}, which the base model "
                f"{spec.architecture} lacks; its projections are {', '.join(MODULES)}"
            )
        if layer >= spec.num_layers:
            raise AdapterError(
                f"{path}: tensor {key!r} is for layer {layer}, but the base model has "
                f"{spec.num_layers} layers: the adapter was made for another base model"
            )
        found[key[: key.index("lora_")]] = (layer, module)
    if not found:
        raise AdapterError(f"{path} holds no LoRA tensors")
    modules = []
    for prefix, (layer, module) in sorted(found.items()):
        fan_in, fan_out = dims[module]
        for which, want in (("A", (rank, fan_in)), ("B", (fan_out, rank))):
            key = f"{prefix}lora_{which}.weight"
            if key not in shapes:
                raise AdapterError(f"{path}: {key!r} is missing (every lora_A needs its lora_B)")
            if shapes[key] != want:
                raise AdapterError(
                    f"{path}: {key!r} has shape {list(shapes[key])}, the base model and r={rank} "
                    f"need {list(want)}: the adapter was made for another base model or rank"
                )
        modules.append((layer, module, prefix))
    return modules
