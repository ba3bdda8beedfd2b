"""AsyncEngine: the in-process EngineClient -- EngineCore stepped by one thread, streams to asyncio.

Used by tests and by `sloserve serve --no-engine-process`; `sloserve serve` runs the same core in
a process of its own (`engine.mp_client`). The loop thread owns all stepping; callers on the
event loop add and abort requests under a lock that is never held during the forward pass.
Outputs reach each request's asyncio queue via `loop.call_soon_threadsafe`. An exception of the
loop itself marks the engine dead (`alive` False, `dead_reason`) and fails every pending stream
with EngineDeadError. A step running longer than `stuck_after_s` turns `alive` False.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from sloserve.config import SloserveConfig
from sloserve.engine.core import EngineCore
from sloserve.engine.outputs import EngineStats, RequestOutput
from sloserve.engine.runner import Runner
from sloserve.engine.stream import RequestStream
from sloserve.errors import EngineDeadError
from sloserve.new_request import NewRequest
from sloserve.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from sloserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class AsyncEngine:
    """Continuous batching over a ModelRunner (or anything with its API), in this process."""

    def __init__(
        self,
        config: SloserveConfig,
        runner: Runner | None = None,
        *,
        stuck_after_s: float = 120.0,
        make_core: Callable[..., EngineCore] = EngineCore,
    ) -> None:
        """`make_core` builds the core as EngineCore(config, runner, lock=...) does (tests wrap it)."""
        self.config = config
        self.stuck_after_s = stuck_after_s
        self._runner = runner
        self._make_core = make_core
        self._core: EngineCore | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._dead_reason: str | None = None
        self._busy_since: float | None = None
        self.ready = False

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Load and warm up the model in a worker thread, then start the loop thread."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._core = await asyncio.to_thread(
            self._make_core, self.config, self._runner, lock=self._lock
        )
        self._thread = threading.Thread(target=self._run, name="sloserve-engine", daemon=True)
        self._thread.start()
        self.ready = True

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the loop (waiting up to timeout_s for a running step); pending requests end 'cancelled'."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)
        if self._core is not None:
            with self._lock:
                outputs = self._core.abort_all()
                if outputs:
                    self._deliver(outputs)
            self._core.close()
        self.ready = False

    @property
    def alive(self) -> bool:
        """The loop thread runs, has not died, and no step has been stuck past stuck_after_s."""
        thread = self._thread
        if self._dead_reason is not None or thread is None or not thread.is_alive():
            return False
        busy = self._busy_since
        return busy is None or time.monotonic() - busy < self.stuck_after_s

    @property
    def scheduler(self) -> Scheduler | None:
        """The scheduler (for inspection and benchmarks; mutate it only through the engine)."""
        return self._core.scheduler if self._core is not None else None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def tokenizer(self) -> Tokenizer:
        return self._core.tokenizer if self._core is not None else None

    @property
    def model_info(self) -> dict:
        return self._core.model_info if self._core is not None else {}

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, new: NewRequest) -> RequestStream:
        """Queue a request; raises InvalidRequestError / RequestRefusedError / EngineDeadError now."""
        self._check_running()
        stream = RequestStream(new.request_id, asyncio.get_running_loop())
        with self._lock:
            self._check_running()
            self._core.add(new)
            self._streams[new.request_id] = stream
        self._wake.set()
        return stream

    async def generate(self, new: NewRequest) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; leaving early (break, cancellation) aborts the request."""
        stream = self.add_request(new)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(new.request_id)

    def report_delivery_lag(self, lag_s: float) -> None:
        """The front end handed a first token to its client `lag_s` after the engine made it."""
        if self._core is not None:  # NOTE: no lock: admission stores one tuple, read whole
            self._core.report_delivery_lag(lag_s)

    def abort(self, request_id: str) -> bool:
        """Cancel a live request and free its blocks now; its stream ends with 'cancelled'."""
        if self._core is None:
            return False
        with self._lock:
            out = self._core.abort(request_id)
            if out is None:
                return False
            self._deliver([out])
        return True

    # ---- LoRA adapters -----------------------------------------------------------------
    def adapter_names(self) -> list[str]:
        """The adapters loaded now."""
        return self._core.adapters.names() if self._core is not None else []

    async def load_adapter(self, name: str, path: str) -> None:
        """Load adapter `name` from `path` (under --lora-dir), in a worker thread."""
        self._check_running()
        await asyncio.to_thread(self._under_lock, self._core.adapters.load, name, path)

    async def unload_adapter(self, name: str, in_flight: str = "refuse") -> None:
        """Unload adapter `name`, its requests in flight refused, drained or aborted
        (engine/adapters.py IN_FLIGHT)."""
        self._check_running()
        with self._lock:
            self._deliver(self._core.unload_adapter(name, in_flight))

    def _under_lock(self, fn: Callable[..., None], *args: str) -> None:
        with self._lock:
            fn(*args)

    def stats(self) -> EngineStats:
        if self._core is None:
            return EngineStats()
        with self._lock:
            return self._core.stats()

    def _check_running(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead_reason}")
        if not self.ready or self._stopping or self._core is None:
            raise EngineDeadError("the engine is not running (await engine.start() first)")

    # ---- the loop thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                with self._lock:
                    work = self._core.has_work()
                    if not work:
                        self._wake.clear()
                if work:
                    self._step()
                else:
                    self._core.check_health()
                    self._wake.wait(0.5)
        except BaseException as exc:  # noqa: BLE001 - the loop's own death must be reported
            self._die(f"{type(exc).__name__}: {exc}")

    def _step(self) -> None:
        """EngineCore.step() with the lock released around the forward pass."""
        core = self._core
        self._busy_since = time.monotonic()
        with self._lock:
            out = core.schedule()
        result, seconds = core.execute(out)
        with self._lock:
            outputs = core.update(out, result, seconds)
            self._deliver(outputs)
        self._busy_since = None
        if out.is_empty and not outputs:
            time.sleep(0.001)  # nothing could run (e.g. blocks held by a just-finished step)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Route outputs to their streams (call with the lock held)."""
        for out in outputs:
            stream = (
                self._streams.pop(out.request_id, None)
                if out.finished
                else self._streams.get(out.request_id)
            )
            if stream is not None:
                stream.put(out)

    def _die(self, reason: str) -> None:
        self._dead_reason = reason
        log.error("engine loop died: %s", reason)
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(EngineDeadError(f"the engine loop died: {reason}"))
