"""Hostile HTTP clients against a real `sloserve serve` (issue 44's figures): how many half-sent-header
connections are still open after a wait, and how much memory slow uploads hold.

    python -m benchmarks.hostile_http --slowloris 500 --uploads 20 --wait 50
    python -m benchmarks.hostile_http --slowloris 20 --uploads 4 --wait 3 \\
        --serve-arg=--http-header-timeout=1 --serve-arg=--http-body-timeout=2      # a quick check

Prints one JSON object: connections still open (of those opened), the server's RSS before, with
the uploads in, after the wait and once idle (MiB), and the limit refusals it counted.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import socket
import time

import httpx
import orjson
from sloserve.testing.procfs import vm_bytes
from sloserve.testing.server_process import ServerProcess

UPLOAD_FAST_BYTES = 4 * 2**20  # each upload sends this much at once, then trickles (declared 8 MiB)


def start(extra: list[str]) -> tuple[ServerProcess, int]:
    """A real `sloserve serve` on the default model with the HTTP API on; the server and its HTTP port."""
    server = ServerProcess.cli("default", "--http-port", "auto", *extra)
    try:
        return server, server.wait_http_port(180)
    except BaseException:
        server.kill()
        raise


def rss_mib(server: ServerProcess) -> float:
    """The front end's own RSS (the server process, not its engine process)."""
    return (vm_bytes(server.proc.pid) or 0) / 2**20


def still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        while sock.recv(65536):  # a 408 or 503 answer, then the close
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--slowloris", type=int, default=500, help="connections that send half a header"
    )
    parser.add_argument(
        "--uploads", type=int, default=20, help="slow uploads (8 MiB declared, 4 MiB sent)"
    )
    parser.add_argument(
        "--wait", type=float, default=50.0, help="seconds before counting what is still open"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=12.0,
        help="seconds after closing every connection before the last RSS reading (the idle trim)",
    )
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="an extra `serve` flag (repeatable)"
    )
    args = parser.parse_args()
    server, port = start(args.serve_arg)
    try:
        time.sleep(2)
        rss_before = rss_mib(server)
        loris, uploads = [], []
        for _ in range(args.slowloris):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            with contextlib.suppress(OSError):
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
            loris.append(sock)
        for _ in range(args.uploads):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            with contextlib.suppress(OSError):
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n"
                    % (2 * UPLOAD_FAST_BYTES)
                    + b"x" * UPLOAD_FAST_BYTES
                )
            uploads.append(sock)
        rss_loaded = rss_mib(server)
        time.sleep(args.wait)
        report = {
            "slowloris_open": sum(still_open(s) for s in loris),
            "slowloris": args.slowloris,
            "uploads_open": sum(still_open(s) for s in uploads),
            "uploads": args.uploads,
            "wait_s": args.wait,
            "rss_mib_before": round(rss_before, 1),
            "rss_mib_loaded": round(rss_loaded, 1),
            "rss_mib_after_wait": round(rss_mib(server), 1),
            "serve_args": args.serve_arg,
        }
        for sock in loris + uploads:
            sock.close()
        time.sleep(args.settle)
        report["rss_mib_settled"] = round(rss_mib(server), 1)
        with contextlib.suppress(httpx.HTTPError):
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            report["limit_refusals"] = {
                m[0]: float(m[1])
                for m in re.findall(
                    r'sloserve_limit_refusals_total\{[^}]*limit="(\w+)"[^}]*\} (\S+)', metrics
                )
            }
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    finally:
        server.stop()


if __name__ == "__main__":
    main()
