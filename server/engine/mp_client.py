"""MPEngineClient: the EngineClient of `sloserve serve` -- EngineCore in a process of its own.

The front end's event loop never waits on a step: requests and aborts go out as one `Inputs`
message per event-loop turn, and one `StepOutputs` message per step comes back with every
request's new tokens and the engine's stats. Lifecycle: the client watches the process's
sentinel, so an engine that dies (crash, OOM kill, kill -9) is noticed at once: every live
request ends with EngineDeadError giving the reason and `alive` turns False (the server then
reports NOT_SERVING and exits non-zero for its supervisor to restart it). The engine process
never outlives this one (see `engine.process`).

With `--frontends N` the client that starts the engine is front end 0; the others are given an
`EngineLink` instead and join the same engine process through sockets of their own (they watch
it through a pidfd, as it is not their child). Only front end 0 shuts the engine down.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio
from sloserve.config import SloserveConfig
from sloserve.engine import wire
from sloserve.engine.adapters import adapter_error
from sloserve.engine.core import EngineCore
from sloserve.engine.outputs import EngineStats
from sloserve.engine.process import run_engine
from sloserve.engine.stream import RequestStream
from sloserve.engine.wire import EngineLink
from sloserve.errors import EngineDeadError, InvalidRequestError
from sloserve.new_request import NewRequest

if TYPE_CHECKING:
    from sloserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class MPEngineClient:
    """Talks to one engine process; every method is called on the front end's event loop.

    Without `link` it starts the engine process (for config.server.frontends front ends, itself
    the first); with one it joins the engine that front end 0 started.
    """

    def __init__(
        self,
        config: SloserveConfig,
        *,
        stuck_after_s: float = 120.0,
        link: EngineLink | None = None,
        make_core: Callable[..., EngineCore] = EngineCore,
    ) -> None:
        """`make_core` builds the core in the engine process (picklable; tests wrap the core with it)."""
        self.config = config
        self._make_core = make_core
        self.stuck_after_s = stuck_after_s
        self.ready = False
        self.pid: int | None = None
        self.owns_engine = link is None
        # awaited before the engine is told to exit
        self.before_shutdown: Callable[[], Awaitable[None]] | None = None
        self._link = link
        self._watch_fd: int | None = None  # readable when the engine process has ended
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._dir: str | None = None
        self._ctx: zmq.Context | None = None
        self._actx: zmq.asyncio.Context | None = None
        self._push: zmq.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self._streams: dict[str, RequestStream] = {}
        self._index = 0 if link is None else link.index
        self._pending = wire.Inputs(adds=[], aborts=[], frontend=self._index)
        self._flush_scheduled = False
        self._adapter_ops: dict[int, asyncio.Future[wire.AdapterDone]] = {}
        self._next_op = 0
        self._adapters: list[str] = []
        self._info: dict = {}
        self._stats = EngineStats()
        self._tokenizer: Tokenizer | None = None
        self._dead_reason: str | None = None
        self._exited = asyncio.Event()
        self._final = asyncio.Event()
        self._stopping = False
        self._last_message = time.monotonic()

    # ---- lifecycle ---------------------------------------------------------------------
    def link(self, index: int) -> EngineLink:
        """The link front end `index` (1 .. frontends - 1) joins this client's engine through."""
        assert self.owns_engine and 0 < index < self.config.server.frontends, index
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="sloserve-engine-")
        return EngineLink(self._dir, index)

    async def start(self) -> None:
        """Start (or join) the engine process and wait until its model is loaded and warmed up."""
        if self._proc is not None or self._ctx is not None:
            raise RuntimeError("the engine is already started")
        if self.owns_engine and self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="sloserve-engine-")
        link = self._link or EngineLink(self._dir, 0)
        self._ctx, self._actx = zmq.Context(), zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(link.inputs)
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(link.outputs)
        if self.owns_engine:
            links = [EngineLink(self._dir, k) for k in range(self.config.server.frontends)]
            # NOTE: started from the event-loop thread: PR_SET_PDEATHSIG fires when the *thread* that
            # started the child exits, so a worker thread here would kill the engine with it.
            self._proc = multiprocessing.get_context("spawn").Process(
                target=run_engine,
                name="sloserve-engine",
                daemon=True,
                args=(
                    self.config,
                    [x.inputs for x in links],
                    [x.outputs for x in links],
                    os.getpid(),
                    logging.getLogger().level,
                    self._make_core,
                ),
            )
            self._proc.start()
            self.pid = self._proc.pid
            self._watch(self._proc.sentinel)
            log.info("engine process started (pid %d)", self.pid)
        first = await self._first_message()
        if isinstance(first, wire.StartFailed):
            await self._reap(5.0)
            raise (ValueError if first.user_error else RuntimeError)(first.message)
        assert isinstance(first, wire.Ready), first
        if not self.owns_engine:
            self.pid = first.pid
            self._watch(os.pidfd_open(first.pid))
            log.info("front end %d joined the engine process (pid %d)", self._index, self.pid)
        self._info, self._stats = first.model_info, first.stats
        self._adapters = list(first.model_info.get("lora_adapters", []))
        from sloserve.tokenizer import Tokenizer

        self._tokenizer = await asyncio.to_thread(
            Tokenizer.from_pretrained, first.model_info["model"]
        )
        self._receiver = asyncio.create_task(self._receive(), name="sloserve-engine-outputs")
        self.ready = True

    async def _first_message(self) -> wire.Ready | wire.StartFailed:
        recv = asyncio.ensure_future(self._pull.recv())
        exited = asyncio.ensure_future(self._exited.wait())
        await asyncio.wait({recv, exited}, return_when=asyncio.FIRST_COMPLETED)
        exited.cancel()
        if recv.done():
            msg = wire.decode_from_engine(recv.result())
            if isinstance(msg, wire.Ready | wire.StartFailed):
                return msg
            raise RuntimeError(f"the engine process sent {type(msg).__name__} before it was ready")
        recv.cancel()
        raise RuntimeError(f"the engine process exited while starting ({self._exit_description()})")

    def _watch(self, fd: int) -> None:
        self._watch_fd = fd
        asyncio.get_running_loop().add_reader(fd, self._on_exit)

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Shut the engine down: live requests end 'cancelled', the process exits (killed if it hangs).

        A front end that joined the engine only closes its own end (front end 0 shuts it down).
        """
        self._stopping = True
        self.ready = False
        if self.owns_engine and self.before_shutdown is not None:
            await self.before_shutdown()
        alive = self._proc is not None and self._proc.is_alive() and self._dead_reason is None
        if alive and self._push is not None:
            self._flush()
            if self._send(wire.Inputs(shutdown=True)):
                try:
                    await asyncio.wait_for(self._final.wait(), timeout_s)
                except TimeoutError:
                    log.warning("the engine did not shut down within %.0fs; killing it", timeout_s)
        await self._reap(5.0)
        if self._receiver is not None:
            self._receiver.cancel()
        self._fail_all(EngineDeadError("the engine was stopped"))
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.term()
        self._push = self._pull = None
        self._ctx = self._actx = None
        if self._watch_fd is not None and not self.owns_engine:
            self._unwatch()
        if self._dir is not None and self.owns_engine:
            shutil.rmtree(self._dir, ignore_errors=True)

    async def _reap(self, timeout_s: float) -> None:
        proc = self._proc
        if proc is None:
            return
        await asyncio.to_thread(proc.join, timeout_s)
        if proc.is_alive():
            proc.kill()
            await asyncio.to_thread(proc.join, timeout_s)

    @property
    def alive(self) -> bool:
        """The process runs, its loop has not died, and it has not been silent past stuck_after_s
        while requests are live (a stuck step)."""
        if self._dead_reason is not None or self._exited.is_set() or self._watch_fd is None:
            return False
        return not self._streams or time.monotonic() - self._last_message < self.stuck_after_s

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def model_info(self) -> dict:
        return dict(self._info)

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, new: NewRequest) -> RequestStream:
        """Send a request; refusals come back on the stream as a final 'error' output (error_kind)."""
        self._check_running()
        if new.request_id in self._streams:
            raise InvalidRequestError(f"request id {new.request_id!r} is already in use")
        stream = RequestStream(new.request_id, asyncio.get_running_loop())
        self._streams[new.request_id] = stream
        if new.arrival_time is None:  # stamped here, before it waits for the flush
            new = msgspec.structs.replace(new, arrival_time=time.monotonic())
        self._pending.adds.append(new)
        self._schedule_flush()
        return stream

    def report_delivery_lag(self, lag_s: float) -> None:
        """The front end handed a first token to its client `lag_s` after the engine made it: sent
        with the next message (the adds it prices), never a message of its own."""
        self._pending.delivery_lag_s = lag_s

    def abort(self, request_id: str) -> bool:
        """Ask the engine to cancel a live request (its stream then ends with 'cancelled')."""
        if request_id not in self._streams or self._dead_reason is not None:
            return False
        self._pending.aborts.append(request_id)
        self._schedule_flush()
        return True

    def stats(self) -> EngineStats:
        """The engine's stats as of its latest message (sent after every step, and when idle)."""
        return self._stats

    def _check_running(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead_reason}")
        if not self.ready or self._stopping:
            raise EngineDeadError("the engine is not running (await engine.start() first)")

    # ---- LoRA adapters -----------------------------------------------------------------
    def adapter_names(self) -> list[str]:
        """The adapters loaded, as of this front end's last operation (or the engine's start)."""
        return list(self._adapters)

    async def load_adapter(self, name: str, path: str) -> None:
        """Load adapter `name` from `path` (under --lora-dir) in the engine process."""
        await self._adapter_op(name, path)

    async def unload_adapter(self, name: str, in_flight: str = "refuse") -> None:
        """Unload adapter `name` in the engine process (engine/adapters.py IN_FLIGHT)."""
        await self._adapter_op(name, None, in_flight)

    async def _adapter_op(self, name: str, path: str | None, in_flight: str = "refuse") -> None:
        self._check_running()
        self._next_op += 1
        op = wire.AdapterOp(self._next_op, name, path, in_flight)
        done = self._adapter_ops[op.op_id] = asyncio.get_running_loop().create_future()
        if not self._send(wire.Inputs(frontend=self._index, adapter_ops=[op])):
            self._adapter_ops.pop(op.op_id, None)
            raise EngineDeadError("the engine process is not taking messages")
        reply = await done
        self._adapters = reply.adapters
        if reply.error is not None:
            raise adapter_error(reply.error_kind, name, reply.error)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send what this event-loop turn gathered as one message."""
        self._flush_scheduled = False
        pending, self._pending = (
            self._pending,
            wire.Inputs(adds=[], aborts=[], frontend=self._index),
        )
        if (
            (pending.adds or pending.aborts)
            and self._push is not None
            and self._dead_reason is None
        ):
            self._send(pending)

    def _send(self, msg: wire.Inputs) -> bool:
        """Send without ever blocking the event loop; False when the engine's end is gone (it died:
        the sentinel handler fails the streams)."""
        try:
            self._push.send(wire.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    # ---- outputs and death -------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            msg = wire.decode_from_engine(await self._pull.recv())
            self._last_message = time.monotonic()
            if isinstance(msg, wire.StepOutputs):
                self._stats = msg.stats
                for out in msg.outputs:
                    stream = (
                        self._streams.pop(out.request_id, None)
                        if out.finished
                        else self._streams.get(out.request_id)
                    )
                    if stream is not None:
                        stream.put(out)
                if msg.final:
                    self._final.set()
            elif isinstance(msg, wire.AdapterDone):
                done = self._adapter_ops.pop(msg.op_id, None)
                if done is not None and not done.done():
                    done.set_result(msg)
            elif isinstance(msg, wire.Died):
                self._die(msg.reason)

    def _on_exit(self) -> None:
        """The process sentinel (or pidfd) is readable: the engine process has ended."""
        self._unwatch()
        self._exited.set()
        if not self._stopping and self.ready:
            # Give a 'died' message already on its way a moment to arrive: it carries the reason.
            asyncio.get_running_loop().call_later(0.05, self._die, None)

    def _unwatch(self) -> None:
        fd, self._watch_fd = self._watch_fd, None
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            if not self.owns_engine:
                os.close(fd)  # our pidfd (front end 0's is the Process's sentinel)

    def _die(self, reason: str | None) -> None:
        if self._dead_reason is None:
            self._dead_reason = (
                reason or f"the engine process exited unexpectedly ({self._exit_description()})"
            )
            log.error("engine process failed: %s", self._dead_reason)
        self._fail_all(EngineDeadError(f"the engine loop died: {self._dead_reason}"))

    def _fail_all(self, exc: EngineDeadError) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(exc)
        ops, self._adapter_ops = self._adapter_ops, {}
        for done in ops.values():
            if not done.done():
                done.set_exception(exc)

    def _exit_description(self) -> str:
        code = self._proc.exitcode if self._proc is not None else None
        if code is None:
            return "exit status unknown"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"
