"""The engine process: EngineCore in a loop of its own, fed and drained over ZeroMQ.

Busy loop while work exists (take whatever inputs arrived, step, send the step's outputs),
then a spell of polling without sleeping (IdleWait), then blocking on the input socket. It
never outlives its parent: the kernel kills it when the parent dies (PR_SET_PDEATHSIG, Linux),
and it also exits when it sees itself re-parented.
SIGINT and SIGTERM are ignored here: the front end owns shutdown and drains across the boundary
by sending `Inputs(shutdown=True)`.

With several front ends (`--frontends N`), the one PULL socket takes every front end's inputs and
each front end has an output socket of its own: a request's outputs go back to the front end whose
`Inputs.frontend` added it; stats, `Ready` and `Died` go to all of them.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

import zmq
from sloserve.config import SloserveConfig
from sloserve.engine import wire
from sloserve.engine.adapters import adapter_error_kind
from sloserve.engine.core import EngineCore
from sloserve.engine.outputs import RequestOutput
from sloserve.errors import (
    AdapterBusyError,
    InvalidRequestError,
    RequestRefusedError,
    UnknownAdapterError,
)
from sloserve.new_request import NewRequest

log = logging.getLogger(__name__)

IDLE_POLL_MS = 200  # while idle: how often the loop wakes to check that its parent lives
# while busy with steps that produce no output, stats go out at most this often
STATS_EVERY_S = 0.05
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the parent (thread) that started it exits."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the re-parenting check in the loop still ends the process
        pass


def run_engine(
    config: SloserveConfig,
    inputs_addrs: list[str],
    outputs_addrs: list[str],
    parent_pid: int,
    log_level: int = logging.INFO,
    make_core: Callable[[SloserveConfig], EngineCore] = EngineCore,
) -> None:
    """Entry point of the engine process (multiprocessing target); returns when told to shut down.

    One inputs and one outputs address per front end, front end 0 (the one that started it) first.
    `make_core(config)` builds the core (sloserve.testing passes one that injects faults).
    """
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from sloserve.logs import configure_logging

    configure_logging(config.server.log_format, level=log_level)
    if os.getppid() != parent_pid:
        sys.exit(0)  # the parent died while this process was starting
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    for addr in inputs_addrs:
        pull.connect(addr)
    pushes = []
    for addr in outputs_addrs:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 5000)
        push.connect(addr)  # queued until that front end binds: it may start after this process
        pushes.append(push)

    def tell_all(msg: wire.Ready | wire.StartFailed | wire.Died) -> None:
        data = wire.encode(msg)
        for push in pushes:
            push.send(data)

    try:
        try:
            core = make_core(config)
        except Exception as exc:  # noqa: BLE001 - reported to the front end, which decides
            tell_all(wire.StartFailed(f"{exc}", isinstance(exc, ValueError)))
            if not isinstance(exc, ValueError):
                log.error("engine failed to start: %s", exc, exc_info=exc)
            return
        tell_all(wire.Ready(core.model_info, core.stats(), os.getpid()))
        try:
            EngineLoop(
                core, pull, pushes[0], parent_pid, config.server.idle_spin_s, more_pushes=pushes[1:]
            ).run()
        except BaseException as exc:  # noqa: BLE001 - the loop's own death: tell the front ends why
            reason = f"{type(exc).__name__}: {exc}"
            log.error("engine step loop failed: %s", reason, exc_info=exc)
            tell_all(wire.Died(reason))
            core.close()
            raise SystemExit(1) from None
    finally:
        for push in pushes:
            push.close()
        pull.close(linger=0)
        ctx.term()


class IdleWait:
    """How long the loop's next poll for input may block once work runs out.

    For `spin_s` after the last step, not at all: the loop polls, yielding the core to any other
    runnable thread each turn; after that it blocks up to IDLE_POLL_MS at a time. A core left to
    sleep computes the next prompt slowly: on this project's 2-core VM (cpuidle haltpoll) the
    prefill step after 0.5 s of idle took 2-3x as long as one after 5 ms (436 tokens: 63-67 ms
    against 23 ms); a prompt alone after 0.25-1 s of idle got its first token at p50 45-67 ms,
    and at 21-25 ms when the loop polled through the gap (benchmarks/idle_spin.py, both sides).
    The price is one core busy for up to `spin_s` after each burst of work, so 0 turns it off.
    """

    def __init__(self, spin_s: float, clock=time.monotonic) -> None:
        self.spin_s = spin_s
        self.clock = clock
        self._last_work = -math.inf

    def worked(self) -> None:
        """A step just ran."""
        self._last_work = self.clock()

    def timeout_ms(self) -> int:
        """0 while spinning, else IDLE_POLL_MS."""
        return 0 if self.clock() - self._last_work < self.spin_s else IDLE_POLL_MS


class EngineLoop:
    """The process's loop over one EngineCore (one thread; no lock needed)."""

    def __init__(
        self,
        core: EngineCore,
        pull: zmq.Socket,
        push: zmq.Socket,
        parent_pid: int,
        idle_spin_s: float = 0.0,
        more_pushes: Sequence[zmq.Socket] = (),
    ) -> None:
        self.core = core
        self.idle = IdleWait(idle_spin_s)
        self.pull = pull
        self.pushes = [push, *more_pushes]  # one per front end, by Inputs.frontend
        self.parent_pid = parent_pid
        self._owner: dict[str, int] = {}  # live request id -> its front end, with several
        self._last_stats = 0.0

    def run(self) -> None:
        while True:
            busy = self.core.has_work()
            timeout_ms = 0 if busy else self.idle.timeout_ms()
            if self.pull.poll(timeout_ms):
                outputs, shutdown = self._take_inputs()
                if shutdown:
                    self._shutdown(outputs)
                    return
                if outputs or not self.core.has_work():
                    self._send(outputs)  # refusals and aborts go out before the next step
            elif not busy and timeout_ms == 0:
                os.sched_yield()  # spinning: any other runnable thread may have the core
            elif not busy:
                if os.getppid() != self.parent_pid:
                    log.error("the front-end process is gone: engine exiting")
                    return
                self.core.check_health()  # a tensor-parallel rank that died ends the loop, with its reason
            if self.core.has_work():
                outputs = self.core.step()
                self.idle.worked()
                now = time.monotonic()
                if outputs or now - self._last_stats > STATS_EVERY_S or not self.core.has_work():
                    self._send(outputs)

    def _take_inputs(self) -> tuple[list[RequestOutput], bool]:
        """Apply every Inputs message waiting on the socket; outputs of refusals and aborts."""
        outputs: list[RequestOutput] = []
        shutdown = False
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return outputs, shutdown
            msg = wire.decode_inputs(data)
            if msg.delivery_lag_s is not None:  # before the adds: they are priced with it
                self.core.report_delivery_lag(msg.delivery_lag_s)
            for op in msg.adapter_ops:
                done, ended = self._adapter_op(op)
                outputs += ended
                self.pushes[msg.frontend].send(wire.encode(done))
            for add in msg.adds:
                if msg.frontend:
                    self._owner[add.request_id] = msg.frontend
                refused = self._add(add)
                if refused is not None:
                    outputs.append(refused)
            for request_id in msg.aborts:
                out = self.core.abort(request_id)
                if out is not None:
                    outputs.append(out)
            shutdown = shutdown or msg.shutdown

    def _add(self, add: NewRequest) -> RequestOutput | None:
        """Queue one request; what add() would raise in-process comes back as a final error output."""
        try:
            self.core.add(add)
            return None
        except RequestRefusedError as exc:
            return _error_output(add, str(exc), "refused", exc.reason)
        except UnknownAdapterError as exc:
            return _error_output(add, str(exc), "not_found", None)
        except InvalidRequestError as exc:
            return _error_output(add, str(exc), "invalid", None)

    def _adapter_op(self, op: wire.AdapterOp) -> tuple[wire.AdapterDone, list[RequestOutput]]:
        """Load or unload one adapter, and the final outputs of requests an unload ended; what it
        would raise in-process comes back as its error."""
        adapters, ended = self.core.adapters, []
        try:
            if op.path is None:
                ended = self.core.unload_adapter(op.name, op.in_flight)
            else:
                adapters.load(op.name, op.path)
        except (InvalidRequestError, AdapterBusyError) as exc:
            kind = adapter_error_kind(exc)
            return wire.AdapterDone(op.op_id, adapters.names(), str(exc), kind), []
        return wire.AdapterDone(op.op_id, adapters.names()), ended

    def _send(self, outputs: list[RequestOutput], final: bool = False) -> None:
        """The step's outputs to the front ends that own them, with the stats; a front end with
        none of them gets the stats alone at most every STATS_EVERY_S (and when the engine idles),
        so that it is not woken by every step of the others' requests."""
        now = time.monotonic()
        stats = self.core.stats()
        if len(self.pushes) == 1:
            self._last_stats = now
            self.pushes[0].send(wire.encode(wire.StepOutputs(outputs, stats, final)))
            return
        everyone = final or now - self._last_stats > STATS_EVERY_S or not self.core.has_work()
        if everyone:
            self._last_stats = now
        owned: list[list[RequestOutput]] = [[] for _ in self.pushes]
        owner = self._owner
        for out in outputs:
            owned[
                owner.pop(out.request_id, 0) if out.finished else owner.get(out.request_id, 0)
            ].append(out)
        for push, mine in zip(self.pushes, owned, strict=True):
            if mine or everyone:
                push.send(wire.encode(wire.StepOutputs(mine, stats, final)))

    def _shutdown(self, outputs: list[RequestOutput]) -> None:
        outputs.extend(self.core.abort_all())
        self._send(outputs, final=True)
        self.core.close()


def _error_output(add: NewRequest, message: str, kind: str, refusal: str | None) -> RequestOutput:
    now = time.monotonic()
    return RequestOutput(
        add.request_id,
        [],
        "",
        True,
        "error",
        message,
        len(add.token_ids),
        arrival_time=add.arrival_time,
        finish_time=now,
        refusal_reason=refusal,
        error_kind=kind,
    )
