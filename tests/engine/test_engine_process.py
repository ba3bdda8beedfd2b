"""The engine in a process of its own (MPEngineClient): same tokens as the offline LLM, refusals and
aborts across the boundary, and a lifecycle that fails fast and never leaks the process."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
from sloserve.engine.mp_client import MPEngineClient
from sloserve.errors import EngineDeadError
from sloserve.llm import LLM
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SLO, SamplingParams

pytestmark = pytest.mark.timeout(180)


def _config(model, **sched) -> SloserveConfig:
    return SloserveConfig(
        model=ModelConfig(path=str(model), device="cpu", max_model_len=256),
        cache=CacheConfig(kv_pool_bytes=256 * 8192),
        scheduler=SchedulerConfig(**sched),
    )


async def _collect(stream) -> tuple[list[int], list]:
    outs = [o async for o in stream]
    return [t for o in outs for t in o.new_token_ids], outs


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


async def test_greedy_tokens_equal_the_offline_llm_and_everything_is_freed(tiny_llama):
    prompts = [[1, *range(5 + i, 25 + 3 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM(config=_config(tiny_llama, admission_control=False)) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    engine = MPEngineClient(_config(tiny_llama))
    await engine.start()
    try:
        assert engine.ready and engine.alive and engine.model_info["max_model_len"] == 256
        assert engine.tokenizer.encode("ab")[-2:] == [97, 98]
        streams = [
            engine.add_request(NewRequest(f"r{i}", p, params)) for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*(_collect(s) for s in streams))
        assert [tokens for tokens, _ in results] == expected
        assert all(outs[-1].finish_reason == "length" for _, outs in results)
        stats = engine.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0
    finally:
        await engine.stop()
    assert _gone(engine.pid, 10)


async def test_refusals_invalid_requests_and_aborts_cross_the_boundary(tiny_llama):
    engine = MPEngineClient(_config(tiny_llama, max_waiting=1))
    await engine.start()
    try:
        bad = await _collect(
            engine.add_request(NewRequest("bad", [10**6], SamplingParams(max_tokens=2)))
        )
        assert bad[1][-1].error_kind == "invalid" and "outside the vocabulary" in bad[1][-1].error
        late = await _collect(
            engine.add_request(
                NewRequest(
                    "late",
                    [1, 2, 3],
                    SamplingParams(),
                    SLO(e2e_s=1.0),
                    arrival_time=time.monotonic() - 5,
                )
            )
        )
        assert (
            late[1][-1].error_kind == "refused" and late[1][-1].refusal_reason == "deadline_passed"
        )
        long = engine.add_request(
            NewRequest("long", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
        )
        first = await long.__anext__()
        assert first.new_token_ids and engine.abort("long")
        rest = [o async for o in long]
        assert rest[-1].finish_reason == "cancelled"
        for _ in range(100):  # stats arrive with the next engine message
            stats = engine.stats()
            if stats.kv_blocks_free == stats.kv_blocks_total:
                break
            await asyncio.sleep(0.02)
        assert stats.kv_blocks_free == stats.kv_blocks_total
    finally:
        await engine.stop()


async def test_a_killed_engine_fails_every_live_request_within_a_second(tiny_llama):
    engine = MPEngineClient(_config(tiny_llama))
    await engine.start()
    try:
        streams = [
            engine.add_request(
                NewRequest(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=240, ignore_eos=True))
            )
            for i in range(4)
        ]
        for stream in streams:
            await stream.__anext__()
        killed = time.monotonic()
        os.kill(engine.pid, signal.SIGKILL)
        for stream in streams:
            with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
                async for _ in stream:
                    pass
        assert time.monotonic() - killed < 1.0
        assert not engine.alive and "SIGKILL" in engine.dead_reason
        with pytest.raises(EngineDeadError):
            engine.add_request(NewRequest("after", [1, 2], SamplingParams()))
    finally:
        await engine.stop()


async def test_a_checkpoint_that_cannot_load_is_a_value_error_and_leaves_no_process(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    engine = MPEngineClient(SloserveConfig(model=ModelConfig(path=str(folder), device="cpu")))
    with pytest.raises(ValueError):
        await engine.start()
    assert _gone(engine.pid, 10)
    await engine.stop()
