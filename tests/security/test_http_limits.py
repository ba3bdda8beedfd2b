"""Hostile HTTP clients against a real `sloserve serve`: each attack is cut by its limit, on loopback.

One server with small limits: 16 connections, 16 KiB of headers within 3 s, a body within 3 s,
64 KiB bodies, 2 s of keep-alive idle. Every wait below is a generous bound on a limit of a few
seconds (nothing here measures time); every loop is bounded.
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sloserve.frontend.metrics_http import MAX_SCRAPES

from tests.http.conftest import AUTH, TOKEN, HttpServerProcess, start
from tests.metrics_text import sample_spec

pytestmark = pytest.mark.timeout(180)

MAX_CONNECTIONS, HEADER_S, BODY_S, KEEP_ALIVE_S, MAX_BODY, MAX_HEADER = (
    16,
    3,
    3,
    2,
    64 * 1024,
    16 * 1024,
)
WAIT_S = 30.0  # the longest any socket read below waits: ten times a limit


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[HttpServerProcess]:
    server = start(
        tiny_llama,
        None,
        "--auth-token",
        TOKEN,
        "--http-max-connections",
        str(MAX_CONNECTIONS),
        "--http-header-timeout",
        str(HEADER_S),
        "--http-body-timeout",
        str(BODY_S),
        "--http-keep-alive",
        str(KEEP_ALIVE_S),
        "--http-max-body-size",
        f"{MAX_BODY // 1024}KiB",
        "--http-max-header-size",
        f"{MAX_HEADER // 1024}KiB",
        "--metrics-port",
        "0",
    )
    try:
        yield server
    finally:
        server.stop()


def _connect(server: HttpServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=WAIT_S)
    sock.settimeout(WAIT_S)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _refusals(server: HttpServerProcess, limit: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return _sample(text, f'sloserve_limit_refusals_total{{limit="{limit}"}}')


def _sample(text: str, name: str) -> float:
    return sample_spec(text, name)


def _errors(server: HttpServerProcess) -> list[dict]:
    return [entry for entry in server.logs if entry.get("level") in ("error", "critical")]


def test_slowloris_headers_are_closed_after_the_header_timeout(server):
    before = _refusals(server, "http_header_timeout")
    socks = [_connect(server) for _ in range(8)]
    try:
        for i, sock in enumerate(socks):  # half send a partial request, half nothing at all
            if i % 2:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        trickler = socks[1]  # one of those goes on sending its header, a byte at a time
        # one byte at a time keeps data flowing, not the request alive
        for _ in range(4 * HEADER_S):
            with contextlib.suppress(OSError):
                trickler.sendall(b"a")
            time.sleep(0.5)
        replies = [_read_until_closed(sock) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert all(
        reply.startswith(b"HTTP/1.1 408 ") and b"--http-header-timeout" in reply
        for reply in replies
    ), replies
    assert _refusals(server, "http_header_timeout") >= before + len(socks)


def test_endless_headers_are_refused_past_the_header_size(server):
    before = _refusals(server, "http_header_size")
    # one header that never ends: httptools alone would buffer it all
    with _connect(server) as sock:
        sock.sendall(
            b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * (MAX_HEADER + 1024)
        )
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 431 ") and b"--http-max-header-size" in reply, reply
    assert _refusals(server, "http_header_size") == before + 1


def test_the_connection_cap_refuses_with_503(server):
    socks = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        # the server has accepted all of them once it answers on one of them
        socks[-1].sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert socks[-1].recv(65536).startswith(b"HTTP/1.1 ")
        extra = _connect(server)
        with extra:
            reply = _read_until_closed(extra)
    finally:
        for sock in socks:
            sock.close()
    assert reply.startswith(b"HTTP/1.1 503 ") and b"--http-max-connections" in reply, reply
    assert _refusals(server, "http_connections") >= 1


def test_a_slow_body_is_cut_after_the_body_timeout_and_logged_as_no_error(server):
    before = _refusals(server, "http_body_timeout")
    sock = _connect(server)
    with sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer "
            + TOKEN.encode()
            + b'\r\nContent-Length: 60000\r\n\r\n{"prompt": "'
        )
        for _ in range(4 * BODY_S):  # 10 bytes every half second: far too slow for 60000
            with contextlib.suppress(OSError):
                sock.sendall(b"a" * 10)
            time.sleep(0.5)
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"--http-body-timeout" in reply, reply
    assert _refusals(server, "http_body_timeout") >= before + 1
    assert not _errors(server), _errors(server)


def test_a_client_gone_mid_body_is_counted_cancelled_without_an_error_line(server):
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    cancelled = _sample(metrics, 'sloserve_requests_total{outcome="cancelled"}')
    internal = _sample(metrics, 'sloserve_requests_total{outcome="internal"}')
    for _ in range(3):
        with _connect(server) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
                + TOKEN.encode()
                + b'\r\nContent-Length: 1000\r\n\r\n{"prompt": "hi'
            )
    for _ in range(100):  # until the server has seen the three disconnects
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        if _sample(metrics, 'sloserve_requests_total{outcome="cancelled"}') >= cancelled + 3:
            break
        time.sleep(0.1)
    assert _sample(metrics, 'sloserve_requests_total{outcome="cancelled"}') == cancelled + 3
    assert _sample(metrics, 'sloserve_requests_total{outcome="internal"}') == internal
    assert not _errors(server), _errors(server)


def test_a_body_over_the_limit_is_refused_as_it_arrives(server):
    with _connect(server) as sock:  # chunked: no length to check first; never read whole
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
            + TOKEN.encode()
            + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"a" * 8192
        # one chunk past the limit, then wait for the answer
        for _ in range(MAX_BODY // len(chunk) + 1):
            sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413 ") and b"--http-max-body-size" in reply, reply
    declared = httpx.post(
        f"{server.url}/v1/completions",
        headers={**AUTH, "Content-Length": str(MAX_BODY + 1)},
        content=b"x" * (MAX_BODY + 1),
        timeout=10,
    )
    assert declared.status_code == 413 and declared.headers["connection"] == "close"


def test_an_idle_keep_alive_connection_is_closed(server):
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        reply = _read_until_closed(sock)  # nothing more is sent: the keep-alive timeout closes it
    # and no 408 after
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.count(b"HTTP/1.1 ") == 1, reply


def test_blank_lines_do_not_keep_an_idle_connection_open(server):
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        # a blank line every 0.25 s: each would reset a keep-alive timer
        for _ in range(8 * HEADER_S):
            try:
                sock.sendall(b"\r\n")
            except OSError:
                break
            time.sleep(0.25)
        with contextlib.suppress(ConnectionResetError):
            reply = _read_until_closed(sock)  # closed (a timeout here means it was held open)
            assert reply.startswith(b"HTTP/1.1 200 "), reply


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_the_bearer_scheme_is_case_insensitive(server, scheme):
    reply = httpx.get(
        f"{server.url}/v1/models", headers={"Authorization": f"{scheme} {TOKEN}"}, timeout=10
    )
    assert reply.status_code == 200, reply.text
    wrong = httpx.get(
        f"{server.url}/v1/models", headers={"Authorization": f"{scheme} {TOKEN}x"}, timeout=10
    )
    assert wrong.status_code == 401


def test_a_flood_of_malformed_requests_logs_a_few_lines_not_one_each(server):
    for _ in range(30):
        with _connect(server) as sock:
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            assert _read_until_closed(sock).startswith(b"HTTP/1.1 400 ")
    server.wait_log(lambda m: m.startswith("Invalid HTTP request"), 10)
    lines = [m for m in server.messages() if m.startswith("Invalid HTTP request")]
    assert 1 <= len(lines) <= 5, lines


def test_the_metrics_port_cuts_silent_clients_and_caps_connections(server):
    line = server.wait_log(lambda m: m.startswith("listening on "), 5)
    port = int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line).group(1))
    silent = [
        socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(MAX_SCRAPES)
    ]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as extra:
            with contextlib.suppress(ConnectionResetError):
                assert _read_until_closed(extra) == b""  # closed unanswered: every slot is taken
        for sock in silent:  # each is cut after the read timeout, unanswered
            sock.settimeout(WAIT_S)
            with contextlib.suppress(ConnectionResetError):
                assert _read_until_closed(sock) == b""
    finally:
        for sock in silent:
            sock.close()
    assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 200
