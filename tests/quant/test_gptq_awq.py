"""GPTQ and AWQ folders (packed as the tools pack them: tests/quant/packed_checkpoints.py): greedy
tokens at float32 equal transformers' model of the dequantized weights, each projection kept in
its packed kind, and every refusal names the field and what is supported."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from sloserve.errors import CheckpointError
from sloserve.executor.precision import bf16_units
from sloserve.layers.act_order import ActOrderLinear
from sloserve.layers.int4 import Int4Linear
from sloserve.layers.w8a16 import W8A16Linear
from sloserve.models.loader import TensorSource, load_checkpoint
from sloserve.models.weights import DENSE_PROJECTIONS

from tests.checkpoints import hf_greedy
from tests.executor.driver import generate
from tests.quant.packed_checkpoints import (
    ATTENTION,
    EXPERTS,
    Packing,
    dequantized_model,
    packed_checkpoint,
)

_RNG = random.Random(0)
PROMPTS = [[256] + [_RNG.randrange(256) for _ in range(_RNG.randrange(1, 60))] for _ in range(6)]
NEW_TOKENS = 24
# a model wide enough for groups of 128
WIDE = {"hidden_size": 128, "intermediate_size": 256}

SCHEMES = {
    "gptq-w4-g32-sym": Packing("gptq", 4, 32, sym=True),
    "gptq-w4-g32-asym-act": Packing("gptq", 4, 32, sym=False, desc_act=True),
    "gptq-w4-g64-asym-v2": Packing("gptq", 4, 64, sym=False, checkpoint_format="gptq_v2"),
    "gptq-w4-channel-asym-act": Packing("gptq", 4, -1, sym=False, desc_act=True),
    "gptq-w8-channel-sym": Packing("gptq", 8, -1, sym=True),
    "gptq-w8-channel-asym-v2": Packing("gptq", 8, -1, sym=False, checkpoint_format="gptq_v2"),
    "awq-w4-g32": Packing("awq", 4, 32, sym=False),
    "awq-w4-channel": Packing("awq", 4, -1, sym=False),
}
CASES = (
    [("llama", n, {}) for n in SCHEMES]
    + [("qwen2", n, {}) for n in ("gptq-w4-g32-asym-act", "gptq-w8-channel-sym", "awq-w4-g32")]
    + [("llama", "gptq-w4-g128-sym-act", WIDE), ("qwen2", "awq-w4-g128", WIDE)]
)
SCHEMES["gptq-w4-g128-sym-act"] = Packing("gptq", 4, 128, sym=True, desc_act=True)
SCHEMES["awq-w4-g128"] = Packing("awq", 4, 128, sym=False)


def _kind(packing: Packing):
    return W8A16Linear if packing.bits == 8 else Int4Linear


@pytest.mark.parametrize(
    ("arch", "name", "overrides"), CASES, ids=[f"{a}-{n}" for a, n, _ in CASES]
)
def test_greedy_at_float32_equals_the_dequantized_model(root, make_runner, arch, name, overrides):
    packing = SCHEMES[name]
    folder = packed_checkpoint(arch, root, packing, **overrides)
    runner = make_runner(folder, dtype="float32")
    for layer in runner.model.weights.layers:
        for p in DENSE_PROJECTIONS:
            proj = getattr(layer, p)
            # a shuffled g_idx (activation order) wraps the kind; g_idx in input order, or one
            # group a row, does not
            if packing.desc_act and 0 < packing.group_size < proj.in_features:
                assert type(proj) is ActOrderLinear
                proj = proj.inner
            assert type(proj) is _kind(packing)
    assert runner.model.weights.lm_head.weight is not None
    assert runner.info()["quantization"].startswith(("GPTQ", "AWQ"))
    want = hf_greedy(dequantized_model(folder), PROMPTS, NEW_TOKENS)
    assert generate(runner, PROMPTS, NEW_TOKENS) == want


@pytest.mark.skipif(not bf16_units(), reason="this CPU has no bf16 units: bf16 is emulated")
@pytest.mark.parametrize("name", ["gptq-w4-g32-asym-act", "gptq-w8-channel-asym-v2", "awq-w4-g32"])
def test_bf16_activations_agree_with_the_float32_reference(root, make_runner, name):
    """At bf16 (the default dtype on this CPU) every activation is rounded, so the oracle is
    teacher-forced top-1 agreement with transformers' float32 model of the dequantized weights,
    held against that model's own agreement when run in bf16."""
    folder = packed_checkpoint("llama", root, SCHEMES[name])
    runner = make_runner(folder, dtype="bfloat16")
    hf32 = dequantized_model(folder)
    want = hf_greedy(hf32, PROMPTS, NEW_TOKENS)
    ours = _agreement(generate(runner, PROMPTS, NEW_TOKENS, forced=want), want)
    hf16 = hf32.to(torch.bfloat16)
    with torch.no_grad():
        forced = [
            hf16(torch.tensor([p + w])).logits[0, len(p) - 1 : -1].argmax(-1).tolist()
            for p, w in zip(PROMPTS, want, strict=True)
        ]
    theirs = _agreement(forced, want)
    print(f"{name} bf16: teacher-forced agreement {ours:.4f}, transformers' bf16 {theirs:.4f}")
    assert ours >= min(0.99, theirs - 0.03), (ours, theirs)


def _agreement(got: list[list[int]], want: list[list[int]]) -> float:
    pairs = [(a, b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)


@pytest.mark.parametrize(
    ("arch", "packing"),
    [
        ("mixtral", Packing("gptq", 4, 32, sym=False, desc_act=True, targets=ATTENTION)),
        ("qwen2_moe", Packing("gptq", 4, 32, sym=False, desc_act=True, targets=ATTENTION)),
        ("qwen2_moe", Packing("awq", 4, 32, sym=False, targets=ATTENTION)),
    ],
    ids=["mixtral-gptq", "qwen2_moe-gptq", "qwen2_moe-awq"],
)
def test_moe_families_with_quantized_attention(root, make_runner, arch, packing):
    folder = packed_checkpoint(arch, root, packing)
    runner = make_runner(folder, dtype="float32")
    qkv = runner.model.weights.layers[0].qkv
    assert isinstance(getattr(qkv, "inner", qkv), Int4Linear)
    want = hf_greedy(dequantized_model(folder), PROMPTS, NEW_TOKENS)
    assert generate(runner, PROMPTS, NEW_TOKENS) == want


def test_int4_weights_hold_under_a_third_of_the_bf16_checkpoint(root):
    folder = packed_checkpoint("llama", root, SCHEMES["gptq-w4-g32-asym-act"], **WIDE)
    _, weights = load_checkpoint(folder, torch.device("cpu"), torch.bfloat16)
    projections = [p for layer in weights.layers for p in layer.projections()]
    held = sum(p.nbytes() for p in projections)
    bf16 = sum(p.out_features * p.in_features * 2 for p in projections)
    assert held <= 0.33 * bf16


def _edited(root: Path, name: str, source: Path, edit) -> Path:
    """A copy of `source` (tensor files linked) with its quantization_config edited."""
    folder = root / f"edited-{source.name}-{name}"
    folder.mkdir(exist_ok=True)
    for f in source.iterdir():
        if f.name != "config.json" and not (folder / f.name).exists():
            (folder / f.name).symlink_to(f)
    config = json.loads((source / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


GPTQ, AWQ = SCHEMES["gptq-w4-g32-asym-act"], SCHEMES["awq-w4-g32"]
REFUSALS = {
    "method": (
        GPTQ,
        lambda q: q.update(quant_method="bitsandbytes"),
        r"quant_method 'bitsandbytes'.*compressed-tensors, gptq, awq",
    ),
    "bits-3": (GPTQ, lambda q: q.update(bits=3), r"bits 3 is not supported; sloserve reads 4, 8"),
    "bits-2": (GPTQ, lambda q: q.update(bits=2), r"bits 2 is not supported; sloserve reads 4, 8"),
    "group": (GPTQ, lambda q: q.update(group_size=48), r"group_size 48 .*32, 64, 128, 256, -1"),
    "w8-group": (
        GPTQ,
        lambda q: q.update(bits=8, group_size=128),
        r"group_size 128 is not supported at 8 bits.*reads -1",
    ),
    "format": (
        GPTQ,
        lambda q: q.update(checkpoint_format="marlin"),
        r"checkpoint_format 'marlin'.*gptq, gptq_v2",
    ),
    "lm-head": (GPTQ, lambda q: q.update(lm_head=True), r"lm_head is true"),
    "dynamic": (
        GPTQ,
        lambda q: q.update(dynamic={"+:.*down_proj": {"bits": 8}}),
        r"dynamic has '\+:\.\*down_proj'.*exclusions only",
    ),
    "awq-gemv": (AWQ, lambda q: q.update(version="gemv"), r"version 'gemv' is not supported.*gemm"),
    "awq-bits": (AWQ, lambda q: q.update(bits=8), r"bits 8 is not supported; sloserve reads 4"),
    "awq-zero": (AWQ, lambda q: q.update(zero_point=False), r"zero_point False"),
    # the config says groups of 64; the files hold groups of 32
    "shape": (
        GPTQ,
        lambda q: q.update(group_size=64),
        r"q_proj.qzeros has shape \(2, 8\).*imply \(1, 8\)",
    ),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_bad_quantization_configs_are_refused_before_any_tensor_is_read(root, monkeypatch, name):
    packing, edit, message = REFUSALS[name]
    folder = _edited(root, name, packed_checkpoint("llama", root, packing), edit)

    def no_read(*args, **kwargs):
        raise AssertionError("a tensor was read before the checkpoint was checked")

    monkeypatch.setattr(TensorSource, "get", no_read)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(folder, torch.device("cpu"), torch.float32)


def _retensored(root: Path, source: Path, name: str, edit) -> Path:
    """A copy of `source` with its tensors edited by `edit(tensors)`."""
    from safetensors.torch import load_file, save_file

    folder = root / f"retensored-{source.name}-{name}"
    if not folder.is_dir():
        folder.mkdir()
        for f in source.iterdir():
            if f.name != "model.safetensors":
                (folder / f.name).symlink_to(f)
        tensors = load_file(source / "model.safetensors")
        edit(tensors)
        save_file(tensors, folder / "model.safetensors")
    return folder


def _swap_g_idx(tensors: dict) -> None:
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()


def _uneven_g_idx(tensors: dict) -> None:
    for n in "qkv":
        tensors[f"model.layers.1.self_attn.{n}_proj.g_idx"][:2] = 0


def _unquantized_v(tensors: dict) -> None:
    module = "model.layers.0.self_attn.v_proj"
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        del tensors[f"{module}.{suffix}"]
    tensors[module + ".weight"] = torch.zeros(32, 64)


TENSOR_REFUSALS = {
    "fused-g_idx": (_swap_g_idx, r"k_proj.g_idx differs from .*q_proj.g_idx"),
    "uneven-g_idx": (_uneven_g_idx, r"g_idx does not put 32 inputs in each group"),
    "partly-quantized": (_unquantized_v, r"q_proj, .*k_proj, .*v_proj are not all quantized"),
}


@pytest.mark.parametrize("name", TENSOR_REFUSALS)
def test_tensors_that_cannot_run_are_refused(root, name):
    edit, message = TENSOR_REFUSALS[name]
    folder = _retensored(root, packed_checkpoint("llama", root, GPTQ), name, edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(folder, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(
    ("arch", "packing"),
    [
        ("mixtral", Packing("gptq", 4, 32, sym=False, desc_act=True, targets=EXPERTS)),
        ("qwen2_moe", Packing("gptq", 4, 32, sym=True, targets=EXPERTS)),
        ("qwen2_moe", Packing("awq", 4, 32, sym=False, targets=EXPERTS)),
    ],
    ids=["mixtral-gptq", "qwen2_moe-gptq", "qwen2_moe-awq"],
)
def test_quantized_experts_are_dequantized_at_load(root, make_runner, caplog, arch, packing):
    folder = packed_checkpoint(arch, root, packing)
    with caplog.at_level("INFO"):
        runner = make_runner(folder, dtype="float32")
    assert "router and expert Linears have no packed kind: dequantized at load" in caplog.text
    want = hf_greedy(dequantized_model(folder), PROMPTS, NEW_TOKENS)
    assert generate(runner, PROMPTS, NEW_TOKENS) == want


def test_quantization_flag_is_refused_on_a_gptq_folder(root, make_runner):
    folder = packed_checkpoint("llama", root, GPTQ)
    with pytest.raises(ValueError, match="--quantization int8 was given.*already quantized.*GPTQ"):
        make_runner(folder, quantization="int8")


@pytest.mark.parametrize(
    "packing",
    [SCHEMES["gptq-w4-g32-asym-act"], SCHEMES["gptq-w8-channel-asym-v2"], SCHEMES["awq-w4-g32"]],
    ids=["gptq-w4-act", "gptq-w8", "awq-w4"],
)
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_products_at_every_row_count_equal_the_dequantized_weight(packing, rows):
    """The kinds' small-product kernels and their dequantized tiles (256 rows and more, which the
    greedy tests' prompts never reach) both see the inputs in the weight's order."""
    from sloserve.models.gptq_awq import read_awq_config, read_gptq_config
    from sloserve.models.gptq_awq_projection import build_packed

    from tests.quant.packed_checkpoints import packed_tensors

    torch.manual_seed(0)
    out_f, in_f = 96, 128
    weight = torch.randn(out_f, in_f) * 0.1
    perm = torch.randperm(in_f) if packing.desc_act else torch.arange(in_f)
    tensors, dequantized = packed_tensors("m", weight, packing, perm)
    read_config = read_awq_config if packing.method == "awq" else read_gptq_config
    scheme = read_config(packing.config(), "quantization_config")
    proj = build_packed(
        lambda n, s, dt: tensors[n] if dt is None else tensors[n].to(dt),
        tensors.__contains__,
        ["m"],
        [(out_f, in_f)],
        scheme,
        torch.float32,
        None,
    )
    assert isinstance(proj, ActOrderLinear) == packing.desc_act
    x = torch.randn(rows, in_f)
    torch.testing.assert_close(proj(x), x @ dequantized.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("packing", "side_file", "kind"),
    [(GPTQ, "quantize_config.json", ActOrderLinear), (AWQ, "quant_config.json", Int4Linear)],
    ids=["autogptq", "autoawq"],
)
def test_the_tools_own_config_files_are_read(root, packing, side_file, kind):
    """AutoGPTQ's quantize_config.json and AutoAWQ's quant_config.json (their own keys), beside a
    config.json without quantization_config."""
    source = packed_checkpoint("llama", root, packing)
    folder = root / f"side-{source.name}"
    folder.mkdir(exist_ok=True)
    for f in source.iterdir():
        if f.name != "config.json" and not (folder / f.name).exists():
            (folder / f.name).symlink_to(f)
    config = json.loads((source / "config.json").read_text())
    quant = config.pop("quantization_config")
    del quant["quant_method"]
    if packing.method == "awq":
        quant = {"w_bit": 4, "q_group_size": 32, "zero_point": True, "version": "GEMM"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / side_file).write_text(json.dumps(quant))
    _, weights = load_checkpoint(folder, torch.device("cpu"), torch.float32)
    assert type(weights.layers[1].down) is kind
    quant["bits"] = quant["w_bit"] = 3
    (folder / side_file).write_text(json.dumps(quant))
    with pytest.raises(CheckpointError, match=rf"{side_file}: \w+config.bits 3"):
        load_checkpoint(folder, torch.device("cpu"), torch.float32)
