"""The Prometheus port: /metrics in a thread of its own, behind the server's TLS (mTLS with --tls-ca)
and, with --metrics-token, a bearer token; slow or silent clients are cut after READ_TIMEOUT_S, and
at most MAX_SCRAPES connections are served at once."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from sloserve.frontend.bearer import bearer_matches

READ_TIMEOUT_S = 10.0  # a scrape's handshake and request must arrive within this
# connections served at once; more are closed at once (Prometheus scrapes one at a time)
MAX_SCRAPES = 16


class _Handler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # socketserver sets it on the connection: a silent client is cut

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        """Quiet: a scrape every few seconds is not news."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    tls: ssl.SSLContext | None = None
    # one per connection being served: a flood cannot start threads without end
    slots: threading.BoundedSemaphore

    def process_request(self, request: socket.socket, client_address: tuple) -> None:
        if not self.slots.acquire(blocking=False):  # MAX_SCRAPES already open: drop this one
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: tuple) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def finish_request(self, request: socket.socket, client_address: tuple) -> None:
        """In the connection's own thread: the TLS handshake (refused clients end here, quietly), then HTTP."""
        if self.tls is not None:
            request.settimeout(READ_TIMEOUT_S)
            try:
                request = self.tls.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError):
                return
        super().finish_request(request, client_address)

    def handle_error(self, request: object, client_address: tuple) -> None:
        """A client that went away mid-scrape is no error of the server's."""


def tls_context(cert: str, key: str, ca: str | None) -> ssl.SSLContext:
    """A server context for these PEM files; `ca`: client certificates it signed are required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    if ca is not None:
        context.load_verify_locations(cafile=ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _guarded(app: Callable, token: str | None) -> Callable:
    """The WSGI app, answering 401 to a scrape without `Authorization: Bearer <token>` when a token is set."""
    if token is None:
        return app

    def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if bearer_matches(environ.get("HTTP_AUTHORIZATION"), token):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain; charset=utf-8"), ("WWW-Authenticate", "Bearer")],
        )
        return [
            b"missing or wrong bearer token: scrape with 'Authorization: Bearer <--metrics-token>'\n"
        ]

    return guarded


def serve(
    registry: CollectorRegistry,
    host: str,
    port: int,
    *,
    tls: ssl.SSLContext | None = None,
    token: str | None = None,
) -> WSGIServer:
    """Serve `registry` on host:port (0 picks a port) in a daemon thread; OSError if it cannot bind."""
    server_class = type(
        "MetricsServer",
        (_Server,),
        {
            "address_family": socket.AF_INET6 if ":" in host else socket.AF_INET,
            "tls": tls,
            "slots": threading.BoundedSemaphore(MAX_SCRAPES),
        },
    )
    server = make_server(
        host, port, _guarded(make_wsgi_app(registry), token), server_class, _Handler
    )
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
