"""The gRPC edge around the shared front end: service, health, reflection; an Edge of the Lifecycle."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from sloserve.config import SloserveConfig
from sloserve.engine.client import EngineClient
from sloserve.frontend import Frontend, Metrics
from sloserve.frontend.lifecycle import Lifecycle
from sloserve.grpc import handlers
from sloserve.grpc.interceptors import AuthInterceptor, ExceptionInterceptor
from sloserve.grpc.service import SloserveService
from sloserve.pb import serving_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["Sloserve"].full_name  # sloserve.v1.Sloserve
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STREAM_LINGER_S = 1.0  # after a drain, how long idle Streams stay open for late writers


def read_tls(cert: str, key: str, ca: str | None = None) -> grpc.ServerCredentials:
    """Server credentials from PEM files (`ca`: client certificates it signed are required, mTLS);
    ValueError names the file that cannot be read."""
    pems = []
    for flag, path in (("--tls-key", key), ("--tls-cert", cert), ("--tls-ca", ca)):
        if path is None:
            pems.append(None)
            continue
        try:
            pems.append(Path(path).read_bytes())
        except OSError as exc:
            raise ValueError(f"cannot read {flag} file {path!r}: {exc.strerror}") from None
    return grpc.ssl_server_credentials(
        [(pems[0], pems[1])], root_certificates=pems[2], require_client_auth=pems[2] is not None
    )


class SloserveServer:
    """The gRPC edge over one front end: service, health, reflection; readiness follows the engine.

    Health: "" (liveness) is SERVING while the process can make progress; SERVICE_NAME
    (readiness) is SERVING only when the engine is loaded, warmed up, alive (loop not stuck) and
    the server is not draining. The engine's life (load, watchdog, drain, stop) is the
    `Lifecycle`'s: given one, this server is one of its edges (`sloserve serve` also runs the
    HTTP edge on it); without one it makes and owns its own, so that start/drain/stop run it all.
    """

    def __init__(
        self,
        config: SloserveConfig,
        engine: EngineClient,
        *,
        watchdog_interval_s: float = 0.5,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self._owns_lifecycle = lifecycle is None
        self.lifecycle = lifecycle or Lifecycle(
            config, engine, watchdog_interval_s=watchdog_interval_s
        )
        self.lifecycle.edges.append(self)
        self.service = SloserveService(self.frontend, config.grpc)
        self.health = health_aio.HealthServicer()
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._stop_grace_s: float | None = None  # drain stops with 0.5 s of grace

    # the shared parts, read through the lifecycle (tests and callers use these names)
    @property
    def frontend(self) -> Frontend:
        return self.lifecycle.frontend

    @property
    def metrics(self) -> Metrics:
        return self.lifecycle.metrics

    @property
    def dead(self) -> asyncio.Event:
        return self.lifecycle.dead

    @property
    def start_error(self) -> BaseException | None:
        return self.lifecycle.start_error

    @property
    def metrics_port(self) -> int | None:
        return self.lifecycle.metrics_port

    async def start(self, *, start_engine: bool = True) -> None:
        """Bind and start serving now; an owned lifecycle also loads the engine in the background."""
        cfg = self.config.server
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if cfg.auth_token:
            interceptors.append(AuthInterceptor(cfg.auth_token))
        interceptors.append(ExceptionInterceptor())
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", int(cfg.frontends > 1)),  # several front ends share the port
            *self.config.grpc.channel_options(),
        ]
        server = grpc.aio.server(interceptors=interceptors, options=options)
        handlers.add_to_server(self.service, server)  # undecodable requests -> INVALID_ARGUMENT
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            server,
        )
        address = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert and cfg.tls_key:
                self.port = server.add_secure_port(
                    address, read_tls(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
                )
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise ValueError(
                f"cannot listen on {address}: the port is in use or the host is not "
                "an address of this machine; pick another --port or --host"
            )
        await self.health.set("", SERVING)
        await self.health.set(SERVICE_NAME, NOT_SERVING)
        self.lifecycle.serve_metrics()
        await server.start()
        self._server = server
        metrics_port = self.lifecycle.metrics_port
        log.info(
            "listening on %s:%d (%s)%s",
            cfg.host,
            self.port,
            _security(cfg),
            f", metrics on {self.lifecycle.metrics_url}" if metrics_port else "",
        )
        if self._owns_lifecycle:
            self.lifecycle.start(start_engine=start_engine)

    # ---- Edge ------------------------------------------------------------------------------
    async def readiness(self, ready: bool, alive: bool) -> None:
        await self.health.set(SERVICE_NAME, SERVING if ready else NOT_SERVING)
        if not alive:
            await self.health.set("", NOT_SERVING)

    async def begin_drain(self) -> None:
        await self.health.enter_graceful_shutdown()

    async def end_drain(self, linger_s: float) -> None:
        """Once idle, open Streams stay up to STREAM_LINGER_S more (within grace) so that a client
        writing just after the signal gets UNAVAILABLE instead of a broken stream; the drain goes
        on as soon as every client has closed its stream.
        """
        if linger_s > 0:
            await self.service.wait_streams_closed(min(STREAM_LINGER_S, linger_s))
        self.service.close_streams()

    async def drain(self, grace_s: float) -> bool:
        """Drain the lifecycle (and so every edge on it); see Lifecycle.drain."""
        self._stop_grace_s = 0.5
        return await self.lifecycle.drain(grace_s)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop the gRPC server; an owned lifecycle also stops the metrics endpoint and the engine."""
        if grace_s is not None:
            self._stop_grace_s = grace_s
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(self._stop_grace_s)
        if self._owns_lifecycle:
            await self.lifecycle.stop()


def _security(cfg) -> str:
    return "mTLS" if cfg.tls_ca else "TLS" if cfg.tls_cert else "plaintext"
