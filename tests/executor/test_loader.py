"""Checkpoint folders that cannot load each fail with a CheckpointError naming the file or architecture."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sloserve.errors import CheckpointError
from sloserve.models.loader import load_checkpoint, resolve_model_path
from sloserve.models.spec import load_spec


@pytest.fixture
def llama_copy(tiny_llama: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    return folder


def _load(folder: Path):
    return load_checkpoint(folder, torch.device("cpu"), torch.float32)


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_loads_and_fuses(tiny_llama):
    spec, weights = _load(tiny_llama)
    assert spec.architecture == "LlamaForCausalLM" and spec.num_kv_heads == 2
    assert weights.layers[0].qkv.weight.shape == ((4 + 2 * 2) * 16, 64)
    assert weights.layers[0].gate_up.weight.shape == (2 * 128, 64)
    assert spec.eos_token_ids == (257,)


def test_missing_config(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        _load(llama_copy)


def test_unknown_architecture_lists_supported(llama_copy):
    _edit_config(llama_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        CheckpointError,
        match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM.*Qwen2MoeForCausalLM",
    ):
        _load(llama_copy)


def test_wrong_shapes_name_the_tensor_and_file(llama_copy):
    _edit_config(llama_copy, intermediate_size=96)
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' "
        r"has shape \(128, 64\), but config\.json implies \(96, 64\)",
    ):
        _load(llama_copy)


def test_corrupt_safetensors(llama_copy):
    (llama_copy / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"
    )
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors is not a readable safetensors file"
    ):
        _load(llama_copy)


def test_no_safetensors_at_all(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"holds no \*\.safetensors file"):
        _load(llama_copy)


def _shard(folder: Path) -> None:
    """Split model.safetensors into two shards with an index, as save_pretrained does for big models."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def test_sharded_checkpoint_loads_like_the_single_file(tiny_llama, llama_copy):
    _shard(llama_copy)
    _, sharded = _load(llama_copy)
    _, single = _load(tiny_llama)
    torch.testing.assert_close(
        sharded.layers[1].qkv.weight, single.layers[1].qkv.weight, rtol=0, atol=0
    )
    torch.testing.assert_close(sharded.lm_head.weight, single.lm_head.weight, rtol=0, atol=0)


def test_missing_shard_is_named(llama_copy):
    _shard(llama_copy)
    (llama_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"shard model-00002-of-00002\.safetensors named in "
        r"model\.safetensors\.index\.json is missing",
    ):
        _load(llama_copy)


def test_missing_tensor_is_named(llama_copy):
    tensors = load_file(llama_copy / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(llama_copy / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' is missing"
    ):
        _load(llama_copy)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
            r"rope type 'yarn' is not supported; sloserve implements default, linear, llama3",
        ),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
            r"rope scaling 'llama3' lacks",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
        ({"num_key_value_heads": 3}, r"not a multiple of num_key_value_heads 3"),
        ({"hidden_size": None}, r"lacks 'hidden_size'"),
    ],
    ids=["yarn", "llama3-incomplete", "gelu", "kv-heads", "no-hidden"],
)
def test_unsupported_config_values(llama_copy, changes, message):
    _edit_config(llama_copy, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_spec(llama_copy)


def test_invalid_json_config(llama_copy):
    (llama_copy / "config.json").write_text("{ nope")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        load_spec(llama_copy)


def test_legacy_rope_scaling_keys_are_read(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg |= {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    rope = load_spec(llama_copy).rope
    assert (rope.theta, rope.type, rope.factor) == (5e5, "linear", 2.0)


def test_resolve_model_path(tmp_path, tiny_llama):
    assert resolve_model_path(tiny_llama) == tiny_llama
    with pytest.raises(CheckpointError, match=r"not a folder.*default, default-moe"):
        resolve_model_path(tmp_path / "absent")


def test_sliding_window_caps_the_context(llama_copy):
    _edit_config(llama_copy, architectures=["MistralForCausalLM"], sliding_window=128)
    spec = load_spec(llama_copy)
    assert spec.context_limit == 128 and spec.family == "llama"


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_partial_expert_residency_keeps_experts_on_the_host(make_checkpoint, arch):
    """Experts the store will copy in on demand never go to the device; everything else does."""
    folder = make_checkpoint(arch)
    meta = torch.device("meta")  # a stand-in device: whatever lands there was not kept on the host
    _, full = load_checkpoint(folder, meta, torch.float32, expert_slots=None)
    assert all(t.is_meta for pair in full.experts.values() for t in pair)
    # 4 experts: all resident
    _, all_slots = load_checkpoint(folder, meta, torch.float32, expert_slots=4)
    assert all(t.is_meta for pair in all_slots.experts.values() for t in pair)
    _, partial = load_checkpoint(folder, meta, torch.float32, expert_slots=2)
    assert partial.experts and all(
        t.device.type == "cpu" for pair in partial.experts.values() for t in pair
    )
    assert partial.embed.is_meta and all(
        layer.router.weight.is_meta and layer.qkv.weight.is_meta for layer in partial.layers
    )
    if arch == "qwen2_moe":  # the shared expert is dense: always on the device
        assert all(layer.gate_up.weight.is_meta for layer in partial.layers)
    _, cpu = load_checkpoint(folder, torch.device("cpu"), torch.float32)
    for layer, (w13, w2) in partial.experts.items():
        assert torch.equal(w13, cpu.experts[layer][0]) and torch.equal(w2, cpu.experts[layer][1])
