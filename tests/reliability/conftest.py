"""Live servers shared by the reliability tests (each a real `sloserve serve` child process)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sloserve.testing.server_process import ServerProcess

# one 16-token KV page of the tiny llama (2 layers x K,V x 2 heads x 16 dims x fp32)
BLOCK_BYTES = 8192
SMALL_POOL_PAGES = 48  # a pool small enough that a dozen live requests force preemption (swap)


def _small_pool(model: Path) -> Iterator[ServerProcess]:
    server = ServerProcess.cli(
        model, "--max-model-len", "256", "--kv-pool-size", str(SMALL_POOL_PAGES * BLOCK_BYTES)
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def small_pool_server(tiny_llama: Path) -> Iterator[ServerProcess]:
    """Tiny llama, 256-token context, a 48-page KV pool: preemption and swap happen under load."""
    yield from _small_pool(tiny_llama)


@pytest.fixture(scope="session")
def small_pool_moe_server(tiny_mixtral: Path) -> Iterator[ServerProcess]:
    """The same on the tiny Mixtral (MoE dispatch in every step; same KV page size as the llama)."""
    yield from _small_pool(tiny_mixtral)
