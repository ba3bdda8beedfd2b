"""Settings of the HTTP edge (plain data, validated once)."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    chat_template: str | None = None
    model_name: str | None = None
    max_connections: int = 512
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024
    body_timeout_s: float = 60.0
    keep_alive_s: float = 30.0
    max_body_bytes: int = 16 * 1024**2
    stream_stall_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--http-port must be in 1..65535 (or auto / off), got {self.port}")
        if self.max_connections < 1:
            raise ValueError(f"--http-max-connections must be >= 1, got {self.max_connections}")
        if self.max_header_bytes < 1024:
            raise ValueError(
                f"--http-max-header-size must be >= 1KiB, got {self.max_header_bytes} bytes"
            )
        if self.max_body_bytes < 1:
            raise ValueError(f"--http-max-body-size must be > 0 bytes, got {self.max_body_bytes}")
        for flag, seconds in (
            ("--http-header-timeout", self.header_timeout_s),
            ("--http-body-timeout", self.body_timeout_s),
            ("--http-keep-alive", self.keep_alive_s),
            ("--http-stream-stall-timeout", self.stream_stall_s),
        ):
            if not (math.isfinite(seconds) and 0 < seconds <= 3600):
                raise ValueError(f"{flag} must be in (0, 3600] seconds, got {seconds}")
