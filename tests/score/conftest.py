"""A real `sloserve serve` (tiny llama, CPU, blocks of 4, at most 3 candidates a call) for the
served score tests (HTTP and gRPC)."""

from __future__ import annotations

import pytest

from tests.http.conftest import TOKEN, start

META = [("authorization", f"Bearer {TOKEN}")]
TOL = 1e-4
PROMPT = [256] + [(i * 37) % 250 for i in range(40)]


@pytest.fixture(scope="session")
def server(tiny_llama):
    server = start(
        tiny_llama, None, "--auth-token", TOKEN, "--max-score-candidates", "3", "--block-size", "4"
    )
    try:
        yield server
    finally:
        server.stop()
