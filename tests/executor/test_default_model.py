"""Built-in models: built deterministically once, cached, loadable by the runner."""

from __future__ import annotations

import pytest
from safetensors import safe_open
from sloserve.models.default import cache_root, ensure_default_model
from sloserve.models.spec import load_spec


def test_default_moe_is_built_once_and_deterministic(tmp_path, monkeypatch):
    a = ensure_default_model("default-moe", tmp_path / "a")
    assert a.name == "default-moe-v1" and not list((tmp_path / "a").glob(".default-moe-*"))
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model("default-moe", tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rebuilt
    b = ensure_default_model("default-moe", tmp_path / "b")
    name = "model.layers.3.block_sparse_moe.experts.7.w2.weight"
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        assert fa.get_tensor(name).equal(fb.get_tensor(name))
    spec = load_spec(a)
    assert spec.architecture == "MixtralForCausalLM" and spec.num_experts == 8 and spec.top_k == 2


def test_cache_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "sloserve"


def test_unknown_builtin_model():
    with pytest.raises(ValueError, match="default, default-moe"):
        ensure_default_model("gigantic")


def test_default_moe_runs(tmp_path, monkeypatch):
    from sloserve.config import ModelConfig, SchedulerConfig, SloserveConfig
    from sloserve.executor import ModelRunner

    from tests.executor.driver import generate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runner = ModelRunner(SloserveConfig(model=ModelConfig(path="default-moe", max_model_len=256),
                                        scheduler=SchedulerConfig(max_batch=4, max_batched_tokens=256)))
    prompt = runner.tokenizer.encode("Input:\n12\n34\nOutput:\n")
    out = generate(runner, [prompt, prompt], 4)
    assert out[0] == out[1] and len(out[0]) == 4
    assert runner.info()["parameters"] > 5_000_000
