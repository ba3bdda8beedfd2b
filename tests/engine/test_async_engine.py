"""AsyncEngine over the fake runner: streaming, abort, failure isolation, death, heartbeat."""

from __future__ import annotations

import asyncio
import threading

import pytest
from sloserve.config import CacheConfig, SchedulerConfig, SloserveConfig
from sloserve.engine import AsyncEngine, output_processor
from sloserve.errors import EngineDeadError, InvalidRequestError
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams

from tests.engine.fakes import FakeRunner, reference_tokens
from tests.engine.helpers import random_prompts

pytestmark = pytest.mark.timeout(60)


def _config(**sched) -> SloserveConfig:
    return SloserveConfig(cache=CacheConfig(), scheduler=SchedulerConfig(**sched))


async def _engine(runner: FakeRunner | None = None, **sched) -> tuple[AsyncEngine, FakeRunner]:
    runner = runner or FakeRunner(num_blocks=40, block_size=4, num_host_blocks=16)
    engine = AsyncEngine(_config(**sched), runner)
    await engine.start()
    return engine, runner


async def _collect(stream) -> tuple[list[int], list]:
    outs = [o async for o in stream]
    return [t for o in outs for t in o.new_token_ids], outs


def _all_free(engine: AsyncEngine) -> bool:
    s = engine.stats()
    return (
        s.kv_blocks_free == s.kv_blocks_total
        and s.waiting == 0
        and s.running == 0
        and s.swap_blocks_free == s.swap_blocks_total
    )


async def test_concurrent_streams_match_solo_runs_and_blocks_come_back():
    engine, runner = await _engine()
    assert runner.warmed_up and engine.ready and engine.alive
    prompts = random_prompts(16, 3, 40, seed=5)
    lengths = [5 + (i * 7) % 23 for i in range(16)]
    streams = [
        engine.add_request(NewRequest(f"r{i}", p, SamplingParams(max_tokens=n)))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    results = await asyncio.gather(*(_collect(s) for s in streams))
    for (tokens, outs), prompt, n in zip(results, prompts, lengths, strict=True):
        assert tokens == reference_tokens(runner, prompt, n)
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert outs[-1].first_token_time >= outs[-1].first_scheduled_time >= outs[-1].arrival_time
        assert "".join(o.new_text for o in outs) == "".join(map(chr, tokens))
    stats = engine.stats()
    assert stats.preemptions_total > 0 and stats.requests_finished_total == 16
    assert stats.generated_tokens_total == sum(lengths) and stats.tokens_per_step > 1
    assert _all_free(engine)
    for _ in range(200):  # the executor is told about every finished request (it drops their state)
        told = {rid for out in runner.steps for rid in out.finished_req_ids}
        if len(told) == 16:
            break
        await asyncio.sleep(0.01)
    assert told == {f"r{i}" for i in range(16)}
    await engine.stop()


async def test_abort_mid_generation_frees_everything_and_ends_the_stream():
    permits = threading.Semaphore(0)  # one permit = one step: "a" cannot finish before the abort
    runner = FakeRunner(num_blocks=40, block_size=4)
    original = runner.execute

    def stepped(out):
        assert permits.acquire(timeout=30), "the test never released this step"
        return original(out)

    runner.execute = stepped
    engine, _ = await _engine(runner)
    stream = engine.add_request(NewRequest("a", [97] * 30, SamplingParams(max_tokens=500)))
    other = engine.add_request(NewRequest("b", [98] * 10, SamplingParams(max_tokens=3)))
    permits.release()
    first = await stream.__anext__()
    assert first.new_token_ids and not first.finished
    assert engine.abort("a") and not engine.abort("a") and not engine.abort("nope")
    permits.release(1000)  # "b" may run to the end now
    rest = [o async for o in stream]
    assert rest[-1].finished and rest[-1].finish_reason == "cancelled"
    await _collect(other)
    assert _all_free(engine)
    await engine.stop()


async def test_leaving_generate_early_aborts_the_request():
    engine, _ = await _engine()
    agen = engine.generate(NewRequest("g", [97] * 8, SamplingParams(max_tokens=400)))
    async for _ in agen:
        break
    await agen.aclose()
    assert "g" not in engine.scheduler.requests
    assert _all_free(engine)
    await engine.stop()


async def test_a_failing_request_fails_alone():
    runner = FakeRunner(num_blocks=40, block_size=4)
    runner.fail_when = lambda seq: seq.req_id == "bad" and seq.num_generated >= 2
    engine, _ = await _engine(runner)
    good = [
        engine.add_request(NewRequest(f"g{i}", [97 + i] * 6, SamplingParams(max_tokens=8)))
        for i in range(3)
    ]
    bad = engine.add_request(NewRequest("bad", [120] * 6, SamplingParams(max_tokens=8)))
    tokens, outs = await _collect(bad)
    assert outs[-1].finish_reason == "error" and "injected failure" in outs[-1].error
    assert len(tokens) == 2
    for i, stream in enumerate(good):
        assert (await _collect(stream))[0] == reference_tokens(runner, [97 + i] * 6, 8)
    assert engine.alive and _all_free(engine)
    await engine.stop()


async def test_a_post_processing_failure_fails_only_that_request(monkeypatch):
    class Broken:
        def add(self, token):
            raise UnicodeError("cannot decode")

    real = output_processor.IncrementalDetokenizer
    monkeypatch.setattr(
        output_processor,
        "IncrementalDetokenizer",
        lambda decode, prompt: Broken() if list(prompt) == [97] * 5 else real(decode, prompt),
    )
    engine, runner = await _engine()
    bad = engine.add_request(NewRequest("bad", [97] * 5, SamplingParams(max_tokens=6)))
    good = engine.add_request(NewRequest("good", [98] * 5, SamplingParams(max_tokens=6)))
    _, outs = await _collect(bad)
    assert outs[-1].finish_reason == "error" and "cannot decode" in outs[-1].error
    assert (await _collect(good))[0] == reference_tokens(runner, [98] * 5, 6)
    assert engine.alive and _all_free(engine)
    await engine.stop()


async def test_bad_requests_batched_alone_fail_alone_when_the_runner_passes_its_probe():
    runner = FakeRunner(num_blocks=40, block_size=4)
    runner.fail_when = lambda seq: seq.req_id.startswith("bad")
    engine, _ = await _engine(runner)
    bad = [
        engine.add_request(NewRequest(f"bad{i}", [97 + i] * 5, SamplingParams(max_tokens=4)))
        for i in range(2)
    ]
    for stream in bad:
        _, outs = await _collect(stream)
        assert outs[-1].finish_reason == "error" and "injected failure" in outs[-1].error
    assert engine.alive and engine.dead_reason is None
    tokens, _ = await _collect(
        engine.add_request(NewRequest("good", [99] * 5, SamplingParams(max_tokens=4)))
    )
    assert tokens == reference_tokens(runner, [99] * 5, 4)
    assert _all_free(engine)
    await engine.stop()


async def test_a_broken_runner_kills_the_loop_loudly():
    runner = FakeRunner(num_blocks=40, block_size=4)
    runner.fail_when = lambda seq: True
    engine, _ = await _engine(runner)
    streams = [
        engine.add_request(NewRequest(f"r{i}", [97 + i] * 5, SamplingParams(max_tokens=4)))
        for i in range(3)
    ]
    for stream in streams:
        with pytest.raises(EngineDeadError, match="injected failure"):
            await _collect(stream)
    assert not engine.alive and "injected failure" in engine.dead_reason
    with pytest.raises(EngineDeadError):
        engine.add_request(NewRequest("late", [97], SamplingParams()))
    await engine.stop()


async def test_a_stuck_step_turns_alive_false():
    gate = threading.Event()
    runner = FakeRunner()
    original = runner.execute
    runner.execute = lambda out: (gate.wait(10), original(out))[1]
    engine = AsyncEngine(_config(), runner, stuck_after_s=0.05)
    await engine.start()
    stream = engine.add_request(NewRequest("a", [97] * 4, SamplingParams(max_tokens=2)))
    for _ in range(500):
        if not engine.alive:
            break
        await asyncio.sleep(0.01)
    assert not engine.alive and engine.dead_reason is None
    gate.set()
    await _collect(stream)
    assert engine.alive
    await engine.stop()


async def test_queue_timeout_ends_the_stream_with_a_refusal():
    gate = threading.Event()
    runner = FakeRunner()
    original = runner.execute
    runner.execute = lambda out: (gate.wait(10), original(out))[1]
    engine, _ = await _engine(runner, max_batch=1, adaptive_batch=False, queue_timeout_s=0.01)
    busy = engine.add_request(NewRequest("busy", [97] * 4, SamplingParams(max_tokens=3)))
    await asyncio.sleep(0.05)
    late = engine.add_request(NewRequest("late", [98] * 4, SamplingParams(max_tokens=3)))
    await asyncio.sleep(0.05)
    gate.set()
    await _collect(busy)
    _, outs = await _collect(late)
    assert outs[-1].finish_reason == "error" and outs[-1].refusal_reason == "queue_timeout"
    assert engine.stats().refusals == {"queue_timeout": 1}
    await engine.stop()


async def test_bad_input_and_lifecycle_errors():
    engine = AsyncEngine(_config(), FakeRunner())
    with pytest.raises(EngineDeadError, match="start"):
        engine.add_request(NewRequest("x", [1], SamplingParams()))
    await engine.start()
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(NewRequest("x", [], SamplingParams()))
    # the front end tokenizes, never the engine
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request(NewRequest("x", "hello", SamplingParams()))
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request(NewRequest("x", [1, "a"], SamplingParams()))
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        engine.add_request(NewRequest("x", [1], {"max_tokens": 3}))
    pending = engine.add_request(
        NewRequest("p", [97] * 3, SamplingParams(max_tokens=10_000, ignore_eos=True))
    )
    await engine.stop()
    _, outs = await _collect(pending)
    assert outs[-1].finish_reason == "cancelled"
    with pytest.raises(EngineDeadError):
        engine.add_request(NewRequest("y", [1], SamplingParams()))
