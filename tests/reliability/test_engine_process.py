"""`sloserve serve` runs its engine in a process of its own: the same tokens as the offline LLM, a
killed engine noticed within a second, and an engine that never outlives its server."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from sloserve.config import CacheConfig, ModelConfig, SloserveConfig
from sloserve.llm import LLM
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.sampling_params import SamplingParams
from sloserve.testing.server_process import SERVICE_NAME, WITH_FAULTS, ServerProcess

from tests.reliability.client import StreamClient, generate
from tests.reliability.harness import watch_health

pytestmark = pytest.mark.timeout(300)

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        return os.popen(f"ps -o stat= -p {pid}").read().strip()[:1] not in ("Z", "")
    except OSError:
        return True


def _wait_gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return False


def test_greedy_tokens_through_the_server_equal_the_offline_llm(tiny_llama):
    prompts = [[1, *range(10 + 7 * i, 40 + 5 * i)] for i in range(5)]
    config = SloserveConfig(
        model=ModelConfig(path=str(tiny_llama), device="cpu", max_model_len=256),
        cache=CacheConfig(kv_pool_bytes=256 * 8192),
    )
    with LLM(config=config) as llm:
        expected = [
            o.token_ids
            for o in llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
        ]
    server = ServerProcess.cli(tiny_llama, "--max-model-len", "256")
    try:
        server.wait_ready()
        with server.sync_channel() as channel:
            stub = pb_grpc.SloserveStub(channel)
            got = []
            for i, ids in enumerate(prompts):
                req = generate(f"eq{i}", ids=ids, max_tokens=20).generate
                got.append(
                    [
                        t
                        for m in stub.Generate(req, timeout=60)
                        if m.WhichOneof("kind") == "chunk"
                        for t in m.chunk.token_ids
                    ]
                )
        assert got == expected
    finally:
        server.stop()


async def test_a_killed_engine_process_ends_every_request_within_a_second_and_health_turns_off(
    tiny_llama,
):
    server = ServerProcess.cli(
        tiny_llama,
        "--max-model-len",
        "256",
        "--inject-faults",
        "slow-step:hold=0.02",
        command=WITH_FAULTS,
    )
    try:
        server.wait_ready()
        engine_pid = server.engine_pid()
        assert engine_pid in server.pids()[1:]
        statuses: list[int] = []
        async with server.aio_channel() as channel:
            watcher = watch_health(channel, SERVICE_NAME, statuses)
            client = StreamClient(pb_grpc.SloserveStub(channel))
            # held: 200 tokens take >= 4 s, far past the kill
            ids = [f"r{i}-hold" for i in range(6)]
            for rid in ids:
                await client.send(generate(rid, text=f"live request {rid}", max_tokens=200))
            deadline = time.monotonic() + 60
            while not all(client.records[r].tokens for r in ids):
                assert time.monotonic() < deadline, "requests never started"
                await asyncio.sleep(0.005)
            os.kill(engine_pid, signal.SIGKILL)
            killed = time.monotonic()
            assert await client.wait_terminals(10), client.pending()
            ended_after = max(client.records[r].done_at for r in ids) - killed
            for rid in ids:
                error = client.records[rid].error
                assert error is not None and error.code == UNAVAILABLE.value[0], client.records[rid]
                assert "killed by SIGKILL" in error.message, error.message
            code = await asyncio.to_thread(server.wait, 30)
            await asyncio.wait_for(watcher, 10)
        assert ended_after < 1.0, f"requests ended {ended_after:.2f}s after the engine was killed"
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses[1:], statuses
        assert code == 1, "a server whose engine died exits non-zero so its supervisor restarts it"
        assert any(
            "engine process failed: the engine process exited unexpectedly (killed by SIGKILL)" in m
            for m in server.messages()
        )
    finally:
        server.kill()


def test_the_engine_process_never_outlives_its_server(tiny_llama):
    server = ServerProcess.cli(tiny_llama, "--max-model-len", "256")
    try:
        server.wait_ready()
        engine_pid = server.engine_pid()
        assert _alive(engine_pid)
        server.signal(signal.SIGKILL)  # no chance to clean up: the kernel must take the engine too
        server.wait(30)
        assert _wait_gone(engine_pid, 10), "the engine process outlived its killed server"
    finally:
        server.kill()


def test_sigterm_drains_across_the_process_boundary_and_the_engine_exits(tiny_llama):
    server = ServerProcess.cli(tiny_llama, "--max-model-len", "256")
    try:
        server.wait_ready()
        engine_pid = server.engine_pid()
        with server.sync_channel() as channel:
            stub = pb_grpc.SloserveStub(channel)
            replies = stub.Generate(
                generate("d", text="drain me", max_tokens=30).generate, timeout=60
            )
            first = next(replies)
            assert first.WhichOneof("kind") == "chunk"
            server.signal(signal.SIGTERM)
            rest = list(replies)
        assert rest[-1].WhichOneof("kind") == "final" and rest[-1].final.completion_tokens == 30
        assert server.wait(30) == 0
        assert _wait_gone(engine_pid, 10)
    finally:
        server.kill()
