"""Settings of the HTTP edge (plain data, validated once)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PORT = 8000


@dataclass(slots=True)
class HttpConfig:
    """port: 0 picks a free one (the CLI spells that `--http-port auto`; its `0`/`off` is no HTTP).

    chat_template: a Jinja file that overrides the checkpoint's tokenizer_config.json template.
    model_name: the id /v1/models lists and responses carry [default: the --model argument].
    """

    port: int = DEFAULT_PORT
    chat_template: str | None = None
    model_name: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--http-port must be in 1..65535 (or auto / off), got {self.port}")
