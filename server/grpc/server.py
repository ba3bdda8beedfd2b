"""The gRPC server around one front end: service, health, reflection, metrics endpoint, drain."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from sloserve.config import SloserveConfig
from sloserve.frontend import Frontend, Metrics
from sloserve.grpc import handlers
from sloserve.grpc.interceptors import AuthInterceptor, ExceptionInterceptor
from sloserve.grpc.service import SloserveService
from sloserve.pb import serving_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["Sloserve"].full_name  # sloserve.v1.Sloserve
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STREAM_LINGER_S = 1.0  # after a drain, how long idle Streams stay open for late writers


def read_tls(cert: str, key: str) -> grpc.ServerCredentials:
    """Server credentials from PEM files; ValueError names the file that cannot be read."""
    pems = []
    for flag, path in (("--tls-key", key), ("--tls-cert", cert)):
        try:
            pems.append(Path(path).read_bytes())
        except OSError as exc:
            raise ValueError(f"cannot read {flag} file {path!r}: {exc.strerror}") from None
    return grpc.ssl_server_credentials([(pems[0], pems[1])])


class SloserveServer:
    """One gRPC server around one engine; readiness follows the engine, SIGTERM drains it.

    Health: "" (liveness) is SERVING while the process can make progress; SERVICE_NAME
    (readiness) is SERVING only when the engine is loaded, warmed up, alive (loop not stuck) and
    the server is not draining. When the engine loop has died, `dead` is set: the caller exits
    non-zero so an orchestrator restarts it.
    """

    def __init__(self, config: SloserveConfig, engine: Any, *, watchdog_interval_s: float = 0.5) -> None:
        self.config = config
        self.engine = engine
        self.watchdog_interval_s = watchdog_interval_s
        self.metrics = Metrics(engine.stats)
        self.frontend = Frontend(engine, config, self.metrics)
        self.service = SloserveService(self.frontend)
        self.health = health_aio.HealthServicer()
        self.dead = asyncio.Event()
        self.start_error: BaseException | None = None  # why the engine failed to load, if it did
        self.port = 0
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self, *, start_engine: bool = True) -> None:
        """Bind and start serving now; load the engine in the background (readiness flips later)."""
        cfg = self.config.server
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if cfg.auth_token:
            interceptors.append(AuthInterceptor(cfg.auth_token))
        interceptors.append(ExceptionInterceptor())
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        server = grpc.aio.server(interceptors=interceptors, options=options)
        handlers.add_to_server(self.service, server)  # undecodable requests -> INVALID_ARGUMENT
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], server)
        address = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert and cfg.tls_key:
                self.port = server.add_secure_port(address, read_tls(cfg.tls_cert, cfg.tls_key))
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise ValueError(f"cannot listen on {address}: the port is in use or the host is not "
                             "an address of this machine; pick another --port or --host")
        await self.health.set("", SERVING)
        await self.health.set(SERVICE_NAME, NOT_SERVING)
        if cfg.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve(cfg.metrics_port, cfg.host)
            except OSError as exc:
                raise ValueError(f"cannot serve metrics on {cfg.host}:{cfg.metrics_port}: {exc.strerror}; "
                                 "pick another --metrics-port (or --metrics-port off)") from None
        await server.start()
        self._server = server
        log.info("listening on %s:%d (%s)%s", cfg.host, self.port, "TLS" if cfg.tls_cert else "plaintext",
                 f", metrics on http://{cfg.host}:{self.metrics_port}/metrics" if self.metrics_port else "")
        if start_engine:
            self._tasks.append(asyncio.create_task(self._start_engine()))
        self._tasks.append(asyncio.create_task(self._watchdog()))

    async def _start_engine(self) -> None:
        try:
            await self.engine.start()
        except Exception as exc:  # noqa: BLE001 - a model that cannot load is fatal for this server
            self.start_error = exc
            if isinstance(exc, ValueError):  # CheckpointError and friends: the user's to fix, no traceback
                log.error("cannot load model %r: %s", self.config.model.path, exc)
            else:
                log.error("engine failed to start: %s", exc, exc_info=exc)
            self.dead.set()
            return
        info = dict(self.engine.model_info)
        summary = ", ".join(f"{key}={info[key]}" for key in
                            ("model", "architecture", "device", "dtype", "attention_backend", "max_model_len")
                            if key in info)
        log.info("model loaded and warmed up: %s", summary)

    async def _watchdog(self) -> None:
        """Poll the engine: readiness follows ready/alive; a dead loop sets `dead`."""
        current = None
        while True:
            if self.engine.ready and self.engine.dead_reason is not None:
                log.error("engine loop died: %s", self.engine.dead_reason)
                await self.health.set(SERVICE_NAME, NOT_SERVING)
                await self.health.set("", NOT_SERVING)
                self.dead.set()
                return
            ready = self.engine.ready and self.engine.alive and not self.frontend.draining
            if ready != current and not self.frontend.draining:
                if current is None:
                    log.info("readiness: %s", "SERVING" if ready else "NOT_SERVING until the model is loaded")
                elif ready:
                    log.info("readiness: SERVING")
                else:
                    log.warning("readiness: NOT_SERVING (the engine loop is stuck or stopped)")
                await self.health.set(SERVICE_NAME, SERVING if ready else NOT_SERVING)
                current = ready
            await asyncio.sleep(self.watchdog_interval_s)

    async def drain(self, grace_s: float) -> bool:
        """Stop admitting (UNAVAILABLE), let in-flight requests finish within grace, then stop.

        Once idle, open Streams stay up to STREAM_LINGER_S more (within grace) so that a client
        writing just after the signal gets UNAVAILABLE instead of a broken stream; the drain goes
        on as soon as every client has closed its stream.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        self.frontend.start_draining()
        await self.health.enter_graceful_shutdown()
        log.info("draining: %d request(s) in flight, grace %.1fs", self.frontend.inflight, grace_s)
        finished = await self.frontend.wait_idle(grace_s)
        if finished:
            await self.service.wait_streams_closed(max(0.0, min(STREAM_LINGER_S, deadline - loop.time())))
        else:
            log.warning("grace period over: cancelling %d request(s) still running", self.frontend.inflight)
        self.service.close_streams()
        await self.stop(grace_s=0.5)
        return finished

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop the gRPC server, the watchdog, the metrics endpoint and the engine."""
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        await asyncio.to_thread(self.metrics.stop)  # HTTP server shutdown blocks up to 0.5 s
        try:
            await self.engine.stop()
        except Exception as exc:  # noqa: BLE001 - stopping a dead engine may fail; we exit anyway
            log.warning("engine stop: %s", exc)
