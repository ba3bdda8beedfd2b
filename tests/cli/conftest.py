"""A fake-engine server running on a background event loop, for CliRunner tests of client commands."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from sloserve.config import ServerConfig, SloserveConfig
from sloserve.grpc.server import SloserveServer
from sloserve.testing.fake_engine import FakeEngine

TOKEN = "cli-token"


class ThreadServer:
    """SloserveServer over a FakeEngine on its own loop thread."""

    def __init__(self, **server_kw) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = SloserveConfig(server=ServerConfig(port=0, metrics_port=None, **server_kw))

        async def start() -> SloserveServer:
            server = SloserveServer(config, FakeEngine(step_s=0.001), watchdog_interval_s=0.02)
            await server.start()
            while not server.engine.ready:
                await asyncio.sleep(0.01)
            return server

        self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        self.address = f"127.0.0.1:{self.server.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace_s=0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def fake_server() -> Iterator[ThreadServer]:
    server = ThreadServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def auth_server() -> Iterator[ThreadServer]:
    server = ThreadServer(auth_token=TOKEN)
    yield server
    server.close()
