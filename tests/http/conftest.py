"""A real `sloserve serve` with the HTTP API on (tiny llama, CPU), shared by the HTTP tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from sloserve.testing.server_process import SLOSERVE, WITH_FAULTS, ServerProcess

TOKEN = "http-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SLOW = "slowstep"  # a request whose x-request-id holds this takes 10 ms more per step (sloserve.testing.faults)
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class HttpServerProcess(ServerProcess):
    """ServerProcess plus the HTTP port read from its 'http listening on HOST:PORT' log line."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.http_port = self.wait_http_port(30)
        self.url = f"http://127.0.0.1:{self.http_port}"


def start(
    model: Path, template: Path | None, *extra: str, credentials=None, command=SLOSERVE
) -> HttpServerProcess:
    args = [
        "serve",
        "--model",
        str(model),
        "--device",
        "cpu",
        "--port",
        "0",
        "--metrics-port",
        "off",
        "--http-port",
        "auto",
        "--log-format",
        "json",
        "--max-model-len",
        "256",
        *extra,
    ]
    if template is not None:
        args += ["--chat-template", str(template)]
    server = HttpServerProcess(args, command=command)
    try:
        server.wait_ready(
            60, credentials=credentials, metadata=[("authorization", f"Bearer {TOKEN}")]
        )
    except BaseException:
        server.kill()
        raise
    return server


@pytest.fixture(scope="session")
def chat_template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="session")
def http_server(tiny_llama: Path, chat_template: Path) -> Iterator[HttpServerProcess]:
    """Auth on, a chat template, at most 4 requests running at once (so a flood is 10x capacity),
    and steps slowed for requests marked SLOW."""
    server = start(
        tiny_llama,
        chat_template,
        "--auth-token",
        TOKEN,
        "--max-batch",
        "4",
        "--inject-faults",
        f"slow-step:{SLOW}=0.01",
        command=WITH_FAULTS,
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(http_server) -> openai.OpenAI:
    """The official openai client on the session's server (no retries: a test sees every answer)."""
    with openai.OpenAI(
        base_url=f"{http_server.url}/v1", api_key=TOKEN, max_retries=0, timeout=60
    ) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id
