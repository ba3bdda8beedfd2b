"""llm-compressor's compressed-tensors checkpoints: `quantization_config` read and checked, and the
tensors each quantized Linear must have (docs/design/quantized-checkpoints.md; the projections are
built in models/ct_projection.py).

`pack-quantized` stores each quantized Linear as `weight_packed` (int32 [out, ceil(in / (32 / bits))],
32 / bits signed values a word, each offset by 2^(bits - 1), the first in the lowest bits),
`weight_scale` ([out, groups], the model's dtype), `weight_zero_point` when asymmetric (int32,
packed the same way along the output rows: [ceil(out / (32 / bits)), groups]) and `weight_shape`
([out, in]); w = (q - zero_point) * scale. 4 bits become `Int4Linear`, 8 bits `W8A16Linear`.

`int-quantized` W8A8 (int8 weights with a scale per output channel, activations quantized per
token as they come) stores the int8 `weight` [out, in] as it is and `weight_scale` [out, 1]: it
becomes `TokenW8A8Linear`, `Int8Linear`'s rows and scales with the checkpoint's activation rounding.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from sloserve.errors import CheckpointError
from sloserve.layers.int4 import GROUP_SIZES, channel_group_size
from sloserve.models.ct_fp8 import check_fp8_weights, fp8_scale_shape
from sloserve.models.spec import read_json

METHODS = ("compressed-tensors",)
FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
BITS = (4, 8)
STRATEGIES = {4: ("group", "channel"), 8: ("channel",)}
# activation orders that store no g_idx (columns kept in place)
ACT_ORDERS = (None, "weight", "static")


@dataclass(slots=True, frozen=True)
class WeightScheme:
    """How one config group quantizes its Linear weights."""

    bits: int
    strategy: str  # "group" or "channel"
    group_size: int | None
    symmetric: bool
    # int-quantized W8A8: activations quantized per token, dynamically
    activations: bool = False
    # float-quantized: FP8 e4m3 weights (strategy tensor, channel or block), dequantized at load
    float8: bool = False
    block: tuple[int, int] | None = None
    fp8_activations: bool = False

    def groups(self, in_features: int) -> int:
        """Scales per output row for a row of `in_features` inputs."""
        return 1 if self.group_size is None else in_features // self.group_size

    def describe(self) -> str:
        if self.float8:
            per = (
                f"blocks of {self.block[0]}x{self.block[1]}"
                if self.block
                else f"per {self.strategy}"
            )
            acts = "; its FP8 activations run unquantized" if self.fp8_activations else ""
            return f"FP8 e4m3 weights {per}, dequantized at load{acts}"
        per = "per channel" if self.group_size is None else f"groups of {self.group_size}"
        if self.activations:
            return f"W8A8 {per}, symmetric, dynamic per-token activations"
        return f"W{self.bits}A16 {per}, {'symmetric' if self.symmetric else 'asymmetric'}"


@dataclass(slots=True, frozen=True)
class QuantConfig:
    """A compressed-tensors `quantization_config`: each group's targets and scheme, and the ignore list."""

    format: str
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]
    ignore: tuple[str, ...]

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme quantizing the Linear `module` (its dotted name); None: kept unquantized."""
        if any(_matches(p, module) for p in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(t, module) for t in targets):
                return scheme
        return None

    def dequantized_at_load(self) -> bool:
        """Whether every quantized weight is converted at load (FP8), none kept as stored."""
        return all(scheme.float8 for _, scheme in self.groups)

    def describe(self) -> str:
        schemes = sorted({s.describe() for _, s in self.groups})
        return f"compressed-tensors {self.format}: {'; '.join(schemes)}"


def _matches(pattern: str, name: str) -> bool:
    """compressed-tensors' target rule: `re:` + a regex matched at the start, else the exact name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def read_quant_config(folder: Path) -> QuantConfig | None:
    """The checked `quantization_config` of `folder/config.json` (None: an unquantized checkpoint)."""
    path = folder / "config.json"
    raw = read_json(path).get("quantization_config")
    if raw is None:
        return None
    where = f"{path}: quantization_config"
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where} must be a JSON object")
    method = raw.get("quant_method")
    if method not in METHODS:
        raise CheckpointError(
            f"{where}.quant_method {method!r} is not supported; sloserve reads "
            f"{', '.join(METHODS)} here (models/quant_formats.py reads the others)"
        )
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        raise CheckpointError(
            f"{where}.quantization_status {status!r}: sloserve reads saved compressed folders "
            "(save_pretrained(..., save_compressed=True))"
        )
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if raw.get(key):
            raise CheckpointError(f"{where}.{key} is set; sloserve reads none (leave it empty)")
    top_format = raw.get("format")
    groups_raw = raw.get("config_groups")
    if not isinstance(groups_raw, dict) or not groups_raw:
        raise CheckpointError(f"{where}.config_groups must be a non-empty object")
    groups, formats = [], set()
    for name, group in groups_raw.items():
        at = f"{where}.config_groups.{name}"
        if not isinstance(group, dict):
            raise CheckpointError(f"{at} must be an object")
        fmt = group.get("format") or top_format
        if fmt not in FORMATS:
            raise CheckpointError(
                f"{at}.format {fmt!r} is not supported; sloserve reads {', '.join(FORMATS)}"
            )
        formats.add(fmt)
        if group.get("output_activations"):
            raise CheckpointError(f"{at}.output_activations is set; sloserve quantizes no outputs")
        activations = group.get("input_activations")
        if fmt == "pack-quantized" and activations:
            raise CheckpointError(
                f"{at}.input_activations is set: pack-quantized runs weight-only schemes "
                "(W4A16, W8A16); W8A8 comes as int-quantized"
            )
        targets = group.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise CheckpointError(f"{at}.targets must be a list of names")
        if fmt == "float-quantized":
            strategy, block = check_fp8_weights(group.get("weights"), activations, at)
            scheme = WeightScheme(
                8, strategy, None, True, float8=True, block=block, fp8_activations=bool(activations)
            )
        else:
            scheme = _scheme(group.get("weights"), f"{at}.weights")
        if fmt == "int-quantized":
            scheme = _w8a8(scheme, activations, at)
        groups.append((tuple(targets), scheme))
    if len(formats) > 1:
        raise CheckpointError(
            f"{where}: config groups mix formats {sorted(formats)}; sloserve reads one per folder"
        )
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise CheckpointError(f"{where}.ignore must be a list of names")
    return QuantConfig(formats.pop(), tuple(groups), tuple(ignore))


def _scheme(weights: object, at: str) -> WeightScheme:
    if not isinstance(weights, dict):
        raise CheckpointError(f"{at} must be an object")
    if weights.get("type", "int") != "int":
        raise CheckpointError(f"{at}.type {weights.get('type')!r} is not supported; use int")
    bits = weights.get("num_bits")
    if bits not in BITS:
        raise CheckpointError(
            f"{at}.num_bits {bits!r} is not supported; sloserve runs {', '.join(map(str, BITS))}"
        )
    strategy = weights.get("strategy")
    if strategy not in STRATEGIES[bits]:
        raise CheckpointError(
            f"{at}.strategy {strategy!r} is not supported at {bits} bits; sloserve runs "
            f"{', '.join(STRATEGIES[bits])}"
        )
    group_size = None
    if strategy == "group":
        group_size = weights.get("group_size")
        if group_size not in GROUP_SIZES:
            raise CheckpointError(
                f"{at}.group_size {group_size!r} is not supported; sloserve runs "
                f"{', '.join(map(str, GROUP_SIZES))}"
            )
    if weights.get("dynamic"):
        raise CheckpointError(f"{at}.dynamic is true; weights must be quantized statically")
    if weights.get("actorder") not in ACT_ORDERS:
        raise CheckpointError(
            f"{at}.actorder {weights.get('actorder')!r} is not supported (it stores a g_idx); "
            "sloserve reads actorder null or weight"
        )
    return WeightScheme(bits, strategy, group_size, bool(weights.get("symmetric", True)))


def _w8a8(weights: WeightScheme, activations: object, at: str) -> WeightScheme:
    """An int-quantized group's scheme: what `Int8Linear` runs, or CheckpointError."""
    if weights.bits != 8 or weights.strategy != "channel" or not weights.symmetric:
        raise CheckpointError(
            f"{at}.weights: int-quantized runs as int8 rows with a scale each; sloserve reads "
            "num_bits 8, strategy channel, symmetric true"
        )
    want = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    if not isinstance(activations, dict) or any(
        activations.get(k, "int" if k == "type" else None) != v for k, v in want.items()
    ):
        raise CheckpointError(
            f"{at}.input_activations {activations!r}: sloserve reads dynamic per-token int8 "
            "activations (num_bits 8, strategy token, dynamic true, symmetric true); static "
            "activation scales are not read yet"
        )
    return WeightScheme(8, "channel", None, True, activations=True)


def expected_tensors(
    scheme: WeightScheme, out_f: int, in_f: int
) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
    """suffix -> (shape, allowed dtypes) of one quantized Linear's tensors; ValueError when the
    shape cannot run (a group that does not divide the row)."""
    if scheme.group_size is not None and in_f % scheme.group_size:
        raise ValueError(f"its {in_f} inputs are not a multiple of group_size {scheme.group_size}")
    if scheme.bits == 4:
        if scheme.group_size is None:
            channel_group_size(in_f)
        if out_f % 16:
            raise ValueError(f"int4 weights need a multiple of 16 output rows, got {out_f}")
    per_word = 32 // scheme.bits
    groups = scheme.groups(in_f)
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if scheme.float8:
        return {
            "weight": ((out_f, in_f), (torch.float8_e4m3fn,)),
            "weight_scale": (fp8_scale_shape(scheme.strategy, scheme.block, out_f, in_f), floats),
        }
    if scheme.activations:
        return {
            "weight": ((out_f, in_f), (torch.int8,)),
            "weight_scale": ((out_f, 1), floats),
        }
    tensors = {
        "weight_packed": ((out_f, math.ceil(in_f / per_word)), (torch.int32,)),
        "weight_scale": ((out_f, groups), floats),
        "weight_shape": ((2,), (torch.int32, torch.int64)),
    }
    if not scheme.symmetric:
        tensors["weight_zero_point"] = ((math.ceil(out_f / per_word), groups), (torch.int32,))
    return tensors
