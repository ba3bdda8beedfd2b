"""One engine client behind any number of edges: load it, watch it, drain and stop it."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Protocol

from sloserve.config import SloserveConfig
from sloserve.engine.client import EngineClient
from sloserve.frontend.frontend import Frontend
from sloserve.frontend.heap import trim_when_idle
from sloserve.frontend.metrics import Metrics
from sloserve.frontend.metrics_http import tls_context

log = logging.getLogger(__name__)


class Edge(Protocol):
    """A transport over the shared front end (the gRPC server, the HTTP server)."""

    async def readiness(self, ready: bool, alive: bool) -> None:
        """Readiness changed (`alive` False: the engine is dead and the process is about to exit)."""

    async def begin_drain(self) -> None:
        """New requests are now refused by the front end; say so to health checks."""

    async def end_drain(self, linger_s: float) -> None:
        """In-flight requests are done (or grace is over: end them); linger up to `linger_s` for clients."""

    async def stop(self) -> None:
        """Stop serving."""


class Lifecycle:
    """The shared engine client, Frontend and Metrics of one server process, and their life.

    The engine loads in the background (readiness flips later); a watchdog polls it and tells
    every edge when readiness changes. When the engine loop has died, `dead` is set: the caller
    exits non-zero so an orchestrator restarts it. `drain` refuses new requests on every edge,
    lets in-flight ones finish within grace, then stops the edges, the metrics endpoint and the
    engine, in that order.
    """

    def __init__(
        self, config: SloserveConfig, engine: EngineClient, *, watchdog_interval_s: float = 0.5
    ) -> None:
        self.config = config
        self.engine = engine
        self.watchdog_interval_s = watchdog_interval_s
        self.metrics = Metrics(
            engine.stats,
            engine_info=lambda: engine.model_info,
            model_name=config.server.served_model_name or config.model.path,
            compat=config.server.metrics_compat,
        )
        self.frontend = Frontend(engine, config, self.metrics)
        self.edges: list[Edge] = []
        self.dead = asyncio.Event()
        self.start_error: BaseException | None = None  # why the engine failed to load, if it did
        self.ready = False
        self.metrics_port: int | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopped = False

    def serve_metrics(self) -> None:
        """Start the Prometheus endpoint on --metrics-port (if on); ValueError if it cannot bind."""
        cfg = self.config.server
        if cfg.metrics_port is None or self.metrics_port is not None:
            return
        tls = None
        if cfg.tls_cert and cfg.tls_key:  # the same TLS (and client certificates) as the API ports
            try:
                tls = tls_context(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(
                    f"cannot serve metrics with --tls-cert/--tls-key/--tls-ca: {exc}"
                ) from None
        host = cfg.metrics_host or cfg.host
        try:
            self.metrics_port = self.metrics.serve(
                cfg.metrics_port, host, tls=tls, token=cfg.metrics_token
            )
        except OSError as exc:
            raise ValueError(
                f"cannot serve metrics on {host}:{cfg.metrics_port}: {exc.strerror}; "
                "pick another --metrics-port or --metrics-host (or --metrics-port off)"
            ) from None

    @property
    def metrics_url(self) -> str | None:
        """Where Prometheus scrapes this server, once the port is bound."""
        if self.metrics_port is None:
            return None
        cfg = self.config.server
        return f"{'https' if cfg.tls_cert else 'http'}://{cfg.metrics_host or cfg.host}:{self.metrics_port}/metrics"

    def start(self, *, start_engine: bool = True) -> None:
        """Load the engine in the background and start the watchdog."""
        if start_engine:
            self._tasks.append(asyncio.create_task(self._start_engine()))
        self._tasks.append(asyncio.create_task(self._watchdog()))
        cfg = self.config
        if cfg.server.engine_process or cfg.model.host_malloc == "system":  # see frontend/heap.py
            self._tasks.append(asyncio.create_task(trim_when_idle(lambda: self.frontend.inflight)))

    async def _start_engine(self) -> None:
        try:
            await self.engine.start()
        except Exception as exc:  # noqa: BLE001 - a model that cannot load is fatal for this server
            self.start_error = exc
            # CheckpointError and friends: the user's to fix, no traceback
            if isinstance(exc, ValueError):
                log.error("cannot load model %r: %s", self.config.model.path, exc)
            else:
                log.error("engine failed to start: %s", exc, exc_info=exc)
            self.dead.set()
            return
        info = dict(self.engine.model_info)
        summary = ", ".join(
            f"{key}={info[key]}"
            for key in (
                "model",
                "architecture",
                "device",
                "dtype",
                "dtype_reason",
                "weight_resident_bytes",
                "quantization",
                "attention_backend",
                "kv_cache_dtype",
                "kv_tokens",
                "max_model_len",
                "tensor_parallel_size",
                "tensor_parallel_devices",
            )
            if key in info
        )
        log.info("model loaded and warmed up: %s", summary)

    async def _watchdog(self) -> None:
        """Poll the engine: readiness follows ready/alive; a dead loop sets `dead`."""
        current = None
        while True:
            if self.engine.ready and self.engine.dead_reason is not None:
                log.error("engine loop died: %s", self.engine.dead_reason)
                self.ready = False
                for edge in self.edges:
                    await edge.readiness(False, alive=False)
                self.dead.set()
                return
            ready = self.engine.ready and self.engine.alive and not self.frontend.draining
            if ready != current and not self.frontend.draining:
                if current is None:
                    log.info(
                        "readiness: %s",
                        "SERVING" if ready else "NOT_SERVING until the model is loaded",
                    )
                elif ready:
                    log.info("readiness: SERVING")
                else:
                    log.warning("readiness: NOT_SERVING (the engine loop is stuck or stopped)")
                self.ready = ready
                for edge in self.edges:
                    await edge.readiness(ready, alive=True)
                current = ready
            await asyncio.sleep(self.watchdog_interval_s)

    async def drain(self, grace_s: float) -> bool:
        """Refuse new requests (UNAVAILABLE), let in-flight ones finish within grace, then stop.

        Returns False when grace ran out with requests still in flight (the edges end them).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        self.frontend.start_draining()
        self.ready = False
        for edge in self.edges:
            await edge.begin_drain()
        log.info("draining: %d request(s) in flight, grace %.1fs", self.frontend.inflight, grace_s)
        finished = await self.frontend.wait_idle(grace_s)
        if not finished:
            log.warning(
                "grace period over: cancelling %d request(s) still running", self.frontend.inflight
            )
        linger = max(0.0, deadline - loop.time()) if finished else 0.0
        await asyncio.gather(*(edge.end_drain(linger) for edge in self.edges))
        await self.stop()
        return finished

    async def stop(self) -> None:
        """Stop the edges, the watchdog, the metrics endpoint and the engine (once)."""
        if self._stopped:
            return
        self._stopped = True
        for task in self._tasks:
            task.cancel()
        for edge in self.edges:
            await edge.stop()
        await asyncio.to_thread(self.metrics.stop)  # HTTP server shutdown blocks up to 0.5 s
        try:
            await self.engine.stop()
        except Exception as exc:  # noqa: BLE001 - stopping a dead engine may fail; we exit anyway
            log.warning("engine stop: %s", exc)
