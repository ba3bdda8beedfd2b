"""Run sloserve: config -> engine client -> lifecycle (front end) -> gRPC and HTTP edges; signals, exit codes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from sloserve.config import SloserveConfig
from sloserve.engine.client import EngineClient
from sloserve.frontend.lifecycle import Lifecycle
from sloserve.frontend_procs import FrontendProcesses
from sloserve.grpc.server import SloserveServer
from sloserve.http.config import HttpConfig
from sloserve.logs import configure_logging

log = logging.getLogger(__name__)


def build_engine_client(
    config: SloserveConfig, make_core: Callable[..., Any] | None = None
) -> EngineClient:
    """The engine client: an engine process of its own (--engine-process, default) or an in-process thread.

    `make_core` replaces EngineCore where the core is built (sloserve.testing wraps it with faults).
    """
    factory = {} if make_core is None else {"make_core": make_core}
    if config.server.engine_process:
        from sloserve.engine.mp_client import MPEngineClient

        return MPEngineClient(config, **factory)
    from sloserve.engine import AsyncEngine

    return AsyncEngine(config, **factory)


async def start_edges(
    config: SloserveConfig, engine: EngineClient, http: HttpConfig | None
) -> Lifecycle:
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


async def run(
    config: SloserveConfig,
    engine: EngineClient | None = None,
    http: HttpConfig | None = None,
    make_core: Callable[..., Any] | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (drain, exit 0) or a dead engine (exit 1); returns the exit code.

    `http` None serves gRPC only. A model that cannot be loaded (a ValueError such as
    CheckpointError) is raised as ValueError, which the CLI prints as one line with exit status 2.
    `make_core` builds the engine core instead of EngineCore (see build_engine_client).
    """
    if engine is None:
        engine = build_engine_client(config, make_core)
    lifecycle = await start_edges(config, engine, http)
    others = _start_other_frontends(config, engine, lifecycle, http)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    events = [stop, lifecycle.dead] + ([others.lost] if others else [])
    waiters = [asyncio.create_task(event.wait()) for event in events]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in waiters:
        task.cancel()
    if lifecycle.dead.is_set() or (others is not None and others.lost.is_set()):
        if others is not None:
            others.terminate()
            engine.before_shutdown = lambda: others.wait(5.0)
        await lifecycle.stop()
        if isinstance(lifecycle.start_error, ValueError):
            raise ValueError(f"cannot load model {config.model.path!r}: {lifecycle.start_error}")
        log.error(
            "exiting: %s", "the engine is dead" if lifecycle.dead.is_set() else "a front end died"
        )
        return 1
    log.info("signal received: shutting down gracefully")
    if others is not None:  # they drain their own requests; the engine stops once they are gone
        others.terminate()
        engine.before_shutdown = lambda: others.wait(config.server.grace_s + 10.0)
    await lifecycle.drain(config.server.grace_s)
    log.info("stopped")
    return 0


def _start_other_frontends(
    config: SloserveConfig, engine: Any, lifecycle: Lifecycle, http: HttpConfig | None
) -> FrontendProcesses | None:
    """Front ends 1..N-1 on the ports front end 0 bound (None with one front end)."""
    count = config.server.frontends
    if count == 1 or not getattr(engine, "owns_engine", False):
        return None
    ports = {type(edge).__name__: edge.port for edge in lifecycle.edges}
    args = []
    for k in range(1, count):
        metrics_port = config.server.metrics_port
        server = dataclasses.replace(
            config.server,
            port=ports["SloserveServer"],
            metrics_port=metrics_port + k if metrics_port else metrics_port,
        )
        edge_http = None if http is None else dataclasses.replace(http, port=ports["HttpServer"])
        args.append((dataclasses.replace(config, server=server), edge_http, engine.link(k)))
    others = FrontendProcesses(run_frontend, args)
    others.start()
    return others


def run_frontend(config: SloserveConfig, http: HttpConfig | None, link: Any) -> None:
    """Entry point of front end `link.index` of --frontends (a spawned process): serve until told to stop."""
    from sloserve.engine.mp_client import MPEngineClient
    from sloserve.engine.process import die_with_parent

    die_with_parent()
    configure_logging(config.server.log_format)
    try:
        code = asyncio.run(run(config, engine=MPEngineClient(config, link=link), http=http))
    except ValueError as exc:  # the model cannot load: front end 0 reports it
        log.error("front end %d: %s", link.index, exc)
        code = 2
    sys.exit(code)


def main(
    config: SloserveConfig,
    http: HttpConfig | None = None,
    make_core: Callable[..., Any] | None = None,
) -> int:
    """Configure logging and run the server in a fresh event loop."""
    configure_logging(config.server.log_format)
    return asyncio.run(run(config, http=http, make_core=make_core))
