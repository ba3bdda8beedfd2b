"""Adapters loaded and unloaded on the in-process engine (`serve --no-engine-process`), as the
engine process does over the wire (tests/lora/test_http.py)."""

from __future__ import annotations

import pytest
from sloserve.config import LoraConfig, ModelConfig, SloserveConfig
from sloserve.engine import AsyncEngine
from sloserve.engine.client import AdapterControl
from sloserve.engine.mp_client import MPEngineClient
from sloserve.errors import AdapterBusyError, AdapterError, UnknownAdapterError
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams

from tests.lora.adapters import merged_greedy

PROMPT = (256, 72, 101, 108, 108, 111)


def test_both_engine_clients_control_adapters():
    assert issubclass(AsyncEngine, AdapterControl) and issubclass(MPEngineClient, AdapterControl)


async def test_load_generate_unload_in_process(make_checkpoint, make_lora, adapter_root):
    base, path = make_checkpoint("llama"), make_lora("llama", rank=8, seed=1)
    config = SloserveConfig(
        model=ModelConfig(path=str(base), device="cpu"), lora=LoraConfig(lora_dir=str(adapter_root))
    )
    engine = AsyncEngine(config)
    await engine.start()
    try:
        with pytest.raises(AdapterError, match="outside --lora-dir"):
            await engine.load_adapter("a", "/etc")
        await engine.load_adapter("a", path.name)
        assert engine.adapter_names() == ["a"]
        params = SamplingParams(max_tokens=32, ignore_eos=True, adapter="a")
        stream = engine.add_request(NewRequest("r1", list(PROMPT), params))
        with pytest.raises(AdapterBusyError, match="1 request"):
            await engine.unload_adapter("a")
        tokens = [t for out in [o async for o in stream] for t in out.new_token_ids]
        assert tokens == merged_greedy(base, path, (PROMPT,), 32)[0]
        await engine.unload_adapter("a")
        assert engine.adapter_names() == []
        with pytest.raises(UnknownAdapterError):
            engine.add_request(NewRequest("r2", list(PROMPT), params))
        with pytest.raises(UnknownAdapterError):
            await engine.unload_adapter("a")
    finally:
        await engine.stop()


async def test_unload_in_process_drains_or_aborts_requests_in_flight(
    make_checkpoint, make_lora, adapter_root
):
    base, path = make_checkpoint("llama"), make_lora("llama", rank=8, seed=1)
    config = SloserveConfig(
        model=ModelConfig(path=str(base), device="cpu"), lora=LoraConfig(lora_dir=str(adapter_root))
    )
    engine = AsyncEngine(config)
    await engine.start()
    try:
        params = SamplingParams(max_tokens=200, ignore_eos=True, adapter="a")
        await engine.load_adapter("a", path.name)
        stream = engine.add_request(NewRequest("r1", list(PROMPT), params))
        await engine.unload_adapter("a", "drain")
        assert engine.adapter_names() == []
        with pytest.raises(UnknownAdapterError, match="being unloaded"):
            engine.add_request(NewRequest("r2", list(PROMPT), params))
        outs = [o async for o in stream]
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 200
        await engine.load_adapter("a", path.name)  # the drained name is free again
        stream = engine.add_request(NewRequest("r3", list(PROMPT), params))
        await engine.unload_adapter("a", "abort")
        last = [o async for o in stream][-1]
        assert last.finish_reason == "error" and last.error_kind == "not_found"
        assert "'a' was unloaded while this request ran" in last.error
        with pytest.raises(AdapterError, match="in_flight must be one of"):
            await engine.unload_adapter("a", "later")
    finally:
        await engine.stop()
