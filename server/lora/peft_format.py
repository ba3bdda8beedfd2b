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
from sloserve.lora.adapter import EmbeddingDelta, LoraAdapter, LoraDelta
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
# The whole-model modules an adapter may change: by LoRA, or by saving its own matrix
# (modules_to_save, or the base layer PEFT saves beside a LoRA on them)
HEAD_MODULES = ("embed_tokens", "lm_head")
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_EMBED = "base_model.model.model.embed_tokens."
_HEAD = "base_model.model.lm_head."
# key -> (module, what it is); the shapes are checked in _check_head_shapes
_HEAD_KEYS = {
    _EMBED + "lora_embedding_A": ("embed_tokens", "A"),
    _EMBED + "lora_embedding_B": ("embed_tokens", "B"),
    _EMBED + "weight": ("embed_tokens", "weight"),
    _EMBED + "base_layer.weight": ("embed_tokens", "weight"),
    _HEAD + "lora_A.weight": ("lm_head", "A"),
    _HEAD + "lora_B.weight": ("lm_head", "B"),
    _HEAD + "weight": ("lm_head", "weight"),
    _HEAD + "base_layer.weight": ("lm_head", "weight"),
}


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
    for key in ("rank_pattern", "alpha_pattern", "trainable_token_indices"):
        if cfg.get(key):
            raise AdapterError(f"{path}: {key} is not supported yet, got {cfg[key]!r}")
    saved = cfg.get("modules_to_save") or []
    if not isinstance(saved, list) or any(m not in HEAD_MODULES for m in saved):
        raise AdapterError(
            f"{path}: modules_to_save may name {' and '.join(HEAD_MODULES)} only, got {saved!r}"
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


@dataclass(slots=True, frozen=True)
class BaseHead:
    """What an adapter on the embedding or the LM head is checked against: whether the base model
    ties them, and their plain matrices in the model's dtype (None where the model holds none,
    e.g. int8 or packed), so a base layer saved with the adapter is kept only where it differs."""

    tied: bool
    embed: torch.Tensor | None
    lm_head: torch.Tensor | None


def read_adapter(
    name: str,
    folder: Path,
    spec: ModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    base: BaseHead | None = None,
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
    head_keys = {key: _HEAD_KEYS[key] for key in shapes if key in _HEAD_KEYS}
    _check_head_shapes(path, {k: shapes[k] for k in head_keys}, spec, config.rank, base)
    modules = _check_shapes(path, {k: v for k, v in shapes.items() if k not in head_keys}, spec)
    _check_layer_shapes(path, shapes, spec, config.rank, modules, bool(head_keys))
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
        _read_head(f, head_keys, adapter, config.scale, dtype, device, base)
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


def _read_head(
    f,
    head_keys: dict[str, tuple[str, str]],
    adapter: LoraAdapter,
    scale: float,
    dtype: torch.dtype,
    device: torch.device,
    base: BaseHead | None,
) -> None:
    """The adapter's embedding and LM head parts (shapes already checked), into `adapter`."""
    found = {(module, what): key for key, (module, what) in head_keys.items()}

    def tensor(module: str, what: str) -> torch.Tensor | None:
        key = found.get((module, what))
        return None if key is None else f.get_tensor(key).to(torch.float32)

    if (a := tensor("embed_tokens", "A")) is not None:
        b = tensor("embed_tokens", "B")
        rows, expand = a.T.contiguous(), (b * scale).T.contiguous()
        adapter.embed = EmbeddingDelta(rows.to(device, dtype), expand.to(device, dtype))
    if (a := tensor("lm_head", "A")) is not None:
        b = (tensor("lm_head", "B") * scale).to(device, dtype).contiguous()
        adapter.head = LoraDelta(
            a.to(device, dtype).contiguous(), [(0, b.shape[0], 0, a.shape[0], b)]
        )
    for module in HEAD_MODULES:
        weight = tensor(module, "weight")
        if weight is None:
            continue
        weight = weight.to(device, dtype).contiguous()
        plain = (
            None if base is None else getattr(base, "embed" if module == "embed_tokens" else module)
        )
        # NOTE: PEFT saves the base layer beside a LoRA on these modules; where it is the
        # model's own matrix it changes nothing and is not held again
        if plain is not None and plain.shape == weight.shape and torch.equal(plain, weight):
            continue
        if module == "embed_tokens":
            adapter.embed_weight = weight
        else:
            adapter.head_weight = weight


def _check_head_shapes(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    spec: ModelSpec,
    rank: int,
    base: BaseHead | None,
) -> None:
    """The embedding and LM head tensors: a LoRA pair of the rank's shapes, or a whole matrix of
    the base model's vocabulary; AdapterError names the first that is not."""
    if not shapes:
        return
    if base is not None and base.tied:
        raise AdapterError(
            f"{path} changes {', '.join(sorted({_HEAD_KEYS[k][0] for k in shapes}))}, but the base "
            "model ties lm_head to embed_tokens (PEFT's merged and unmerged models disagree "
            "there): train the adapter without embed_tokens and lm_head, or on an untied base"
        )
    v, h = spec.vocab_size, spec.hidden_size
    want = {"A": {"embed_tokens": (rank, v), "lm_head": (rank, h)}, "weight": (v, h)}
    want_b = {"embed_tokens": (h, rank), "lm_head": (v, rank)}
    pairs: dict[str, set[str]] = {}
    for key, shape in sorted(shapes.items()):
        module, what = _HEAD_KEYS[key]
        expect = (
            want["weight"]
            if what == "weight"
            else (want["A"][module] if what == "A" else want_b[module])
        )
        if shape != expect:
            raise AdapterError(
                f"{path}: {key!r} has shape {list(shape)}, the base model (vocabulary {v}, hidden "
                f"{h}) and r={rank} need {list(expect)}: the adapter was made for another base "
                "model, rank or vocabulary"
            )
        if what != "weight":
            pairs.setdefault(module, set()).add(what)
    for module, have in pairs.items():
        if have != {"A", "B"}:
            raise AdapterError(
                f"{path}: the LoRA on {module} needs both A and B, found {sorted(have)}"
            )
    doubled = [m for m in HEAD_MODULES if sum(_HEAD_KEYS[k] == (m, "weight") for k in shapes) > 1]
    if doubled:
        raise AdapterError(f"{path}: {doubled[0]} is saved twice (weight and base_layer.weight)")


def _check_shapes(
    path: Path, shapes: dict[str, tuple[int, ...]], spec: ModelSpec
) -> list[tuple[int, str, str]]:
    """(layer, module, key prefix) of every adapted layer module; AdapterError names the first
    tensor that is not one sloserve applies."""
    found: dict[str, tuple[int, str]] = {}
    for key in shapes:
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(
                f"{path}: tensor {key!r} is not one sloserve can apply: it applies LoRA to "
                f"{', '.join(MODULES)} of each layer and to (or replaces) "
                f"{' and '.join(HEAD_MODULES)}"
            )
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
    return [(layer, module, prefix) for prefix, (layer, module) in sorted(found.items())]


def _check_layer_shapes(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    spec: ModelSpec,
    rank: int,
    modules: list[tuple[int, str, str]],
    has_head: bool,
) -> None:
    """Every adapted layer module has an A and a B of the shapes the base model and the rank
    need; AdapterError names the first tensor that does not."""
    if not modules and not has_head:
        raise AdapterError(f"{path} holds no LoRA tensors")
    dims = module_dims(spec)
    for _, module, prefix in modules:
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
