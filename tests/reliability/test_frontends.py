"""`sloserve serve --frontends 2`: two front-end processes on one port over one engine process --
every request completes with the tokens one front end gives, each front end counts its own
requests on its own metrics port, and stopping or killing the server stops every process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import urllib.request

import grpc
import httpx
import pytest
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.server_process import SLOSERVE, WITH_FAULTS, ServerProcess

from tests.reliability.client import generate

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[1, *range(10 + 7 * i, 40 + 5 * i)] for i in range(12)]
# channels would share one TCP connection otherwise
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def _free_port_pair() -> int:
    """A port p with p + 1 also free (front end k serves metrics on p + k)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two free consecutive ports")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return os.popen(f"ps -o stat= -p {pid}").read().strip()[:1] not in ("Z", "")


def _all_gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


async def _tokens(port: int) -> list[list[int]]:
    """Every prompt on a connection of its own (the kernel spreads connections over the front ends)."""

    async def one(i: int, ids: list[int]) -> list[int]:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=OWN_CONNECTION
        ) as channel:
            req = generate(f"fe{i}", ids=ids, max_tokens=16).generate
            return [
                t
                async for m in pb_grpc.SloserveStub(channel).Generate(req, timeout=60)
                if m.WhichOneof("kind") == "chunk"
                for t in m.chunk.token_ids
            ]

    return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(PROMPTS))))


def _requests_counted(metrics_port: int) -> float:
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
        .read()
        .decode()
    )
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith("sloserve_requests_total{")
    )


def _serve(model, *extra: str) -> ServerProcess:
    # NOTE: the entry point that takes --inject-faults; without it, the product's `serve` as it is
    return ServerProcess(
        [
            "serve",
            "--model",
            str(model),
            "--device",
            "cpu",
            "--port",
            "0",
            "--http-port",
            "off",
            "--log-format",
            "json",
            "--max-model-len",
            "256",
            *extra,
        ],
        command=WITH_FAULTS if "--inject-faults" in extra else SLOSERVE,
    )


def test_two_front_ends_on_one_port_give_the_tokens_of_one_and_stop_together(tiny_llama):
    one = _serve(tiny_llama, "--metrics-port", "off")
    try:
        one.wait_ready()
        expected = asyncio.run(_tokens(one.port))
    finally:
        one.stop()
    metrics = _free_port_pair()
    two = _serve(tiny_llama, "--frontends", "2", "--metrics-port", str(metrics))
    try:
        two.wait_ready()
        two.wait_log(lambda m: m.startswith("front end 1 joined the engine process"), 60)
        assert asyncio.run(_tokens(two.port)) == expected
        counted = [_requests_counted(metrics), _requests_counted(metrics + 1)]
        # 12 connections, spread by a hash of their ports: all on one front end has p = 2 / 4096
        assert sum(counted) == len(PROMPTS) and min(counted) > 0, counted
        # front end 0 (the server), the engine, front end 1, multiprocessing's tracker
        pids = two.pids()
        assert two.engine_pid() in pids and len(pids) >= 3, pids
        assert two.stop() == 0
        assert _all_gone(pids, 15)
    finally:
        two.kill()


def test_killing_the_server_stops_every_process(tiny_llama):
    server = _serve(tiny_llama, "--frontends", "3", "--metrics-port", "off")
    try:
        server.wait_ready()
        server.wait_log(lambda m: m.startswith("front end 2 joined the engine process"), 60)
        pids = server.pids()
        assert server.engine_pid() in pids and len(pids) >= 4, pids
        os.kill(server.proc.pid, signal.SIGKILL)
        assert _all_gone(pids, 15)
    finally:
        server.kill()


async def _start_held(port: int, n: int) -> tuple[list, list[grpc.aio.Channel]]:
    """n slow requests, each on a connection of its own, every one past its first token."""
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN_CONNECTION) for _ in range(n)
    ]
    calls = [
        pb_grpc.SloserveStub(ch).Generate(
            generate(f"r{i}-hold", text=f"held {i}", max_tokens=40).generate, timeout=60
        )
        for i, ch in enumerate(channels)
    ]
    for call in calls:
        assert (await call.read()).WhichOneof("kind") == "chunk"
    return calls, channels


async def _rest(call) -> list:
    out = []
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            out.append(msg)
    except grpc.aio.AioRpcError as exc:
        out.append(exc.code())
    return out


def test_a_killed_engine_ends_the_requests_of_every_front_end(tiny_llama):
    server = _serve(
        tiny_llama,
        "--frontends",
        "2",
        "--metrics-port",
        "off",
        "--inject-faults",
        "slow-step:hold=0.02",
    )

    async def scenario() -> list[list]:
        calls, channels = await _start_held(server.port, 8)
        os.kill(server.engine_pid(), signal.SIGKILL)
        try:
            return await asyncio.wait_for(asyncio.gather(*(_rest(c) for c in calls)), 15)
        finally:
            for ch in channels:
                await ch.close()

    try:
        server.wait_ready()
        server.wait_log(lambda m: m.startswith("front end 1 joined the engine process"), 60)
        pids = server.pids()
        for rest in asyncio.run(scenario()):
            last = rest[-1]
            assert last == grpc.StatusCode.UNAVAILABLE or (
                last.WhichOneof("kind") == "error"
                and last.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
            ), rest
        assert server.wait(30) == 1
        assert _all_gone(pids, 15)
        died = [m for m in server.messages() if m.startswith("engine process failed")]
        assert len(died) == 2, died  # each front end saw it
    finally:
        server.kill()


def test_sigterm_drains_the_requests_of_every_front_end(tiny_llama):
    server = _serve(
        tiny_llama,
        "--frontends",
        "2",
        "--metrics-port",
        "off",
        "--inject-faults",
        "slow-step:hold=0.01",
    )

    async def scenario() -> list[list]:
        calls, channels = await _start_held(server.port, 12)
        server.signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(asyncio.gather(*(_rest(c) for c in calls)), 30)
        finally:
            for ch in channels:
                await ch.close()

    try:
        server.wait_ready()
        server.wait_log(lambda m: m.startswith("front end 1 joined the engine process"), 60)
        pids = server.pids()
        for rest in asyncio.run(scenario()):
            assert (
                rest[-1].WhichOneof("kind") == "final" and rest[-1].final.completion_tokens == 40
            ), rest[-1]
        assert server.wait(30) == 0
        assert _all_gone(pids, 15)
        draining = [m for m in server.messages() if m.startswith("draining: ")]
        # both front ends drained requests of their own (12 connections all hashed to one: p = 2 / 4096)
        assert len(draining) == 2 and all(not m.startswith("draining: 0 ") for m in draining), (
            draining
        )
    finally:
        server.kill()


def test_http_on_the_shared_port_answers_from_both_front_ends(tiny_llama):
    server = ServerProcess(
        [
            "serve",
            "--model",
            str(tiny_llama),
            "--device",
            "cpu",
            "--port",
            "0",
            "--http-port",
            "auto",
            "--metrics-port",
            "off",
            "--log-format",
            "json",
            "--max-model-len",
            "256",
            "--frontends",
            "2",
        ]
    )
    try:
        server.wait_ready()
        server.wait_log(lambda m: m.startswith("front end 1 joined the engine process"), 60)
        listening = [m for m in server.messages() if m.startswith("http listening on ")]
        ports = {int(m.split()[3].rsplit(":", 1)[1]) for m in listening}
        assert len(listening) == 2 and len(ports) == 1, listening  # both front ends, one port
        url = f"http://127.0.0.1:{ports.pop()}/v1/completions"
        body = {"prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        texts = set()
        for _ in range(12):
            with httpx.Client(timeout=60) as client:  # a connection of its own each time
                reply = client.post(url, json=body)
            assert reply.status_code == 200, reply.text
            texts.add(reply.json()["choices"][0]["text"])
        assert len(texts) == 1  # greedy: the same text whichever front end answered
    finally:
        server.stop()
