"""GPTQ and AWQ checkpoints: `quantization_config` read and checked, and the tensors each quantized
Linear must have (docs/design/quantized-checkpoints.md; the projections: models/gptq_awq_projection.py).

Both store unsigned values v in 0..2^bits - 1 packed into int32 words, the first in the lowest bits,
`scales` [groups, out] (float16) and zero points z packed like the values: w = (v - z) * scale.

- GPTQ (AutoGPTQ's `QuantLinear.pack`, GPTQModel's): `qweight` [in / (32 / bits), out], packed
  along the INPUT dim; `qzeros` [groups, out / (32 / bits)], packed along the output dim; `g_idx`
  [in], each input's group (i // group_size, or any order under `desc_act`). The v1 format
  (`checkpoint_format: gptq`) stores z - 1 (AutoGPTQ's `zeros -= 1` before packing; its kernels add
  the 1 back to each field, so a field of 15 reads as 16); `gptq_v2` stores z.
- AWQ GEMM (AutoAWQ's `WQLinear_GEMM.from_linear`): 4 bits only; `qweight` [in, out / 8] packed
  along the OUTPUT dim, each word's eight fields holding the output columns 0, 2, 4, 6, 1, 3, 5, 7
  of its eight; `qzeros` [groups, out / 8] packed the same way; always a zero point; no g_idx.

4 bits become `Int4Linear`, GPTQ's 8 bits per channel `W8A16Linear` (whose scale is one a row);
MoE routers and routed experts, which no packed kind runs, are dequantized at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from sloserve.errors import CheckpointError
from sloserve.layers.int4 import GROUP_SIZES, channel_group_size

GPTQ_BITS = (4, 8)
# group sizes by bit width; -1 is one group a row (per channel)
GPTQ_GROUPS = {4: (*GROUP_SIZES, -1), 8: (-1,)}
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_GROUPS = (*GROUP_SIZES, -1)
AWQ_VERSIONS = ("gemm",)
# AWQ_ORDER[k]: the output column (of each eight) that a word's field k holds
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(slots=True, frozen=True)
class PackedScheme:
    """How a GPTQ or AWQ folder quantizes each Linear it quantizes (the files say which do)."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int | None  # None: per channel
    symmetric: bool
    # added to each stored zero point: 1 for GPTQ's v1 format
    zero_offset: int
    label: str

    def groups(self, in_features: int) -> int:
        """Scales per output row for a row of `in_features` inputs."""
        return 1 if self.group_size is None else math.ceil(in_features / self.group_size)

    def dequantized_at_load(self) -> bool:
        """Never: every quantized weight is kept as its packed kind."""
        return False

    def describe(self) -> str:
        per = "per channel" if self.group_size is None else f"groups of {self.group_size}"
        sym = "symmetric" if self.symmetric else "asymmetric"
        return f"{self.label}: W{self.bits}A16 {per}, {sym}"


def _choice(key: str, value: object, supported: tuple, where: str, note: str = "") -> None:
    if value not in supported:
        raise CheckpointError(
            f"{where}.{key} {value!r} is not supported{note}; sloserve reads "
            f"{', '.join(map(str, supported))}"
        )


def read_gptq_config(raw: dict, where: str) -> PackedScheme:
    """The checked scheme of a `quant_method: gptq` config (CheckpointError naming the field)."""
    bits = raw.get("bits")
    _choice("bits", bits, GPTQ_BITS, where)
    group_size = raw.get("group_size")
    note = " at 8 bits (W8A16 keeps one scale a row)" if bits == 8 else ""
    _choice("group_size", group_size, GPTQ_GROUPS[bits], where, note)
    fmt = raw.get("checkpoint_format", raw.get("format", "gptq"))
    _choice("checkpoint_format", fmt, GPTQ_FORMATS, where)
    if raw.get("is_marlin_format"):
        raise CheckpointError(f"{where}.is_marlin_format is true; sloserve reads gptq, gptq_v2")
    pack = raw.get("pack_dtype", "int32")
    _choice("pack_dtype", pack, ("int32",), where)
    if raw.get("lm_head"):
        raise CheckpointError(
            f"{where}.lm_head is true; sloserve reads an unquantized LM head (quantize without it)"
        )
    dynamic = raw.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise CheckpointError(f"{where}.dynamic must be an object")
    for key in dynamic:
        # NOTE: "-:" entries leave modules unquantized, which the files show (no qweight); any
        # other entry changes bits or groups for some modules
        if not key.startswith("-:"):
            raise CheckpointError(
                f"{where}.dynamic has {key!r}, which changes the scheme of some modules; "
                "sloserve reads one scheme a folder (dynamic with '-:' exclusions only)"
            )
    sym = raw.get("sym", True)
    if not isinstance(sym, bool):
        raise CheckpointError(f"{where}.sym {sym!r} must be true or false")
    order = ", activation order" if raw.get("desc_act") else ""
    return PackedScheme(
        "gptq",
        bits,
        None if group_size == -1 else group_size,
        sym,
        1 if fmt == "gptq" else 0,
        f"GPTQ {fmt}{order}",
    )


def read_awq_config(raw: dict, where: str) -> PackedScheme:
    """The checked scheme of a `quant_method: awq` config (CheckpointError naming the field)."""
    bits = raw.get("bits", raw.get("w_bit"))
    _choice("bits", bits, (4,), where)
    group_size = raw.get("group_size", raw.get("q_group_size"))
    _choice("group_size", group_size, AWQ_GROUPS, where)
    version = raw.get("version", "gemm")
    version = version.lower() if isinstance(version, str) else version
    _choice("version", version, AWQ_VERSIONS, where)
    backend = raw.get("backend", "autoawq")
    _choice("backend", backend, ("autoawq",), where)
    if raw.get("zero_point", True) is not True:
        raise CheckpointError(
            f"{where}.zero_point {raw.get('zero_point')!r} is not supported; AWQ's GEMM format "
            "stores zero points (zero_point true)"
        )
    return PackedScheme("awq", 4, None if group_size == -1 else group_size, False, 0, "AWQ gemm")


def expected_tensors(
    scheme: PackedScheme, out_f: int, in_f: int, *, kept: bool = True
) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
    """suffix -> (shape, allowed dtypes) of one quantized Linear's tensors (GPTQ's `g_idx`, which
    a folder may leave out, is not among them); ValueError when the shape cannot run (`kept`: as
    a packed kind; else dequantized at load, which only needs whole words)."""
    per_word = 32 // scheme.bits
    if kept and scheme.group_size is not None and in_f % scheme.group_size:
        raise ValueError(f"its {in_f} inputs are not a multiple of group_size {scheme.group_size}")
    if kept and scheme.bits == 4:
        if scheme.group_size is None:
            channel_group_size(in_f)
        if out_f % 16:
            raise ValueError(f"int4 weights need a multiple of 16 output rows, got {out_f}")
    if in_f % per_word or out_f % per_word:
        raise ValueError(f"[{out_f}, {in_f}] does not pack into words of {per_word} values")
    groups = scheme.groups(in_f)
    words = (in_f // per_word, out_f) if scheme.method == "gptq" else (in_f, out_f // per_word)
    return {
        "qweight": (words, (torch.int32,)),
        "qzeros": ((groups, math.ceil(out_f / per_word)), (torch.int32,)),
        "scales": ((groups, out_f), _FLOATS),
    }
