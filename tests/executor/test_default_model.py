"""Built-in models: the shipped trained 'default'; random ones built deterministically once, cached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from sloserve.models.default import TRAINED_DIR, cache_root, ensure_default_model
from sloserve.models.spec import load_spec

HELDOUT = json.loads((Path(__file__).parent / "heldout_arc.json").read_text())["items"]


def test_default_moe_is_built_once_and_deterministic(tmp_path, monkeypatch):
    a = ensure_default_model("default-moe", tmp_path / "a")
    assert a.name == "default-moe-v2" and not list((tmp_path / "a").glob(".default-moe-*"))
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model("default-moe", tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rebuilt
    b = ensure_default_model("default-moe", tmp_path / "b")
    name = "model.layers.3.block_sparse_moe.experts.7.w2.weight"
    with (
        safe_open(str(a / "model.safetensors"), "pt") as fa,
        safe_open(str(b / "model.safetensors"), "pt") as fb,
    ):
        assert fa.get_tensor(name).equal(fb.get_tensor(name))
    spec = load_spec(a)
    assert spec.architecture == "MixtralForCausalLM" and spec.num_experts == 8 and spec.top_k == 2


def test_cache_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "sloserve"


def test_unknown_builtin_model():
    with pytest.raises(ValueError, match="default, default-moe, default-random"):
        ensure_default_model("gigantic")


def test_default_moe_runs(tmp_path, monkeypatch):
    from sloserve.config import ModelConfig, SchedulerConfig, SloserveConfig
    from sloserve.executor import ModelRunner

    from tests.executor.driver import generate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runner = ModelRunner(
        SloserveConfig(
            model=ModelConfig(path="default-moe", max_model_len=256),
            scheduler=SchedulerConfig(max_batch=4, max_batched_tokens=256),
        )
    )
    prompt = runner.tokenizer.encode("Input:\n12\n34\nOutput:\n")
    out = generate(runner, [prompt, prompt], 4)
    assert out[0] == out[1] and len(out[0]) == 4
    assert runner.info()["parameters"] > 5_000_000


def test_default_is_the_shipped_checkpoint(tmp_path):
    folder = ensure_default_model("default", tmp_path)
    assert folder == TRAINED_DIR and not list(tmp_path.iterdir())  # nothing built or cached
    assert (folder / "model.safetensors").stat().st_size <= 25 * 2**20
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (folder / name).is_file(), name
    spec = load_spec(folder)
    assert spec.architecture == "LlamaForCausalLM" and spec.vocab_size == 264


@pytest.mark.timeout(120)
def test_trained_default_answers_heldout_arc_with_grids_and_eos():
    """Greedy answers to three ARC tasks it never trained on are grids (digit rows of one width) + EOS."""
    from sloserve.bench.arc import parse_grid_text
    from sloserve.llm import LLM
    from sloserve.sampling_params import SamplingParams

    with LLM(
        "default", device="cpu", max_model_len=1024, kv_pool_bytes=16 * 2**20, swap_bytes=0
    ) as llm:
        outs = llm.generate([h["prompt"] for h in HELDOUT], SamplingParams(max_tokens=64))
        eos = llm.tokenizer.eos_token_id
    for item, out in zip(HELDOUT, outs, strict=True):
        assert out.finish_reason == "stop" and out.token_ids[-1] == eos, (item["task_id"], out.text)
        assert parse_grid_text(out.text) is not None, (item["task_id"], out.text)
