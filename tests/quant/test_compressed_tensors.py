"""compressed-tensors `pack-quantized` folders made by compressed-tensors itself: greedy tokens at
float32 equal transformers' fake-quantized model, each projection kept in its quantized kind, and
every refusal names the field and what is supported, before a tensor is read."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from sloserve.errors import CheckpointError
from sloserve.layers.int4 import Int4Linear
from sloserve.layers.quant import Int8Linear
from sloserve.layers.w8a8 import TokenW8A8Linear
from sloserve.layers.w8a16 import W8A16Linear
from sloserve.models.loader import TensorSource, load_checkpoint
from sloserve.models.shard import Shard
from sloserve.models.weights import DENSE_PROJECTIONS

from tests.checkpoints import hf_greedy
from tests.executor.driver import generate
from tests.quant.checkpoints import (
    TOKEN_ACTIVATIONS,
    Scheme,
    fake_quantized_model,
    quantized_checkpoint,
)

pytest.importorskip("compressed_tensors")

_RNG = random.Random(0)
PROMPTS = [[256] + [_RNG.randrange(256) for _ in range(_RNG.randrange(1, 60))] for _ in range(6)]
NEW_TOKENS = 24

SCHEMES = {
    "w4-g32-asym": Scheme(4, 32, False),
    "w4-g64-sym": Scheme(4, 64, True),
    "w4-channel-asym": Scheme(4, None, False),
    "w8-channel-sym": Scheme(8, None, True),
    "w8-channel-asym": Scheme(8, None, False),
    "w8a8": Scheme(8, None, True, activations=True),
}


@pytest.mark.parametrize(
    ("arch", "name"),
    [("llama", n) for n in SCHEMES]
    + [("qwen2", n) for n in ("w4-g32-asym", "w8-channel-sym", "w8a8")],
)
def test_greedy_at_float32_equals_the_fake_quantized_model(root, make_runner, arch, name):
    scheme = SCHEMES[name]
    folder = quantized_checkpoint(arch, root, scheme)
    runner = make_runner(folder, dtype="float32")
    kind = TokenW8A8Linear if scheme.activations else {4: Int4Linear, 8: W8A16Linear}[scheme.bits]
    for layer in runner.model.weights.layers:
        assert all(type(getattr(layer, p)) is kind for p in DENSE_PROJECTIONS)
    # an unquantized lm_head (in `ignore`) stays as it is
    assert runner.model.weights.lm_head.weight is not None
    assert runner.info()["quantization"].startswith(f"compressed-tensors {scheme.format}: W")
    want = hf_greedy(fake_quantized_model(folder, arch, root), PROMPTS, NEW_TOKENS)
    if not scheme.activations:
        assert generate(runner, PROMPTS, NEW_TOKENS) == want
        return
    # NOTE: W8A8 rounds every activation to an int8 step: a last-bit difference in a sum (int32
    # sums here, float32 ones in the reference) can move one value across a step boundary, and a
    # rare token with it, after which the two continuations part. So the reference's tokens are
    # fed back (teacher forcing) and each position's choice compared.
    got = generate(runner, PROMPTS, NEW_TOKENS, forced=want)
    pairs = [(a, b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    print(f"W8A8 {arch}: teacher-forced agreement {agree:.4f}")
    assert agree >= 0.97


@pytest.mark.parametrize(
    "scheme",
    [Scheme(fp8="tensor"), Scheme(fp8="channel", activations=True)],
    ids=["fp8-tensor", "fp8-channel-dynamic"],
)
def test_fp8_weights_run_dequantized_at_load(root, make_runner, caplog, scheme):
    folder = quantized_checkpoint("llama", root, scheme)
    with caplog.at_level("INFO"):
        runner = make_runner(folder, dtype="float32")
    assert "converted at load into the model's dtype" in caplog.text
    assert ("FP8 activations run unquantized" in caplog.text) == scheme.activations
    assert runner.model.weights.layers[0].qkv.weight.dtype == torch.float32
    # the weights are the checkpoint's exactly; FP8 activations are not emulated on a CPU
    oracle = fake_quantized_model(folder, "llama", root, quantize_inputs=False)
    assert generate(runner, PROMPTS, NEW_TOKENS) == hf_greedy(oracle, PROMPTS, NEW_TOKENS)


def test_fp8_weights_requantize_under_the_int8_flag(root, make_runner):
    folder = quantized_checkpoint("llama", root, Scheme(fp8="channel"))
    runner = make_runner(folder, quantization="int8")
    assert type(runner.model.weights.layers[0].gate_up) is Int8Linear


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_families_with_quantized_attention(root, make_runner, arch):
    scheme = Scheme(4, 32, False, targets=("re:.*self_attn.*",))
    folder = quantized_checkpoint(arch, root, scheme)
    runner = make_runner(folder, dtype="float32")
    assert isinstance(runner.model.weights.layers[0].qkv, Int4Linear)
    want = hf_greedy(fake_quantized_model(folder, arch, root), PROMPTS, NEW_TOKENS)
    assert generate(runner, PROMPTS, NEW_TOKENS) == want


def test_int4_weights_hold_under_a_third_of_the_bf16_checkpoint(root):
    folder = quantized_checkpoint("llama", root, Scheme(4, 64, False), intermediate_size=256)
    _, weights = load_checkpoint(folder, torch.device("cpu"), torch.bfloat16)
    projections = [p for layer in weights.layers for p in layer.projections()]
    held = sum(p.nbytes() for p in projections)
    bf16 = sum(p.out_features * p.in_features * 2 for p in projections)
    assert held <= 0.33 * bf16


def test_w8a16_models_decline_the_fused_decode_step_and_say_why(root, make_runner, caplog):
    # int4 models take it (tests/quant/test_int4_decode_step.py)
    folder = quantized_checkpoint("llama", root, SCHEMES["w8-channel-sym"])
    with caplog.at_level("INFO"):
        make_runner(folder, dtype="float32")
    assert "quantized checkpoint's W8A16 and W8A8 projections run on torch's kernels" in caplog.text


def _edited(root: Path, name: str, edit) -> Path:
    """A copy of the w4-g32-asym llama folder (tensor files linked) with config.json edited."""
    source = quantized_checkpoint("llama", root, SCHEMES["w4-g32-asym"])
    folder = root / f"edited-{name}"
    folder.mkdir(exist_ok=True)
    for f in source.iterdir():
        if f.name != "config.json" and not (folder / f.name).exists():
            (folder / f.name).symlink_to(f)
    config = json.loads((source / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _weights(q: dict) -> dict:
    return q["config_groups"]["group_0"]["weights"]


def _int_quantized(q: dict, weights: dict | None = None, **activations) -> None:
    """The config edited into an int-quantized W8A8 one (with `weights` and `activations` changes)."""
    group = q["config_groups"]["group_0"]
    q["format"] = group["format"] = "int-quantized"
    _weights(q).update(num_bits=8, strategy="channel", group_size=None, symmetric=True)
    _weights(q).update(weights or {})
    group["input_activations"] = {**TOKEN_ACTIVATIONS, **activations}


def _fp8(q: dict, **weights) -> None:
    """The config edited into a float-quantized FP8 one (with `weights` changes)."""
    q["format"] = q["config_groups"]["group_0"]["format"] = "float-quantized"
    _weights(q).update({"type": "float", "num_bits": 8, "strategy": "channel", "group_size": None})
    _weights(q).update(weights)


REFUSALS = {
    "method": (
        lambda q: q.update(quant_method="fp16"),
        r"quant_method 'fp16'.*compressed-tensors, gptq, awq",
    ),
    "format": (
        lambda q: (q.update(format="naive-quantized"), q["config_groups"]["group_0"].pop("format")),
        r"format 'naive-quantized'.*pack-quantized",
    ),
    "bits": (lambda q: _weights(q).update(num_bits=3), r"num_bits 3 .*4, 8"),
    "group": (lambda q: _weights(q).update(group_size=48), r"group_size 48 .*32, 64, 128, 256"),
    "strategy": (lambda q: _weights(q).update(strategy="tensor"), r"strategy 'tensor'.*group"),
    "activations": (
        lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
        r"input_activations is set.*W4A16",
    ),
    "actorder": (lambda q: _weights(q).update(actorder="group"), r"actorder 'group'"),
    "fp8-block": (
        lambda q: _fp8(q, strategy="block", block_structure=None),
        r"block_structure None must be \[rows, columns\]",
    ),
    "fp8-int-activations": (
        lambda q: (
            _fp8(q),
            q["config_groups"]["group_0"].update(input_activations=TOKEN_ACTIVATIONS),
        ),
        r"with FP8 weights sloserve reads FP8 activations",
    ),
    "static-activations": (lambda q: _int_quantized(q, dynamic=False), r"static activation scales"),
    "w8a8-asymmetric": (
        lambda q: _int_quantized(q, weights={"symmetric": False}),
        r"int-quantized runs as int8 rows with a scale each",
    ),
    # the config says groups of 64; the files hold groups of 32
    "shape": (
        lambda q: _weights(q).update(group_size=64),
        r"weight_scale has shape \(64, 2\).*imply \(64, 1\)",
    ),
    "fused": (
        lambda q: q.update(ignore=["lm_head", "model.layers.0.self_attn.k_proj"]),
        r"q_proj, .*k_proj, .*v_proj are quantized differently",
    ),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_bad_quantization_configs_are_refused_before_any_tensor_is_read(root, monkeypatch, name):
    edit, message = REFUSALS[name]
    folder = _edited(root, name, edit)

    def no_read(*args, **kwargs):
        raise AssertionError("a tensor was read before the checkpoint was checked")

    monkeypatch.setattr(TensorSource, "get", no_read)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(folder, torch.device("cpu"), torch.float32)


def test_a_weight_shape_that_disagrees_is_refused(root, tmp_path):
    from safetensors.torch import load_file, save_file

    source = quantized_checkpoint("llama", root, SCHEMES["w4-g32-asym"])
    folder = tmp_path / "shape"
    folder.mkdir()
    for f in source.iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).symlink_to(f)
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight_shape"] = torch.tensor([64, 120])
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"down_proj.weight_shape is \[64, 120\].*\[64, 128\]"
    ):
        load_checkpoint(folder, torch.device("cpu"), torch.float32)


def test_quantization_flag_and_tensor_parallelism_are_refused_on_a_quantized_folder(
    root, make_runner
):
    folder = quantized_checkpoint("llama", root, SCHEMES["w4-g32-asym"])
    with pytest.raises(ValueError, match="--quantization int8 was given.*already quantized"):
        make_runner(folder, quantization="int8")
    with pytest.raises(CheckpointError, match="tensor parallelism does not split quantized"):
        load_checkpoint(folder, torch.device("cpu"), torch.float32, shard=Shard(0, 2))
