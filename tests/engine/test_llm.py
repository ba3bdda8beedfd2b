"""The offline API over the fake runner: batching, prompt forms, options mapping."""

from __future__ import annotations

import pytest
from sloserve import LLM, SamplingParams
from sloserve.llm import build_config

from tests.engine.fakes import FakeRunner, reference_tokens


def test_generate_batches_strings_and_token_ids():
    runner = FakeRunner(num_blocks=64, block_size=4)
    with LLM(runner=runner, max_batch=8) as llm:
        outs = llm.generate(["hello", [104, 105], "hello world"], SamplingParams(max_tokens=5))
        assert [o.token_ids for o in outs] == [
            reference_tokens(runner, list(p), 5) for p in (b"hello", [104, 105], b"hello world")
        ]
        assert outs[0].prompt_token_ids == list(b"hello")
        assert outs[0].text == "".join(map(chr, outs[0].token_ids))
        assert all(o.finish_reason == "length" for o in outs)
        assert outs[2].num_cached_tokens == 4  # 'hell' was cached by the first prompt
        single = llm.generate("hello", [SamplingParams(max_tokens=2)])
        assert single[0].token_ids == outs[0].token_ids[:2]
        with pytest.raises(ValueError, match="1 prompts"):
            llm.generate(["a"], [SamplingParams(), SamplingParams()])


def test_more_prompts_than_the_queue_cap_all_complete():
    runner = FakeRunner(num_blocks=64, block_size=4)
    with LLM(runner=runner, max_waiting=4) as llm:
        outs = llm.generate([[97 + i % 20] * 3 for i in range(30)], SamplingParams(max_tokens=2))
        assert len(outs) == 30 and all(len(o.token_ids) == 2 for o in outs)


def test_generate_passes_each_prompts_priority_to_the_engine():
    runner = FakeRunner(num_blocks=64, block_size=4)
    with LLM(runner=runner, policy="priority") as llm:
        seen: list[int] = []
        add = llm.engine.add

        def spy(new):
            add(new)
            seen.append(llm.engine.scheduler.requests[new.request_id].priority)

        llm.engine.add = spy
        outs = llm.generate(["ab", "cd", "ef"], SamplingParams(max_tokens=2), priority=[2, -1, 0])
        assert seen == [2, -1, 0] and all(len(o.token_ids) == 2 for o in outs)
        llm.generate("gh", SamplingParams(max_tokens=1), priority=7)
        assert seen[-1] == 7
        with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
            llm.generate(["a"], priority=[1, 2])


def test_options_map_onto_config_fields():
    config = build_config(
        "some/folder", max_batch=3, prefix_cache=False, swap_bytes="1MiB", device="cpu"
    )
    assert config.model.path == "some/folder" and config.model.device == "cpu"
    assert config.scheduler.max_batch == 3 and not config.cache.prefix_cache
    assert config.cache.swap_bytes == 1024**2
    with pytest.raises(ValueError, match="unknown LLM option 'max_batchh'.*max_batch"):
        build_config(max_batchh=3)
