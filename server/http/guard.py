"""What uvicorn does not bound on a connection: how many are open, and how long headers and bodies take.

uvicorn (0.30+) has a keep-alive timeout but no header or body read timeout, and its
`limit_concurrency` acts only once a request's headers are complete, so a client that opens
connections and sends its headers a byte at a time (slowloris) holds them for ever. This is
uvicorn's httptools protocol with four guards added, each counted in
`sloserve_limit_refusals_total{limit=...}` and logged at most once per 10 s per kind:

- `http_connections`: a connection past --http-max-connections is answered 503 and closed at once;
- `http_header_timeout`: a request's headers must all arrive within --http-header-timeout of its
  first byte (of the connection, for the first request), else 408 and the connection closes;
- `http_header_size`: its request line and headers may take --http-max-header-size bytes (httptools
  itself buffers a header of any length), else 431 and the connection closes;
- `http_body_timeout`: its whole body must arrive within --http-body-timeout of its headers, else
  408 (if nothing was answered yet) and the connection closes; the app sees a disconnect.

The keep-alive idle timeout between requests is uvicorn's own (--http-keep-alive); bytes that
begin no request (blank lines) reset it in uvicorn, so they start the header clock here. A 408 is
written only where no response is on the wire; a request pipelined behind another is not read
until that one ends, so its body has no clock until then.
NOTE: with TLS, asyncio calls connection_made only after the handshake, so a client stalling
its handshake is bounded by asyncio's 60 s SSL handshake timeout, not by these guards.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import ClassVar

import orjson
from sloserve.http.config import HttpConfig
from sloserve.http.errors import error_body
from sloserve.http.sse import ABORT_EXTENSION
from sloserve.logs import Throttled
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

log = logging.getLogger(__name__)
_notices = Throttled(log)


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape that closes the connection."""
    body = orjson.dumps(error_body(status, message, code=code))
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n"
    )
    if status == 503:
        head += "retry-after: 1\r\n"
    return head.encode() + b"\r\n" + body


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus a connection cap, a header timeout and a whole-body timeout."""

    limits: ClassVar[HttpConfig]
    refused: ClassVar[Callable[[str], None]]  # counts a refusal by the name of its limit

    _timer: asyncio.TimerHandle | None = None
    _phase: str | None = None  # 'header' or 'body' while its timer runs
    _header_bytes = 0  # bytes received in the current header phase
    _begun = 0  # requests begun on this connection
    _accepted = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refuse(transport)
            return
        self._accepted = True
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, "header")

    def _refuse(self, transport: asyncio.Transport) -> None:
        cap = self.limits.max_connections
        self.refused("http_connections")
        _notices.log(
            logging.WARNING,
            "connections",
            "refused an HTTP connection: %d are open, the limit (--http-max-connections)",
            cap,
        )
        transport.write(
            _raw_response(
                503,
                "Service Unavailable",
                f"this server holds at most {cap} HTTP "
                "connections (--http-max-connections); retry later",
                "too_many_connections",
            )
        )
        transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._accepted:
            return  # refused in connection_made: uvicorn never saw it
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        in_headers, begun = self._phase == "header", self._begun
        super().data_received(data)
        if self.transport.is_closing():
            return
        # bytes on an idle connection that began no request (blank lines, junk): uvicorn dropped its
        # keep-alive timer on them, so the header clock runs instead
        if self._timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm(self.limits.header_timeout_s, "header")
        # the parser holds header bytes until the headers end: bound them. Reads that are wholly header
        # bytes count: the connection's first, and any within one request's header phase (a read that
        # began a later request may also hold the previous body, so it does not: one read of slack).
        wholly_headers = self._begun == begun or (begun == 0 and self._begun == 1)
        if in_headers and self._phase == "header" and wholly_headers:
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self._too_large()

    def _too_large(self) -> None:
        cap = self.limits.max_header_bytes
        self._disarm()
        self.refused("http_header_size")
        _notices.log(
            logging.WARNING,
            "header_size",
            "closed an HTTP connection from %s: its request line and "
            "headers passed %d bytes (--http-max-header-size)",
            _peer(self.client),
            cap,
        )
        self.transport.write(
            _raw_response(
                431,
                "Request Header Fields Too Large",
                f"the request line and headers passed {cap} bytes (--http-max-header-size)",
                "headers_too_large",
            )
        )
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._begun += 1
        # a request after the first (kept alive, or pipelined behind a response)
        if self._phase != "header":
            self._header_bytes = 0
            self._arm(self.limits.header_timeout_s, "header")

    def on_headers_complete(self) -> None:
        self._disarm()
        self._header_bytes = 0
        super().on_headers_complete()
        # the app may drop a stalled stream
        if self.cycle is not None and self.cycle.scope is self.scope:
            self.scope["extensions"] = {
                ABORT_EXTENSION: functools.partial(_abort, self.cycle, self.transport)
            }
        # NOTE: a request queued behind
        if not (self.pipeline and self.pipeline[0][0] is self.cycle):
            # another (pipelined) is not read: no clock
            self._arm(self.limits.body_timeout_s, "body")

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    # ---- the one timer: the header phase, then the body phase --------------------------------
    def _arm(self, seconds: float, phase: str) -> None:
        self._disarm()
        self._phase = phase
        self._timer = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _disarm(self) -> None:
        self._phase = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, phase: str, seconds: float) -> None:
        self._timer = None
        self._phase = None
        if self.transport.is_closing():
            return
        flag = f"--http-{phase}-timeout"
        self.refused(f"http_{phase}_timeout")
        _notices.log(
            logging.WARNING,
            phase,
            "closed an HTTP connection from %s: its request %s did not arrive within %g s (%s)",
            _peer(self.client),
            "headers" if phase == "header" else "body",
            seconds,
            flag,
        )
        # a 408 only where no response is on the wire: not inside one a pipelined request waits behind,
        # nor after one the app already gave this request
        cycle = self.cycle
        if phase == "header":
            quiet = cycle is not None and not cycle.response_complete
        else:
            quiet = cycle is not None and cycle.response_started
        if not quiet:
            what = "headers" if phase == "header" else "body"
            self.transport.write(
                _raw_response(
                    408,
                    "Request Timeout",
                    f"the request {what} did not arrive within {seconds:g} s ({flag})",
                    f"{phase}_timeout",
                )
            )
        self.transport.close()  # the app, if it runs, reads a disconnect


def _abort(cycle: RequestResponseCycle, transport: asyncio.Transport) -> None:
    """Drop the connection now, with what is buffered for it; the app's sends and receives see it gone."""
    cycle.disconnected = True
    cycle.message_event.set()
    transport.abort()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown peer"


def protocol_class(limits: HttpConfig, refused: Callable[[str], None]) -> type[GuardedProtocol]:
    """The protocol class uvicorn instantiates per connection, bound to these limits and counter."""
    return type(
        "GuardedHttpProtocol",
        (GuardedProtocol,),
        {"limits": limits, "refused": staticmethod(refused)},
    )
