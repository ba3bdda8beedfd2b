"""Settings of the HTTP edge (plain data, validated once)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sloserve.config import flag, parse_size, require

DEFAULT_PORT = 8000


@dataclass(slots=True)
class HttpConfig:
    """port: 0 picks a free one (the CLI spells that `--http-port auto`; its `0`/`off` is no HTTP).

    chat_template: a Jinja file that overrides the checkpoint's tokenizer_config.json template.
    model_name: the id /v1/models lists and responses carry [default: the --model argument].
    The limits bound what one client can hold (see http/guard.py): open connections, the size of a request's
    headers and the time they and then its whole body may take to arrive, an idle keep-alive connection's
    life, a body's size, and how long a stream may stay blocked on a client that stopped reading.
    """

    port: int = DEFAULT_PORT
    chat_template: str | None = flag(
        None,
        "--chat-template",
        "Jinja chat template for /v1/chat/completions [default: the checkpoint's tokenizer_config.json].",
        metavar="FILE",
    )
    model_name: str | None = None
    max_connections: int = flag(
        512,
        "--http-max-connections",
        "Open HTTP connections at most; one more is answered 503 and closed.",
    )
    header_timeout_s: float = flag(
        10.0,
        "--http-header-timeout",
        "A request's headers must all arrive within this (else 408, connection closed).",
    )
    max_header_bytes: int = flag(
        64 * 1024,
        "--http-max-header-size",
        "Longest request line plus headers accepted (else 431, connection closed).",
        parse=parse_size,
        shown="64KiB",
    )
    body_timeout_s: float = flag(
        60.0,
        "--http-body-timeout",
        "A request's whole body must arrive within this after its headers (else 408).",
    )
    keep_alive_s: float = flag(
        30.0, "--http-keep-alive", "An idle keep-alive connection is closed after this."
    )
    max_body_bytes: int = flag(
        16 * 1024**2,
        "--http-max-body-size",
        "Largest request body accepted (413 past it), e.g. 4MiB.",
        parse=parse_size,
        shown="16MiB",
    )
    stream_stall_s: float = flag(
        30.0,
        "--http-stream-stall-timeout",
        "A token stream whose client reads nothing this long is aborted (the request "
        "ends in the engine).",
    )

    def __post_init__(self) -> None:
        require(0 <= self.port < 65536, "port", f"must be in 0..65535, got {self.port}")
        require(
            self.max_connections >= 1,
            "max_connections",
            f"must be >= 1, got {self.max_connections}",
        )
        require(
            self.max_header_bytes >= 1024,
            "max_header_bytes",
            f"must be >= 1KiB, got {self.max_header_bytes} bytes",
        )
        require(
            self.max_body_bytes >= 1,
            "max_body_bytes",
            f"must be > 0 bytes, got {self.max_body_bytes}",
        )
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "stream_stall_s"):
            seconds = getattr(self, name)
            require(
                math.isfinite(seconds) and 0 < seconds <= 3600,
                name,
                f"must be in (0, 3600] seconds, got {seconds}",
            )
