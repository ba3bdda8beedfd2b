"""The engine process's idle wait: it polls without sleeping for idle_spin_s after its last step,
yielding the core each turn, then blocks on its input socket (and checks its parent) as before."""

from __future__ import annotations

import os

import pytest
import zmq
from sloserve.config import ServerConfig
from sloserve.engine import wire
from sloserve.engine.outputs import EngineStats
from sloserve.engine.process import IDLE_POLL_MS, EngineLoop, IdleWait
from sloserve.testing.clock import Clock


def test_idle_wait_spins_for_its_window_after_the_last_step_only():
    clock = Clock()
    wait = IdleWait(0.5, clock)
    assert wait.timeout_ms() == IDLE_POLL_MS  # a loop that never stepped does not spin
    wait.worked()
    clock.t += 0.49
    assert wait.timeout_ms() == 0
    clock.t += 0.02
    assert wait.timeout_ms() == IDLE_POLL_MS
    wait.worked()  # another step opens a new window
    assert wait.timeout_ms() == 0


def test_a_zero_window_never_spins():
    clock = Clock()
    wait = IdleWait(0.0, clock)
    wait.worked()
    assert wait.timeout_ms() == IDLE_POLL_MS


class OneStepCore:
    """Work for one step, then none."""

    def __init__(self) -> None:
        self.steps = 0
        self.health_checks = 0

    def has_work(self) -> bool:
        return self.steps == 0

    def step(self) -> list:
        self.steps += 1
        return []

    def stats(self) -> EngineStats:
        return EngineStats()

    def check_health(self) -> None:
        self.health_checks += 1

    def abort_all(self) -> list:
        return []

    def close(self) -> None:
        pass


class ScriptedInputs:
    """A PULL socket on which nothing arrives: each poll advances the clock by `turn_s`; after
    `polls` polls, a shutdown message arrives."""

    def __init__(self, clock: Clock, turn_s: float, polls: int) -> None:
        self.clock, self.turn_s, self.left = clock, turn_s, polls
        self.timeouts: list[int] = []
        self._queue: list[bytes] = []

    def poll(self, timeout_ms: int) -> bool:
        self.timeouts.append(timeout_ms)
        self.clock.t += self.turn_s
        self.left -= 1
        if self.left == 0:
            self._queue.append(wire.encode(wire.Inputs(shutdown=True)))
        return bool(self._queue)

    def recv(self, flags: int = 0) -> bytes:
        if not self._queue:
            raise zmq.Again()
        return self._queue.pop()


class Outputs:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)


@pytest.mark.parametrize(("spin_s", "spinning"), [(0.0, 0), (0.35, 4)])
def test_the_loop_polls_without_blocking_through_the_window_then_blocks(
    monkeypatch, spin_s, spinning
):
    """One step, then 7 idle polls 0.1 s apart: those that find the step less than spin_s ago
    (0, 0.1, 0.2 and 0.3 s after it) do not block."""
    yields = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
    clock = Clock()
    core, inputs = OneStepCore(), ScriptedInputs(clock, turn_s=0.1, polls=8)
    loop = EngineLoop(core, inputs, Outputs(), os.getppid(), idle_spin_s=spin_s)
    loop.idle.clock = clock
    loop.run()
    assert core.steps == 1
    assert inputs.timeouts == [0] + [0] * spinning + [IDLE_POLL_MS] * (7 - spinning)
    assert len(yields) == spinning  # each empty spinning poll gives the core away once
    # only blocking polls check the parent and the tensor-parallel ranks (the last poll got shutdown)
    assert core.health_checks == 7 - spinning - 1


def test_idle_spin_is_validated():
    assert ServerConfig().idle_spin_s == 1.0
    with pytest.raises(ValueError, match="idle spin must be in 0..60 seconds"):
        ServerConfig(idle_spin_s=-1)
