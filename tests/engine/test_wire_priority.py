"""Priority and the new stats across the engine-process boundary: the wire round trip, the engine
loop handing it to EngineCore, the client queueing it, and EngineCore giving it to the scheduler."""

from __future__ import annotations

import msgspec
import pytest
from sloserve.config import CacheConfig, SchedulerConfig, SloserveConfig
from sloserve.engine import wire
from sloserve.engine.core import EngineCore
from sloserve.engine.mp_client import MPEngineClient
from sloserve.engine.outputs import EngineStats
from sloserve.engine.process import EngineLoop
from sloserve.errors import InvalidRequestError
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SLO, SamplingParams

from tests.engine.fakes import FakeRunner

PARAMS = SamplingParams(max_tokens=2)


def test_add_request_round_trips_its_priority():
    adds = [
        NewRequest("a", [1, 2], PARAMS, SLO(ttft_s=0.5), 12.5, -4),
        NewRequest("b", [3], PARAMS, None, 13.0),
    ]
    back = wire.decode_inputs(wire.encode(wire.Inputs(adds=adds, aborts=["c"])))
    assert back.adds == adds and back.aborts == ["c"]
    assert [a.priority for a in back.adds] == [-4, 0]


def test_an_add_request_without_priority_decodes_as_zero():
    """priority is the last field of an array-like struct: a sender that predates it still decodes."""

    class OldAddRequest(msgspec.Struct, array_like=True):
        request_id: str
        token_ids: list[int]
        params: SamplingParams
        slo: SLO | None
        arrival_time: float

    class OldInputs(msgspec.Struct, tag="inputs", array_like=True):
        adds: list[OldAddRequest] = []
        aborts: list[str] = []
        shutdown: bool = False

    data = msgspec.msgpack.encode(OldInputs(adds=[OldAddRequest("a", [1], PARAMS, None, 1.0)]))
    (add,) = wire.decode_inputs(data).adds
    assert (add.request_id, add.priority) == ("a", 0)


def test_step_outputs_carry_the_new_stats():
    stats = EngineStats(
        kv_blocks_total=8,
        kv_blocks_peak=6,
        ttft_predictions=11,
        ttft_prediction_error_p50_s=-0.125,
        ttft_prediction_error_p90_s=0.75,
    )
    back = wire.decode_from_engine(wire.encode(wire.StepOutputs([], stats)))
    assert back.stats == stats


class _RecordingCore:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add(self, *args) -> None:
        self.calls.append(args)


def test_the_engine_loop_hands_priority_to_the_core():
    core = _RecordingCore()
    loop = EngineLoop(core, pull=None, push=None, parent_pid=0)
    assert loop._add(NewRequest("a", [1, 2], PARAMS, None, 5.0, 3)) is None
    assert core.calls == [(NewRequest("a", [1, 2], PARAMS, None, 5.0, 3),)]


async def test_the_process_client_sends_priority_and_refuses_what_msgpack_cannot_carry():
    client = MPEngineClient(SloserveConfig())
    client.ready = True  # no process: only what add_request queues for the next flush is checked
    client.add_request(NewRequest("a", [1, 2], PARAMS, priority=-9))
    client.add_request(NewRequest("b", [3], PARAMS))
    assert [(a.request_id, a.priority) for a in client._pending.adds] == [("a", -9), ("b", 0)]
    for bad in (2**63, 1.5, True):
        with pytest.raises(InvalidRequestError, match="priority"):
            client.add_request(NewRequest("c", [1], PARAMS, priority=bad))
    assert "c" not in client._streams


def _core() -> EngineCore:
    config = SloserveConfig(
        cache=CacheConfig(block_size=4), scheduler=SchedulerConfig(admission_control=False)
    )
    runner = FakeRunner(num_blocks=32, block_size=4)
    runner.vocab_size = 260
    return EngineCore(config, runner)


def test_engine_core_gives_priority_to_the_schedulers_request():
    core = _core()
    core.add(NewRequest("a", [97, 98], PARAMS, priority=-2))
    core.add(NewRequest("b", [97, 99], PARAMS))
    assert (
        core.scheduler.requests["a"].priority == -2 and core.scheduler.requests["b"].priority == 0
    )
    with pytest.raises(InvalidRequestError, match="priority must be an integer"):
        core.add(NewRequest("c", [97], PARAMS, priority="high"))
