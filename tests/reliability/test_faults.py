"""Injected faults (--inject-faults): a failing request fails alone (INTERNAL); a dead engine loop ends the process."""

from __future__ import annotations

import asyncio
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.server_process import (
    SERVICE_NAME,
    WITH_FAULTS,
    ServerProcess,
    describe,
    quiescent,
)

from tests.reliability.client import StreamClient, generate
from tests.reliability.harness import watch_health

pytestmark = pytest.mark.timeout(300)

INTERNAL = grpc.StatusCode.INTERNAL.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


FAULTS = "fail-forward:poison-fwd,fail-postprocess:poison-post,kill-loop:kill-loop"


@pytest.fixture(scope="module")
def fault_server(tiny_llama):
    """One server for this module, faults injected by the supported switch (--inject-faults via
    its environment variable); the loop-death test (last in the file) ends it."""
    server = ServerProcess.cli(
        tiny_llama,
        "--max-model-len",
        "256",
        "--kv-pool-size",
        str(256 * 8192),
        "--max-batch",
        "16",
        "--grace",
        "5",
        env={"SLOSERVE_INJECT_FAULTS": FAULTS},
        command=WITH_FAULTS,
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()


async def _start_normal(client: StreamClient, n: int, max_tokens: int) -> list[str]:
    """n healthy requests, waited on until each is producing tokens (so faults hit a live batch)."""
    ids = [f"ok-{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        await client.send(generate(rid, text=f"healthy request {i} " * 3, max_tokens=max_tokens))
    deadline = time.monotonic() + 60
    while not all(client.records[r].tokens for r in ids):
        assert time.monotonic() < deadline, "healthy requests never started"
        await asyncio.sleep(0.005)
    return ids


async def test_a_request_failing_in_processing_fails_alone_with_internal(fault_server):
    async with fault_server.aio_channel() as channel:
        client = StreamClient(pb_grpc.SloserveStub(channel))
        healthy = await _start_normal(client, 6, max_tokens=120)
        for rid in ("poison-fwd-1", "poison-post-1"):
            await client.send(generate(rid, text="this request trips a fault", max_tokens=50))
        assert await client.wait_terminals(120), f"no terminal for {client.pending()}"
        # still serving
        later = await _start_normal(StreamClient(pb_grpc.SloserveStub(channel)), 2, max_tokens=5)
        await client.close()
    for rid, kind in (("poison-fwd-1", "fail-forward"), ("poison-post-1", "fail-postprocess")):
        error = client.records[rid].error
        assert error is not None and error.code == INTERNAL, client.records[rid]
        assert f"injected {kind} fault for request" in error.message and rid in error.message, (
            error.message
        )
    for rid in healthy:
        record = client.records[rid]
        assert record.final is not None and record.final.completion_tokens == 120, record
        assert record.tokens == 120 and record.extra_terminals == 0
    assert later and client.status == grpc.StatusCode.OK
    stats = fault_server.wait_quiescent()
    assert quiescent(stats), describe(stats)
    assert fault_server.health(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    assert fault_server.proc.poll() is None
    print(
        f"\nfaults: {len(healthy)} healthy requests finished, 2 poisoned -> INTERNAL; {describe(stats)}"
    )


async def test_bad_requests_batched_alone_are_not_taken_for_a_broken_runner(fault_server):
    """Every sequence of the step fails on its own, yet a known-good probe passes: the requests
    are bad, the runner is fine, so only they fail and the server keeps serving."""
    async with fault_server.aio_channel() as channel:
        client = StreamClient(pb_grpc.SloserveStub(channel))
        poisoned = ["poison-fwd-a", "poison-fwd-b"]
        for rid in poisoned:
            await client.send(generate(rid, text="a request that always fails", max_tokens=8))
        assert await client.wait_terminals(120), f"no terminal for {client.pending()}"
        later = await _start_normal(client, 2, max_tokens=5)
        assert await client.wait_terminals(120), f"no terminal for {client.pending()}"
        await client.close()
    for rid in poisoned:
        error = client.records[rid].error
        assert error is not None and error.code == INTERNAL and "fail-forward" in error.message, (
            client.records[rid]
        )
    for rid in later:
        assert client.records[rid].final is not None and client.records[rid].tokens == 5, (
            client.records[rid]
        )
    assert fault_server.health(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    assert fault_server.proc.poll() is None
    assert any(m.startswith("fault injection is ON") for m in fault_server.messages())


async def test_a_dead_engine_loop_turns_health_off_and_exits_non_zero(fault_server):
    statuses: list[int] = []
    async with fault_server.aio_channel() as channel:
        watcher = watch_health(channel, "", statuses)
        client = StreamClient(pb_grpc.SloserveStub(channel))
        healthy = await _start_normal(client, 4, max_tokens=200)
        started = time.monotonic()
        await client.send(generate("kill-loop", text="this one kills the loop", max_tokens=5))
        assert await client.wait_terminals(60), (
            f"requests hung after the loop died: {client.pending()}"
        )
        code = await asyncio.to_thread(fault_server.wait, 60)
        exited_after = time.monotonic() - started
        await asyncio.wait_for(watcher, 30)
    assert code != 0, "a server whose engine died must exit non-zero so a supervisor restarts it"
    for rid in (*healthy, "kill-loop"):
        record = client.records[rid]
        # Each live request ends with UNAVAILABLE (a RequestError, or the stream's own status).
        assert (record.error is not None and record.error.code == UNAVAILABLE) or (
            record.final is None
            and record.error is None
            and client.status == grpc.StatusCode.UNAVAILABLE
        ), record
    assert statuses[:1] == [health_pb2.HealthCheckResponse.SERVING]
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses, (
        f"liveness never turned off: {statuses}"
    )
    assert any(
        m.startswith("engine loop died: InjectedFault: injected kill-loop fault for request")
        for m in fault_server.messages()
    )
    print(
        f"\nloop death: exit code {code} after {exited_after:.2f}s; health seen {statuses}; "
        f"outcomes {[client.records[r].outcome for r in (*healthy, 'kill-loop')]}"
    )
    try:
        fault_server.wait(1)
    except subprocess.TimeoutExpired:  # pragma: no cover - the assertion above already failed
        pass
