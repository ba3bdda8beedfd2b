"""/server_info and /model_info: what SGLang Model Gateway reads when it registers a replica (in process,
over the fake engine): the served name and checkpoint it routes by, real limits only, the token, 503 before
the model is loaded."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from sloserve import __version__
from sloserve.config import SchedulerConfig, ServerConfig, SloserveConfig
from sloserve.frontend.lifecycle import Lifecycle
from sloserve.http.config import HttpConfig
from sloserve.http.server import HttpServer
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.live_server import wait_for

pytestmark = pytest.mark.timeout(60)
TOKEN = "router-token"


@contextlib.asynccontextmanager
async def http_edge(
    engine: FakeEngine, *, start_engine: bool = True, auth_token: str | None = None
):
    config = SloserveConfig(
        scheduler=SchedulerConfig(max_batch=6),
        server=ServerConfig(port=0, metrics_port=None, auth_token=auth_token),
    )
    lifecycle = Lifecycle(config, engine, watchdog_interval_s=0.02)
    server = HttpServer(lifecycle, HttpConfig(port=0, model_name="tiny"))
    await server.start()
    lifecycle.start(start_engine=start_engine)
    if start_engine:
        await wait_for(lambda: lifecycle.ready)
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{server.port}", timeout=30
        ) as client:
            yield client
    finally:
        await lifecycle.stop()


async def test_server_info_names_the_served_model_and_its_real_limits():
    engine = FakeEngine(block_size=16, max_model_len=256)
    engine.model_info["num_kv_blocks"] = 64
    async with http_edge(engine) as client:
        reply = await client.get("/server_info")
    assert reply.status_code == 200
    assert reply.json() == {
        "model_path": "fake",
        "tokenizer_path": "fake",
        "served_model_name": "tiny",
        "version": __version__,
        "context_length": 256,
        "max_total_tokens": 64 * 16,
        "max_running_requests": 6,
        "tp_size": 1,
    }


async def test_model_info_describes_the_checkpoint_and_leaves_out_what_is_unknown():
    engine = FakeEngine()
    async with http_edge(engine) as client:
        assert (await client.get("/model_info")).json() == {
            "model_path": "fake",
            "tokenizer_path": "fake",
            "is_generation": True,
            "architectures": ["FakeForCausalLM"],
        }
        del engine.model_info["architecture"]  # the fake engine has no KV pool size either
        assert "architectures" not in (await client.get("/model_info")).json()
        assert "max_total_tokens" not in (await client.get("/server_info")).json()


@pytest.mark.parametrize("route", ["/server_info", "/model_info"])
async def test_the_router_routes_need_the_token_and_a_loaded_model(route):
    async with http_edge(FakeEngine(), auth_token=TOKEN) as client:
        assert (await client.get(route)).status_code == 401
        assert (
            await client.get(route, headers={"Authorization": f"Bearer {TOKEN}"})
        ).status_code == 200
    async with http_edge(FakeEngine(), start_engine=False) as client:
        reply = await client.get(route)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "not_ready"
