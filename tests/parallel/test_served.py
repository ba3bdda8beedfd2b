"""`sloserve serve --tensor-parallel-size 2`: the same tokens as one rank, and a dead rank ends it cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

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


def _worker_pids(server: ServerProcess) -> list[int]:
    """The server's tensor-parallel worker processes (children of its engine process)."""
    found = []
    for pid in server.pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"sloserve.parallel.worker" in cmdline:
            found.append(pid)
    return found


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_served_tokens_with_two_ranks_equal_one_rank(make_checkpoint, arch):
    model = make_checkpoint(arch)
    prompts = [[1, *range(10 + 7 * i, 40 + 5 * i)] for i in range(4)]
    config = SloserveConfig(
        model=ModelConfig(path=str(model), device="cpu", max_model_len=256),
        cache=CacheConfig(kv_pool_bytes=256 * 8192),
    )
    with LLM(config=config) as llm:
        expected = [
            o.token_ids
            for o in llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        ]
    server = ServerProcess.cli(model, "--max-model-len", "256", "--tensor-parallel-size", "2")
    try:
        server.wait_ready()
        assert len(_worker_pids(server)) == 1
        assert any("tensor_parallel_size=2" in m for m in server.messages())
        info = server.info()
        assert info.tensor_parallel_size == 2 and list(info.tensor_parallel_devices) == [
            "cpu",
            "cpu",
        ]
        with server.sync_channel() as channel:
            stub = pb_grpc.SloserveStub(channel)
            got = []
            for i, ids in enumerate(prompts):
                req = generate(f"eq{i}", ids=ids, max_tokens=16).generate
                got.append(
                    [
                        t
                        for m in stub.Generate(req, timeout=60)
                        if m.WhichOneof("kind") == "chunk"
                        for t in m.chunk.token_ids
                    ]
                )
        assert got == expected
        assert server.stop() == 0
        assert _worker_pids(server) == []
    finally:
        server.kill()


async def test_a_killed_worker_ends_every_request_with_its_reason_and_health_turns_off(tiny_llama):
    server = ServerProcess.cli(
        tiny_llama,
        "--max-model-len",
        "256",
        "--tensor-parallel-size",
        "2",
        "--inject-faults",
        "slow-step:hold=0.02",
        command=WITH_FAULTS,
    )
    try:
        server.wait_ready()
        (worker,) = _worker_pids(server)
        statuses: list[int] = []
        async with server.aio_channel() as channel:
            watcher = watch_health(channel, SERVICE_NAME, statuses)
            client = StreamClient(pb_grpc.SloserveStub(channel))
            # held: 200 tokens take >= 4 s, far past the kill
            ids = [f"r{i}-hold" for i in range(4)]
            for rid in ids:
                await client.send(generate(rid, text=f"live request {rid}", max_tokens=200))
            deadline = time.monotonic() + 60
            while not all(client.records[r].tokens for r in ids):
                assert time.monotonic() < deadline, "requests never started"
                await asyncio.sleep(0.005)
            os.kill(worker, signal.SIGKILL)
            assert await client.wait_terminals(15), client.pending()
            for rid in ids:
                error = client.records[rid].error
                assert error is not None and error.code == grpc.StatusCode.UNAVAILABLE.value[0], (
                    client.records[rid]
                )
                assert "tensor parallelism is down: rank 1" in error.message, error.message
                assert "killed by signal 9" in error.message, error.message
            code = await asyncio.to_thread(server.wait, 30)
            await asyncio.wait_for(watcher, 10)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses[1:], statuses
        assert code == 1
    finally:
        server.kill()


def test_a_size_the_model_cannot_split_fails_start_up_with_a_clear_error(tiny_llama):
    server = ServerProcess.cli(tiny_llama, "--tensor-parallel-size", "3")
    try:
        assert server.wait(60) != 0
        assert any(
            "tensor parallel size 3 does not divide num_attention_heads 4" in m
            for m in server.messages()
        )
    finally:
        server.kill()


def test_a_worker_that_dies_while_idle_stops_the_server_with_its_reason(tiny_llama):
    server = ServerProcess.cli(tiny_llama, "--max-model-len", "256", "--tensor-parallel-size", "2")
    try:
        server.wait_ready()
        (worker,) = _worker_pids(server)
        os.kill(worker, signal.SIGKILL)
        assert server.wait(30) == 1
        assert any(
            "tensor parallelism is down: rank 1" in m and "killed by signal 9" in m
            for m in server.messages()
        ), server.messages()[-5:]
    finally:
        server.kill()
