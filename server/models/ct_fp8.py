"""compressed-tensors' `float-quantized` FP8 (e4m3) weights: the scheme checked, each weight
dequantized at load (a CPU has no FP8 arithmetic); the loader hands it on in the model's dtype, or
to `--quantization int8`.

The format stores `weight` (float8_e4m3fn [out, in]) and `weight_scale` (float32): one for the
tensor ([1]), one per output row ([out, 1]) or one per block of rows x columns
([ceil(out / rows), ceil(in / columns)]); w = weight * scale. FP8 activations (`input_activations`
of type float) are not emulated: on a CPU they stay in the model's dtype, and the log says so.
"""

from __future__ import annotations

import math

import torch
from sloserve.errors import CheckpointError

STRATEGIES = ("tensor", "channel", "block")


def fp8_scale_shape(strategy: str, block: tuple[int, int] | None, out_f: int, in_f: int):
    """The shape `weight_scale` has for a weight [out_f, in_f]."""
    if strategy == "tensor":
        return (1,)
    if strategy == "channel":
        return (out_f, 1)
    assert block is not None
    return (math.ceil(out_f / block[0]), math.ceil(in_f / block[1]))


def check_fp8_weights(weights: object, activations: object, at: str) -> tuple[str, tuple | None]:
    """(strategy, block) of a float-quantized group, or CheckpointError naming the field."""
    if not isinstance(weights, dict):
        raise CheckpointError(f"{at}.weights must be an object")
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise CheckpointError(
            f"{at}.weights: float-quantized holds FP8 e4m3; sloserve reads type float, num_bits 8 "
            f"(got type {weights.get('type')!r}, num_bits {weights.get('num_bits')!r})"
        )
    strategy = weights.get("strategy")
    if strategy not in STRATEGIES:
        raise CheckpointError(
            f"{at}.weights.strategy {strategy!r} is not supported for FP8; sloserve reads "
            f"{', '.join(STRATEGIES)}"
        )
    if weights.get("dynamic"):
        raise CheckpointError(f"{at}.weights.dynamic is true; weights must be quantized statically")
    block = None
    if strategy == "block":
        raw = weights.get("block_structure")
        if not (
            isinstance(raw, list)
            and len(raw) == 2
            and all(isinstance(b, int) and b > 0 for b in raw)
        ):
            raise CheckpointError(
                f"{at}.weights.block_structure {raw!r} must be [rows, columns] of positive ints"
            )
        block = (raw[0], raw[1])
    if activations and (
        not isinstance(activations, dict)
        or activations.get("type") != "float"
        or activations.get("num_bits") != 8
    ):
        raise CheckpointError(
            f"{at}.input_activations {activations!r}: with FP8 weights sloserve reads FP8 "
            "activations (type float, num_bits 8) or none"
        )
    return strategy, block


def fp8_dequantized(
    weight: torch.Tensor, scale: torch.Tensor, strategy: str, block: tuple[int, int] | None
) -> torch.Tensor:
    """The float32 weight an FP8 one with its scales stands for."""
    w = weight.float()
    if strategy == "block":
        assert block is not None
        rows = scale.repeat_interleave(block[0], dim=0)[: w.shape[0]]
        scale = rows.repeat_interleave(block[1], dim=1)[:, : w.shape[1]]
    return w.mul_(scale.float())
