"""Run sloserve: config -> engine client -> front end -> gRPC server; signals and exit codes."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from sloserve.config import SloserveConfig
from sloserve.grpc.server import SloserveServer
from sloserve.logs import configure_logging

log = logging.getLogger(__name__)


def build_engine_client(config: SloserveConfig) -> Any:
    """The engine client: an engine process of its own (--engine-process, default) or an in-process thread."""
    if config.server.engine_process:
        from sloserve.engine.mp_client import MPEngineClient

        return MPEngineClient(config)
    from sloserve.engine import AsyncEngine

    return AsyncEngine(config)


async def run(config: SloserveConfig, engine: Any | None = None) -> int:
    """Serve until SIGTERM/SIGINT (drain, exit 0) or a dead engine (exit 1); returns the exit code.

    A model that cannot be loaded (a ValueError such as CheckpointError) is raised as ValueError,
    which the CLI prints as one line with exit status 2.
    """
    if engine is None:
        engine = build_engine_client(config)
    server = SloserveServer(config, engine)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(server.dead.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in waiters:
        task.cancel()
    if server.dead.is_set():
        await server.stop(grace_s=0)
        if isinstance(server.start_error, ValueError):
            raise ValueError(f"cannot load model {config.model.path!r}: {server.start_error}")
        log.error("exiting: the engine is dead")
        return 1
    log.info("signal received: shutting down gracefully")
    await server.drain(config.server.grace_s)
    log.info("stopped")
    return 0


def main(config: SloserveConfig) -> int:
    """Configure logging and run the server in a fresh event loop."""
    configure_logging(config.server.log_format)
    return asyncio.run(run(config))
