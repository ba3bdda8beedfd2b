"""The HTTP edge: uvicorn serving the OpenAI-compatible app in the server's own event loop."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

import uvicorn
from sloserve.frontend.lifecycle import Lifecycle
from sloserve.http.app import HttpApi
from sloserve.http.config import HttpConfig
from sloserve.http.guard import protocol_class
from sloserve.logs import ThrottleWarnings

log = logging.getLogger(__name__)

SHUTDOWN_S = 2.0  # after the drain, how long open connections get to finish their last bytes


class HttpServer:
    """An Edge of the Lifecycle: shares its front end, engine client, auth, TLS, limits and metrics.

    NOTE: uvicorn runs inside the process's asyncio loop (no worker processes, no signal
    handlers of its own: `sloserve.serve` handles SIGTERM and drains every edge). We bind the
    socket ourselves so that a busy port is a one-line error, not uvicorn's sys.exit.
    """

    def __init__(self, lifecycle: Lifecycle, http: HttpConfig) -> None:
        self.lifecycle = lifecycle
        self.http = http
        self.api = HttpApi(lifecycle, http)
        self.port = 0
        self._sock: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        lifecycle.edges.append(self)

    async def start(self) -> None:
        cfg = self.lifecycle.config.server
        http = self.http
        tls = bool(cfg.tls_cert and cfg.tls_key)
        mtls = tls and cfg.tls_ca is not None
        protocol = protocol_class(http, self.lifecycle.metrics.limit_refused)
        config = uvicorn.Config(
            self.api.app,
            host=cfg.host,
            port=http.port,
            log_config=None,
            http=protocol,
            access_log=False,
            lifespan="off",
            ws="none",
            server_header=False,
            timeout_graceful_shutdown=SHUTDOWN_S,
            timeout_keep_alive=http.keep_alive_s,
            ssl_certfile=cfg.tls_cert if tls else None,
            ssl_keyfile=cfg.tls_key if tls else None,
            ssl_ca_certs=cfg.tls_ca if mtls else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if mtls else ssl.CERT_NONE,
        )
        try:
            config.load()
        except (OSError, ValueError) as exc:  # an unreadable or mismatched certificate/key/CA
            raise ValueError(
                f"cannot serve HTTPS with --tls-cert/--tls-key/--tls-ca: {exc}"
            ) from None
        self._sock = _bind(cfg.host, self.http.port, reuse_port=cfg.frontends > 1)
        self.port = self._sock.getsockname()[1]
        _throttle_uvicorn_warnings()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[self._sock])
        self._server = server
        self._task = asyncio.create_task(server.main_loop())
        log.info(
            "http listening on %s:%d (%s): OpenAI-compatible /v1/completions, /v1/chat/completions",
            cfg.host,
            self.port,
            "mTLS" if mtls else "TLS" if tls else "plaintext",
        )

    # ---- Edge ------------------------------------------------------------------------------
    async def readiness(self, ready: bool, alive: bool) -> None:
        """/health reads the state when asked: nothing to push."""

    async def begin_drain(self) -> None:
        """The front end refuses new requests with 503 and /health says 503: nothing more to do."""

    async def end_drain(self, linger_s: float) -> None:
        self.api.completions.shut_down()  # requests still live past grace answer 503 'shutdown'

    async def stop(self) -> None:
        server, task, self._server, self._task = self._server, self._task, None, None
        if server is None:
            return
        server.should_exit = True
        if task is not None:
            await task
        await server.shutdown(sockets=[self._sock] if self._sock else None)
        self._sock = None


def _throttle_uvicorn_warnings() -> None:
    """uvicorn warns once per malformed request: at most once per 10 s per message, so a flood stays readable."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, ThrottleWarnings) for f in logger.filters):
        logger.addFilter(ThrottleWarnings())


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening socket on host:port (0 picks a free port); ValueError saying what to change.

    reuse_port: SO_REUSEPORT, so the other front ends of --frontends bind the same port.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # NOTE: proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and
    # accepted sockets inherit it; without it Nagle + delayed ACKs held each keep-alive reply ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port} for HTTP: {exc.strerror}; pick another "
            "--http-port (or --http-port off)"
        ) from None
    return sock
