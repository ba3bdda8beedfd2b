"""One engine loop, several front ends (--frontends): each request's outputs go back only to the
front end that added it, refusals and the shutdown's aborts included; stats reach every one."""

from __future__ import annotations

import os
import time

import zmq
from sloserve.config import CacheConfig, SchedulerConfig, SloserveConfig
from sloserve.engine import wire
from sloserve.engine.core import EngineCore
from sloserve.engine.process import EngineLoop
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams

from tests.engine.fakes import FakeRunner


class Inputs:
    """A PULL socket: the scripted messages first; once the core is idle, a shutdown."""

    def __init__(self, core: EngineCore, messages: list[wire.Inputs]) -> None:
        self.core, self.queue = core, [wire.encode(m) for m in messages]
        self.shutdown_sent = False

    def poll(self, timeout_ms: int) -> bool:
        if not self.queue and not self.core.has_work() and not self.shutdown_sent:
            self.queue.append(wire.encode(wire.Inputs(shutdown=True)))
            self.shutdown_sent = True
        return bool(self.queue)

    def recv(self, flags: int = 0) -> bytes:
        if not self.queue:
            raise zmq.Again()
        return self.queue.pop(0)


class Outputs:
    def __init__(self) -> None:
        self.messages: list[wire.StepOutputs] = []

    def send(self, data: bytes) -> None:
        self.messages.append(wire.decode_from_engine(data))

    def outputs(self) -> dict[str, list]:
        got: dict[str, list] = {}
        for msg in self.messages:
            for out in msg.outputs:
                got.setdefault(out.request_id, []).append(out)
        return got


def _add(rid: str, max_tokens: int, prompt: int = 3) -> NewRequest:
    return NewRequest(
        rid,
        [1] * prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        None,
        time.monotonic(),
    )


def test_outputs_go_to_their_front_end_and_stats_to_all():
    config = SloserveConfig(
        cache=CacheConfig(block_size=4), scheduler=SchedulerConfig(admission_control=False)
    )
    core = EngineCore(config, FakeRunner(num_blocks=64, block_size=4))
    inputs = Inputs(
        core,
        [
            wire.Inputs(adds=[_add("a0", 3), _add("a1", 2)]),
            # b1: too long, refused
            wire.Inputs(adds=[_add("b0", 40), _add("b1", 2, prompt=10**5)], frontend=1),
            wire.Inputs(adds=[_add("c0", 2)], frontend=2),
        ],
    )
    outs = [Outputs(), Outputs(), Outputs()]
    loop = EngineLoop(core, inputs, outs[0], os.getppid(), more_pushes=outs[1:])
    loop.run()
    assert loop._owner == {}  # a finished request's owner is forgotten
    got = [o.outputs() for o in outs]
    assert [sorted(g) for g in got] == [["a0", "a1"], ["b0", "b1"], ["c0"]]
    finishes = {rid: seq[-1].finish_reason for g in got for rid, seq in g.items()}
    assert finishes == {
        "a0": "length",
        "a1": "length",
        "b0": "length",
        "b1": "error",
        "c0": "length",
    }
    assert sum(len(o.new_token_ids) for o in got[1]["b0"]) == 40
    assert all(o.messages[-1].final for o in outs)
    # a front end is sent a step's stats alone only every STATS_EVERY_S: front end 2 (one short
    # request) gets fewer messages than the steps that front end 1's longer one took
    assert len(outs[2].messages) < len(outs[1].messages) / 2
    assert not core.scheduler.requests


def test_the_shutdown_aborts_reach_their_own_front_end():
    config = SloserveConfig(
        cache=CacheConfig(block_size=4), scheduler=SchedulerConfig(admission_control=False)
    )
    core = EngineCore(config, FakeRunner(num_blocks=64, block_size=4))
    inputs = Inputs(core, [wire.Inputs(adds=[_add("long", 50)], frontend=1)])
    inputs.shutdown_sent = True
    inputs.queue.append(wire.encode(wire.Inputs(shutdown=True)))
    outs = [Outputs(), Outputs()]
    EngineLoop(core, inputs, outs[0], os.getppid(), more_pushes=outs[1:]).run()
    assert outs[0].outputs() == {} and outs[0].messages[-1].final
    assert [o.finish_reason for o in outs[1].outputs()["long"]] == ["cancelled"]
