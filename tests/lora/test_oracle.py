"""Greedy tokens per adapter equal transformers running PEFT's merge_and_unload() of it (float32),
alone and co-batched with other adapters and base-model requests."""

from __future__ import annotations

import pytest
from sloserve import LLM
from sloserve.sampling_params import SamplingParams

from tests.lora.adapters import merged_greedy

PROMPTS = (
    (256, 72, 101, 108, 108, 111),
    (256, *range(48, 66)),
    (256, *((i * 37) % 250 for i in range(41))),
)
NEW_TOKENS = 6
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


def _llm(base, adapters: dict[str, object], **kw) -> LLM:
    modules = " ".join(f"{name}={path}" for name, path in adapters.items())
    return LLM(
        str(base),
        device="cpu",
        max_model_len=128,
        block_size=4,
        max_batch=16,
        lora_modules=modules,
        **kw,
    )


def _tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_adapter_alone_and_co_batched_equals_the_merged_model(
    make_checkpoint, make_lora, arch
):
    base = make_checkpoint(arch)
    adapters = {
        "r8": make_lora(arch, rank=8, seed=1),
        "r64": make_lora(arch, rank=64, seed=2),
        "rs64": make_lora(arch, rank=64, seed=3, rslora=True),
        "qv": make_lora(arch, rank=8, seed=4, targets=("q_proj", "v_proj")),
        "mlp": make_lora(arch, rank=16, seed=5, targets=("up_proj", "down_proj")),
    }
    want = {name: merged_greedy(base, path, PROMPTS, NEW_TOKENS) for name, path in adapters.items()}
    want[None] = merged_greedy(base, None, PROMPTS, NEW_TOKENS)
    # each adapter's tokens differ from the base model's: the tests below can fail
    assert all(want[name] != want[None] for name in adapters)
    with _llm(base, adapters) as llm:
        for name in [*adapters, None]:
            assert _tokens(llm.generate(list(PROMPTS), PARAMS, adapter=name)) == want[name], name
        names = [*adapters, None]
        # every prompt under every adapter and the base model, all in one batch
        cases = [(name, p) for name in names for p in range(len(PROMPTS))]
        outputs = llm.generate(
            [list(PROMPTS[p]) for _, p in cases], PARAMS, adapter=[name for name, _ in cases]
        )
    for (name, p), out in zip(cases, outputs, strict=True):
        assert out.token_ids == want[name][p], (name, p)


def test_an_adapter_loaded_and_unloaded_offline_serves_then_is_unknown(make_checkpoint, make_lora):
    from sloserve.errors import UnknownAdapterError

    base = make_checkpoint("llama")
    path = make_lora("llama", rank=8, seed=1)
    with _llm(base, {}) as llm:
        with pytest.raises(UnknownAdapterError, match="'late'"):
            llm.generate(list(PROMPTS[:1]), PARAMS, adapter="late")
        llm.load_lora("late", str(path))
        got = _tokens(llm.generate(list(PROMPTS), PARAMS, adapter="late"))
        llm.unload_lora("late")
        with pytest.raises(UnknownAdapterError):
            llm.generate(list(PROMPTS[:1]), PARAMS, adapter="late")
    assert got == merged_greedy(base, path, PROMPTS, NEW_TOKENS)


def test_adapters_with_speculation_give_the_merged_models_tokens(make_checkpoint, make_lora):
    """Draft rows of an adapter's request take its deltas like its other rows: n-gram drafts and
    predictions (the expected output, and a wrong one) leave every adapter's tokens unchanged."""
    base = make_checkpoint("llama")
    adapters = {
        "r8": make_lora("llama", rank=8, seed=1),
        "r64": make_lora("llama", rank=64, seed=2),
    }
    names = [*adapters, None]
    want = {name: merged_greedy(base, adapters.get(name), PROMPTS, NEW_TOKENS) for name in names}
    cases = [(name, p) for name in names for p in range(len(PROMPTS))]
    prompts = [list(PROMPTS[p]) for _, p in cases]
    right = [want[name][p] for name, p in cases]
    wrong = [[(t + 1) % 250 for t in tokens] for tokens in right]
    with _llm(base, adapters, speculation="ngram", num_speculative_tokens=4) as llm:
        counters = llm.engine.scheduler.counters
        for predictions in (None, right, wrong):
            outputs = llm.generate(
                prompts, PARAMS, adapter=[name for name, _ in cases], predictions=predictions
            )
            assert _tokens(outputs) == right
        # drafts were verified and accepted: draft rows did run with the adapters' deltas
        assert counters.spec_accepted_tokens_total >= len(cases)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_adapters_on_the_embedding_and_head_equal_the_merged_model(
    make_checkpoint, make_lora, arch
):
    """LoRA on embed_tokens and lm_head, and both saved whole (modules_to_save), alone and
    co-batched with a layers-only adapter and the base model."""
    base = make_checkpoint(arch)
    adapters = {
        "emb-head": make_lora(arch, rank=8, seed=11, targets=("q_proj", "embed_tokens", "lm_head")),
        "head64": make_lora(arch, rank=64, seed=12, targets=("lm_head",)),
        "saved": make_lora(arch, rank=8, seed=13, saved=("embed_tokens", "lm_head")),
        "layers": make_lora(arch, rank=16, seed=14),
    }
    want = {name: merged_greedy(base, path, PROMPTS, NEW_TOKENS) for name, path in adapters.items()}
    want[None] = merged_greedy(base, None, PROMPTS, NEW_TOKENS)
    assert all(want[name] != want[None] for name in adapters)
    with _llm(base, adapters) as llm:
        held = {name: llm._core.runner.lora.get(name) for name in adapters}
        # the base layers PEFT saves beside a LoRA on these modules are the model's: not held
        assert held["emb-head"].embed_weight is None and held["emb-head"].head_weight is None
        assert held["saved"].embed_weight is not None and held["saved"].head_weight is not None
        names = [*adapters, None]
        cases = [(name, p) for name in names for p in range(len(PROMPTS))]
        outputs = llm.generate(
            [list(PROMPTS[p]) for _, p in cases], PARAMS, adapter=[name for name, _ in cases]
        )
    for (name, p), out in zip(cases, outputs, strict=True):
        assert out.token_ids == want[name][p], (name, p)
