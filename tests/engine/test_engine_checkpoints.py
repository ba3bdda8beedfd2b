"""The engine on tiny real checkpoints (dense and MoE): batching, prefix hits and preemption
never change greedy tokens; abort frees everything."""

from __future__ import annotations

import asyncio
import random

import pytest
from sloserve import LLM, SamplingParams
from sloserve.engine import AsyncEngine
from sloserve.llm import build_config
from sloserve.new_request import NewRequest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(300)

BLOCK = 4
PAGE_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK  # layers * (k, v) * kv heads * head dim * fp32 * tokens


@pytest.fixture(scope="module", params=["llama", "mixtral", "qwen2_moe"])
def checkpoint(request, make_checkpoint):
    return str(make_checkpoint(request.param))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(2, 60))] for _ in range(n)]


def _solo(checkpoint: str, prompts, params) -> list[list[int]]:
    """Each prompt run alone: one request at a time, no prefix cache, no chunking."""
    with LLM(
        checkpoint,
        device="cpu",
        max_model_len=128,
        block_size=BLOCK,
        max_batch=1,
        prefix_cache=False,
        chunked_prefill=False,
    ) as llm:
        return [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]


def test_32_concurrent_requests_match_each_run_alone(checkpoint):
    prompts = _prompts(32, seed=1)
    params = [SamplingParams(max_tokens=4 + i % 13, ignore_eos=True) for i in range(32)]
    with LLM(
        checkpoint,
        device="cpu",
        max_model_len=128,
        block_size=BLOCK,
        max_batch=32,
        max_batched_tokens=256,
        prefill_chunk=48,
    ) as llm:
        batched = llm.generate(prompts, params)
        stats = llm.engine.stats()
    assert [o.token_ids for o in batched] == _solo(checkpoint, prompts, params)
    assert stats.tokens_per_step > 2  # they really ran together


def test_a_prefix_hit_gives_the_tokens_of_a_cold_run(checkpoint):
    shared = _prompts(1, seed=2)[0] * 2  # up to 120 tokens
    prompt = shared[:40] + [7, 8, 9]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM(checkpoint, device="cpu", max_model_len=128, block_size=BLOCK) as llm:
        cold = llm.generate([prompt], params)[0]
        warm = llm.generate([shared[:40] + [7, 8, 9]], params)[0]
        other = llm.generate([shared[:40] + [1, 2]], params)[0]
    assert (
        cold.num_cached_tokens == 0
        and warm.num_cached_tokens == 40
        and other.num_cached_tokens == 40
    )
    assert warm.token_ids == cold.token_ids
    assert other.token_ids == _solo(checkpoint, [shared[:40] + [1, 2]], [params])[0]


def test_repeated_block_aligned_prompts_compute_one_token_and_keep_the_shared_blocks_intact(
    checkpoint,
):
    """Attempts at one prompt of exactly 10 blocks: the warm ones compute only the last token (its
    K/V stays in the shared block), batched or alone, and give the cold run's tokens; a prompt
    that extends the prefix afterwards still gets the tokens of a run alone, so nothing wrote
    into the shared blocks."""
    prompt = _prompts(1, seed=4)[0] * 3
    prompt = (prompt * 2)[: 10 * BLOCK]
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    with LLM(checkpoint, device="cpu", max_model_len=128, block_size=BLOCK, max_batch=8) as llm:
        cold = llm.generate([prompt], params)[0]
        runner, bm = llm.engine.runner, llm.engine.scheduler.block_manager
        shared = bm.find_prefix(prompt)[0]
        kv_before = runner.kv[:, :, shared].clone()
        alone = llm.generate([prompt], params)[0]
        assert torch.equal(runner.kv[:, :, shared], kv_before)
        # beside a fresh prompt's prefill: a mixed step, the general path (alone: the decode path)
        batched = llm.generate(
            [prompt] * 4 + [[5, 6, 7]],
            [SamplingParams(max_tokens=5 + i, ignore_eos=True) for i in range(5)],
        )[:4]
        assert torch.equal(runner.kv[:, :, shared], kv_before)
        longer = llm.generate([prompt + [1, 2]], params)[0]
    assert cold.num_cached_tokens == 0 and alone.num_cached_tokens == len(prompt) - 1
    assert {o.num_cached_tokens for o in batched} == {len(prompt) - 1}
    assert alone.token_ids == cold.token_ids == _solo(checkpoint, [prompt], [params])[0]
    assert [o.token_ids for o in batched] == [cold.token_ids[: 5 + i] for i in range(4)]
    assert longer.num_cached_tokens == len(prompt)
    assert longer.token_ids == _solo(checkpoint, [prompt + [1, 2]], [params])[0]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_gives_the_tokens_of_an_uninterrupted_run(checkpoint, mode):
    prompts = _prompts(10, seed=3)
    params = [SamplingParams(max_tokens=20 + i, ignore_eos=True) for i in range(10)]
    # 40 usable blocks of 4 tokens: far fewer than the 10 requests need together.
    with LLM(
        checkpoint,
        device="cpu",
        max_model_len=128,
        block_size=BLOCK,
        kv_pool_bytes=41 * PAGE_BYTES,
        swap_bytes=64 * PAGE_BYTES,
        preemption_mode=mode,
        max_batch=10,
        adaptive_batch=False,
    ) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.engine.stats()
    assert stats.preemptions_total > 0
    assert (
        stats.kv_blocks_free == stats.kv_blocks_total
        and stats.swap_blocks_free == stats.swap_blocks_total
    )
    assert [o.token_ids for o in outs] == _solo(checkpoint, prompts, params)


async def test_abort_mid_generation_frees_everything(checkpoint):
    engine = AsyncEngine(
        build_config(checkpoint, device="cpu", max_model_len=128, block_size=BLOCK)
    )
    await engine.start()
    try:
        streams = [
            engine.add_request(
                NewRequest(f"r{i}", p, SamplingParams(max_tokens=100, ignore_eos=True))
            )
            for i, p in enumerate(_prompts(4, seed=4))
        ]
        for stream in streams:
            first = await stream.__anext__()
            assert not first.finished
        assert engine.stats().kv_blocks_free < engine.stats().kv_blocks_total
        for i in range(4):
            assert engine.abort(f"r{i}")
        for stream in streams:
            assert [o async for o in stream][-1].finish_reason == "cancelled"
        stats = engine.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0
        await asyncio.sleep(0)
    finally:
        await engine.stop()
