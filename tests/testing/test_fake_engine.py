"""The service tests' FakeEngine keeps the real contract: real output types, no swallowed errors."""

from __future__ import annotations

import asyncio

import pytest
from sloserve.engine.outputs import EngineStats, RequestOutput
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams
from sloserve.testing.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(30)


def _hi(engine: FakeEngine) -> NewRequest:
    """The prompt "hi", tokenized as the front end would (an engine takes token ids only)."""
    return NewRequest("r", engine.tokenizer.encode("hi"), SamplingParams(max_tokens=3))


async def test_outputs_and_stats_are_the_engines_own_types():
    engine = FakeEngine(step_s=0.001)
    await engine.start()
    outs = [o async for o in engine.add_request(_hi(engine))]
    assert all(type(o) is RequestOutput for o in outs) and outs[-1].finish_reason == "length"
    stats = engine.stats()
    assert type(stats) is EngineStats and stats.kv_blocks_free == stats.kv_blocks_total


async def test_an_exception_inside_a_request_reaches_its_stream_instead_of_hanging():
    engine = FakeEngine(step_s=0.001)
    await engine.start()

    def broken(ids: list[int]) -> str:
        raise UnicodeError("decoder exploded")

    engine.tokenizer.decode = broken
    stream = engine.add_request(_hi(engine))
    with pytest.raises(UnicodeError, match="decoder exploded"):
        await asyncio.wait_for(anext(aiter(stream)), 10)
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and not engine.reqs
