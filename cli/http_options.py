"""`serve`'s flags for the HTTP edge's limits (what one client may hold), and the HttpConfig fields they set."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click
from sloserve.cli.common import CliError
from sloserve.config import parse_size

_NAMES = (
    "http_max_connections",
    "http_header_timeout",
    "http_max_header_size",
    "http_body_timeout",
    "http_keep_alive",
    "http_max_body_size",
    "http_stream_stall_timeout",
)


def http_limit_options(fn: Callable) -> Callable:
    """--http-max-connections, the header/body/keep-alive/stall timeouts, header and body sizes."""
    decorators = [
        click.option(
            "--http-max-connections",
            default=512,
            show_default=True,
            type=int,
            help="Open HTTP connections at most; one more is answered 503 and closed.",
        ),
        click.option(
            "--http-header-timeout",
            default=10.0,
            show_default=True,
            type=float,
            metavar="SECONDS",
            help="A request's headers must all arrive within this (else 408, connection closed).",
        ),
        click.option(
            "--http-max-header-size",
            default="64KiB",
            show_default=True,
            metavar="SIZE",
            help="Longest request line plus headers accepted (else 431, connection closed).",
        ),
        click.option(
            "--http-body-timeout",
            default=60.0,
            show_default=True,
            type=float,
            metavar="SECONDS",
            help="A request's whole body must arrive within this after its headers (else 408).",
        ),
        click.option(
            "--http-keep-alive",
            default=30.0,
            show_default=True,
            type=float,
            metavar="SECONDS",
            help="An idle keep-alive connection is closed after this.",
        ),
        click.option(
            "--http-max-body-size",
            default="16MiB",
            show_default=True,
            metavar="SIZE",
            help="Largest request body accepted (413 past it), e.g. 4MiB.",
        ),
        click.option(
            "--http-stream-stall-timeout",
            default=30.0,
            show_default=True,
            type=float,
            metavar="SECONDS",
            help="A token stream whose client reads nothing this long is aborted (the request "
            "ends in the engine).",
        ),
    ]
    return functools.reduce(lambda f, d: d(f), reversed(decorators), fn)


def pop_http_limits(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove the limit flags from `serve`'s kwargs; return them as HttpConfig fields."""
    opts = {name: kwargs.pop(name) for name in _NAMES}
    sizes = {}
    for name in ("http_max_body_size", "http_max_header_size"):
        try:
            sizes[name] = parse_size(opts[name])
        except ValueError as exc:
            raise CliError(f"--{name.replace('_', '-')}: {exc}") from None
    return {
        "max_connections": opts["http_max_connections"],
        "header_timeout_s": opts["http_header_timeout"],
        "body_timeout_s": opts["http_body_timeout"],
        "keep_alive_s": opts["http_keep_alive"],
        "max_header_bytes": sizes["http_max_header_size"],
        "max_body_bytes": sizes["http_max_body_size"],
        "stream_stall_s": opts["http_stream_stall_timeout"],
    }
