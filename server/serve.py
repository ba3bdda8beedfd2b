"""Run sloserve: config -> engine client -> lifecycle (front end) -> gRPC and HTTP edges; signals, exit codes."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from sloserve.config import SloserveConfig
from sloserve.frontend.lifecycle import Lifecycle
from sloserve.grpc.server import SloserveServer
from sloserve.http.config import HttpConfig
from sloserve.logs import configure_logging

log = logging.getLogger(__name__)


def build_engine_client(config: SloserveConfig) -> Any:
    """The engine client: an engine process of its own (--engine-process, default) or an in-process thread."""
    if config.server.engine_process:
        from sloserve.engine.mp_client import MPEngineClient

        return MPEngineClient(config)
    from sloserve.engine import AsyncEngine

    return AsyncEngine(config)


async def start_edges(config: SloserveConfig, engine: Any, http: HttpConfig | None) -> Lifecycle:
    """The lifecycle over `engine`, its gRPC edge and (unless `http` is None) its HTTP edge, all started."""
    lifecycle = Lifecycle(config, engine)
    grpc_server = SloserveServer(config, engine, lifecycle=lifecycle)
    try:
        await grpc_server.start()
        if http is not None:
            # NOTE: uvicorn and starlette are imported only when HTTP is on
            from sloserve.http.server import HttpServer

            await HttpServer(lifecycle, http).start()
    except BaseException:
        await lifecycle.stop()
        raise
    lifecycle.start()
    return lifecycle


async def run(config: SloserveConfig, engine: Any | None = None, http: HttpConfig | None = None) -> int:
    """Serve until SIGTERM/SIGINT (drain, exit 0) or a dead engine (exit 1); returns the exit code.

    `http` None serves gRPC only. A model that cannot be loaded (a ValueError such as
    CheckpointError) is raised as ValueError, which the CLI prints as one line with exit status 2.
    """
    if engine is None:
        engine = build_engine_client(config)
    lifecycle = await start_edges(config, engine, http)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(lifecycle.dead.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in waiters:
        task.cancel()
    if lifecycle.dead.is_set():
        await lifecycle.stop()
        if isinstance(lifecycle.start_error, ValueError):
            raise ValueError(f"cannot load model {config.model.path!r}: {lifecycle.start_error}")
        log.error("exiting: the engine is dead")
        return 1
    log.info("signal received: shutting down gracefully")
    await lifecycle.drain(config.server.grace_s)
    log.info("stopped")
    return 0


def main(config: SloserveConfig, http: HttpConfig | None = None) -> int:
    """Configure logging and run the server in a fresh event loop."""
    configure_logging(config.server.log_format)
    return asyncio.run(run(config, http=http))
