"""The HTTP edge on the shared Lifecycle (in process, over the fake engine): 503 before the model is
loaded and while draining, in-flight requests finish within grace, and past grace answer 'shutdown'."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from sloserve.config import ServerConfig, SloserveConfig
from sloserve.frontend.lifecycle import Lifecycle
from sloserve.grpc.server import SloserveServer
from sloserve.http.config import HttpConfig
from sloserve.http.server import HttpServer
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.live_server import wait_for

pytestmark = pytest.mark.timeout(60)
BODY = {"prompt": "hello", "max_tokens": 4, "temperature": 0}


@contextlib.asynccontextmanager
async def edges(engine: FakeEngine, *, start_engine: bool = True):
    """A Lifecycle with both edges (as `sloserve serve` builds it) and an HTTP client on its HTTP port."""
    config = SloserveConfig(server=ServerConfig(port=0, metrics_port=None))
    lifecycle = Lifecycle(config, engine, watchdog_interval_s=0.02)
    grpc_server = SloserveServer(config, engine, lifecycle=lifecycle)
    http_server = HttpServer(lifecycle, HttpConfig(port=0))
    await grpc_server.start()
    await http_server.start()
    lifecycle.start(start_engine=start_engine)
    if start_engine:
        await wait_for(lambda: lifecycle.ready)
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{http_server.port}", timeout=30
        ) as client:
            yield lifecycle, client
    finally:
        await lifecycle.stop()


async def test_before_the_model_is_loaded_requests_and_health_are_503():
    async with edges(FakeEngine(), start_engine=False) as (_, client):
        reply = await client.post("/v1/completions", json=BODY)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "not_ready"
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "loading"


async def test_draining_refuses_new_requests_and_lets_live_ones_finish():
    engine = FakeEngine()
    async with edges(engine) as (lifecycle, client):
        engine.flowing.clear()  # hold every token: the first request stays in flight
        live = asyncio.create_task(client.post("/v1/completions", json={**BODY, "stream": True}))
        await wait_for(lambda: lifecycle.frontend.inflight == 1)
        drain = asyncio.create_task(lifecycle.drain(grace_s=10))
        await wait_for(lambda: lifecycle.frontend.draining)
        late = await client.post("/v1/completions", json=BODY)
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
        assert (await client.get("/health")).status_code == 503
        engine.flowing.set()
        reply = await live
        assert reply.status_code == 200 and reply.content.endswith(b"data: [DONE]\n\n")
        assert await drain is True


async def test_past_grace_a_live_request_answers_503_shutdown():
    engine = FakeEngine()
    async with edges(engine) as (lifecycle, client):
        engine.flowing.clear()
        live = asyncio.create_task(client.post("/v1/completions", json=BODY))
        await wait_for(lambda: lifecycle.frontend.inflight == 1)
        assert await lifecycle.drain(grace_s=0.2) is False
        reply = await live
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "shutdown"
        assert engine.stopped
