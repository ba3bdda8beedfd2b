"""The adapter is part of the prefix-cache key: two adapters (or an adapter and the base model)
never share KV blocks; two requests of one adapter do; a reloaded name starts afresh."""

from __future__ import annotations

from sloserve.sampling_params import SamplingParams

from tests.lora.adapters import merged_greedy
from tests.lora.test_oracle import _llm

PROMPT = [256, *((i * 11) % 250 for i in range(39))]  # 10 full blocks of 4
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def test_adapters_never_share_blocks_and_one_adapter_does(make_checkpoint, make_lora):
    base = make_checkpoint("llama")
    paths = {"a": make_lora("llama", rank=8, seed=1), "b": make_lora("llama", rank=8, seed=2)}
    with _llm(base, paths) as llm:
        first_a = llm.generate([PROMPT], PARAMS, adapter="a")[0]
        again_a = llm.generate([PROMPT], PARAMS, adapter="a")[0]
        first_b = llm.generate([PROMPT], PARAMS, adapter="b")[0]
        first_base = llm.generate([PROMPT], PARAMS)[0]
        again_base = llm.generate([PROMPT], PARAMS)[0]
        again_b = llm.generate([PROMPT], PARAMS, adapter="b")[0]
        # the same name loaded again (here: other weights) finds none of its earlier blocks
        llm.unload_lora("a")
        llm.load_lora("a", str(paths["b"]))
        reloaded = llm.generate([PROMPT], PARAMS, adapter="a")[0]
    hit = len(PROMPT) - 1
    assert [first_a.num_cached_tokens, again_a.num_cached_tokens] == [0, hit]
    assert [first_b.num_cached_tokens, again_b.num_cached_tokens] == [0, hit]
    assert [first_base.num_cached_tokens, again_base.num_cached_tokens] == [0, hit]
    assert reloaded.num_cached_tokens == 0
    tokens = {"a": first_a, "b": first_b, None: first_base}
    for name, out in tokens.items():
        want = merged_greedy(base, paths.get(name), (tuple(PROMPT),), 4)[0]
        assert out.token_ids == want, name
    assert again_a.token_ids == first_a.token_ids and again_b.token_ids == first_b.token_ids
    assert reloaded.token_ids == first_b.token_ids
