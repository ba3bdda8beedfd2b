"""Front ends 1..N-1 of `--frontends N`: child processes that serve the same ports over one engine.

Front end 0 (the `sloserve serve` process) starts the engine process and these; each child runs
the same gRPC and HTTP edges with its own tokenizer and event loop, binds the same ports with
SO_REUSEPORT (the kernel spreads new connections over them) and joins the engine over its own
sockets (`engine.wire.EngineLink`). A child dies with front end 0 (PR_SET_PDEATHSIG) and
exits 1 when the engine dies; a child that exits on its own makes front end 0 stop everything
and exit 1, for the supervisor to restart the server whole.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable

log = logging.getLogger(__name__)


class FrontendProcesses:
    """The child front ends: started together, watched, told to drain, reaped."""

    def __init__(self, target: Callable[..., None], args: list[tuple]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.procs = [
            ctx.Process(target=target, args=a, name=f"sloserve-frontend-{k + 1}", daemon=True)
            for k, a in enumerate(args)
        ]
        self.lost = asyncio.Event()  # a child exited before it was told to stop
        self._stopping = False

    def start(self) -> None:
        """Start every child (from the event-loop thread: PR_SET_PDEATHSIG follows that thread)."""
        loop = asyncio.get_running_loop()
        for proc in self.procs:
            proc.start()
            loop.add_reader(proc.sentinel, self._exited, proc)
        log.info("front ends started: pids %s", ", ".join(str(p.pid) for p in self.procs))

    def _exited(self, proc: multiprocessing.process.BaseProcess) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        if not self._stopping:
            proc.join(0)
            log.error(
                "front end %s (pid %d) exited unexpectedly (exit code %s)",
                proc.name,
                proc.pid,
                proc.exitcode,
            )
            self.lost.set()

    def terminate(self) -> None:
        """SIGTERM: each child drains its own requests within the grace period, then exits."""
        self._stopping = True
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    async def wait(self, timeout_s: float) -> None:
        """Wait up to timeout_s for every child to exit; kill what is left."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for proc in self.procs:
            await asyncio.to_thread(proc.join, max(0.0, deadline - loop.time()))
            if proc.is_alive():
                log.warning("front end %s did not exit in time; killing it", proc.name)
                proc.kill()
                await asyncio.to_thread(proc.join, 5.0)
