"""A malformed or mismatched adapter is refused, before any tensor is read, with the field named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sloserve.config import ConfigError, LoraConfig
from sloserve.errors import AdapterError, UnknownAdapterError
from sloserve.lora import LoraRegistry
from sloserve.models.spec import load_spec


def _registry(base: Path, *, max_rank: int = 256, lora_dir: Path | None = None) -> LoraRegistry:
    spec = load_spec(base)
    return LoraRegistry(
        spec, torch.float32, torch.device("cpu"), max_rank, lora_dir and str(lora_dir)
    )


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_good_adapter_loads_with_its_rank_and_scale_folded(make_checkpoint, make_lora):
    base, path = make_checkpoint("llama"), make_lora("llama", rank=8, seed=1)
    registry = _registry(base)
    adapter = registry.load("a", str(path), trusted=True)
    assert registry.names() == ["a"] and adapter.rank == 8
    # q, k, v land on their rows of the fused projection: [0, 64), [64, 96), [96, 128)
    assert [(lo, hi) for lo, hi, *_ in adapter.layers[0]["qkv"].parts] == [
        (0, 64),
        (64, 96),
        (96, 128),
    ]
    assert [(lo, hi) for lo, hi, *_ in adapter.layers[1]["gate_up"].parts] == [(0, 128), (128, 256)]
    tensors = load_file(path / "adapter_model.safetensors")
    b = tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    assert torch.equal(adapter.layers[0]["qkv"].parts[1][4], b * 2.0)  # alpha 2r: scale 2
    with pytest.raises(AdapterError, match="already loaded"):
        registry.load("a", str(path), trusted=True)
    registry.unload("a")
    with pytest.raises(UnknownAdapterError):
        registry.unload("a")


def test_a_rank_above_the_cap_is_refused_naming_the_flag(make_checkpoint, make_lora):
    path = make_lora("llama", rank=64, seed=2)
    with pytest.raises(
        AdapterError, match=r"r must be an integer in \[1, 32\] \(--max-lora-rank\)"
    ):
        _registry(make_checkpoint("llama"), max_rank=32).load("a", str(path), trusted=True)


def test_modules_the_base_lacks_or_not_yet_supported_are_refused_by_name(
    make_checkpoint, make_lora, tmp_path
):
    base, path = make_checkpoint("llama"), make_lora("llama", rank=8, seed=1)
    renamed = _copy(path, tmp_path / "renamed")
    tensors = load_file(renamed / "adapter_model.safetensors")
    tensors = {k.replace("q_proj", "qq_proj"): v for k, v in tensors.items()}
    save_file(tensors, str(renamed / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="module 'qq_proj', which the base model"):
        _registry(base).load("a", str(renamed), trusted=True)
    saved = _copy(path, tmp_path / "saved")
    _edit_config(saved, modules_to_save=["lm_head", "score"])
    with pytest.raises(AdapterError, match="modules_to_save may name embed_tokens and lm_head"):
        _registry(base).load("a", str(saved), trusted=True)
    with pytest.raises(AdapterError, match="MoE family MixtralForCausalLM"):
        _registry(make_checkpoint("mixtral")).load("a", str(path), trusted=True)


def test_an_adapter_for_another_base_model_is_refused_naming_the_tensor(make_checkpoint, make_lora):
    other = make_checkpoint("llama", intermediate_size=96)
    path = make_lora("llama", rank=8, seed=1)
    with pytest.raises(
        AdapterError, match=r"down_proj.lora_A.weight' has shape \[8, 128\], .* need \[8, 96\]"
    ):
        _registry(other).load("a", str(path), trusted=True)
    deeper = make_checkpoint("llama", num_hidden_layers=1)
    with pytest.raises(AdapterError, match="is for layer 1, but the base model has 1 layers"):
        _registry(deeper).load("a", str(path), trusted=True)


def test_files_that_are_not_safetensors_or_incomplete_are_refused(
    make_checkpoint, make_lora, tmp_path
):
    base, path = make_checkpoint("llama"), make_lora("llama", rank=8, seed=1)
    pickled = _copy(path, tmp_path / "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(
        AdapterError, match=r"found adapter_model.bin\): sloserve reads safetensors"
    ):
        _registry(base).load("a", str(pickled), trusted=True)
    garbage = _copy(path, tmp_path / "garbage")
    (garbage / "adapter_model.safetensors").write_bytes(b"\x80\x04not a safetensors file")
    with pytest.raises(AdapterError, match="is not a safetensors file"):
        _registry(base).load("a", str(garbage), trusted=True)
    half = _copy(path, tmp_path / "half")
    tensors = load_file(half / "adapter_model.safetensors")
    del tensors["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
    save_file(tensors, str(half / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="up_proj.lora_B.weight' is missing"):
        _registry(base).load("a", str(half), trusted=True)
    no_config = _copy(path, tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="has no adapter_config.json"):
        _registry(base).load("a", str(no_config), trusted=True)
    dora = _copy(path, tmp_path / "dora")
    _edit_config(dora, use_dora=True)
    with pytest.raises(AdapterError, match="use_dora must be False"):
        _registry(base).load("a", str(dora), trusted=True)


def test_api_paths_must_lie_under_lora_dir(make_checkpoint, make_lora, adapter_root, tmp_path):
    base, path = make_checkpoint("llama"), make_lora("llama", rank=8, seed=1)
    with pytest.raises(AdapterError, match="needs --lora-dir"):
        _registry(base).load("a", str(path))
    registry = _registry(base, lora_dir=adapter_root)
    registry.load("a", path.name)  # relative to --lora-dir
    outside = _copy(path, tmp_path / "outside")
    for bad in (str(outside), f"../{outside.parent.name}/outside", "/etc"):
        with pytest.raises(AdapterError, match="outside --lora-dir"):
            registry.load("b", bad)
    assert registry.names() == ["a"]


def test_lora_config_flags_are_checked():
    assert LoraConfig(lora_modules="a=/x, b=/y").modules == (("a", "/x"), ("b", "/y"))
    with pytest.raises(ConfigError, match="name=path pairs"):
        LoraConfig(lora_modules="a")
    with pytest.raises(ConfigError, match="each adapter once"):
        LoraConfig(lora_modules="a=/x a=/y")
    with pytest.raises(ConfigError, match="max_lora_rank must be in"):
        LoraConfig(max_lora_rank=0)


def test_embedding_and_head_parts_are_checked_before_loading(make_checkpoint, make_lora, tmp_path):
    path = make_lora("llama", rank=8, seed=6, targets=("q_proj", "embed_tokens", "lm_head"))
    base = make_checkpoint("llama")
    adapter = _registry(base).load("a", str(path), trusted=True)
    assert adapter.embed is not None and adapter.head is not None
    wider = make_checkpoint("llama", vocab_size=300)
    with pytest.raises(
        AdapterError,
        match=r"lm_head.base_layer.weight' has shape \[260, 64\].*vocabulary 300.*\[300, 64\]",
    ):
        _registry(wider).load("a", str(path), trusted=True)
    half = _copy(path, tmp_path / "half")
    tensors = load_file(half / "adapter_model.safetensors")
    del tensors["base_model.model.lm_head.lora_B.weight"]
    save_file(tensors, str(half / "adapter_model.safetensors"))
    with pytest.raises(
        AdapterError, match=r"the LoRA on lm_head needs both A and B, found \['A'\]"
    ):
        _registry(base).load("a", str(half), trusted=True)


def test_adapters_on_a_tied_base_s_embedding_or_head_are_refused(make_checkpoint, make_lora):
    from sloserve.lora import BaseHead

    tied = make_checkpoint("llama", tie_word_embeddings=True)
    path = make_lora("llama", rank=8, seed=7, targets=("q_proj", "lm_head"))
    registry = LoraRegistry(
        load_spec(tied), torch.float32, torch.device("cpu"), 256, None, BaseHead(True, None, None)
    )
    with pytest.raises(AdapterError, match="ties lm_head to embed_tokens"):
        registry.load("a", str(path), trusted=True)
