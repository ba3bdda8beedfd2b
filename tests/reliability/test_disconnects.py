"""Clients that vanish or cancel mid-stream leave nothing behind: every block and slot comes back.

Run with SLOSERVE_FULL=1 for 1,000 trials (100 otherwise) on the tiny llama, and a quarter of that
on the tiny Mixtral. (Expert slots and workspaces cannot be checked: Info does not report them.)
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.server_process import SERVICE_NAME, describe, quiescent

from tests.reliability.client import StreamClient, generate
from tests.reliability.harness import count

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRIALS = count(100, 1000)
PARALLEL = 8


def _prompt(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(4, 90)))


async def _until_tokens(client: StreamClient, want: int, timeout: float = 10.0) -> None:
    """Wait (bounded) until the stream has delivered `want` tokens in all, or a request ended."""
    deadline = time.monotonic() + timeout
    while sum(r.tokens for r in client.records.values()) < want and time.monotonic() < deadline:
        if not client.pending() or client.reader.done():
            return
        await asyncio.sleep(0.002)


async def _stream_trial(stub, rng: random.Random, tag: str, mode: str, stats: Counter) -> None:
    client = StreamClient(stub)
    ids = [f"{tag}-{i}" for i in range(rng.randint(1, 3))]
    for rid in ids:
        await client.send(generate(rid, text=_prompt(rng), max_tokens=rng.randint(20, 150)))
    await _until_tokens(client, rng.randint(0, 12))
    if mode == "cancel_then_disconnect":
        for rid in rng.sample(ids, rng.randint(1, len(ids))):
            await client.cancel(rid)
            stats["cancel_messages"] += 1
        await asyncio.sleep(rng.random() * 0.01)
        client.abort()
    elif mode == "disconnect":
        client.abort()
    else:  # cancel every request, then close politely: each must end with exactly one terminal
        for rid in ids:
            await client.cancel(rid)
            stats["cancel_messages"] += 1
        assert await client.wait_terminals(30), f"{tag}: no terminal for {client.pending()}"
        await client.close()
        for rid in ids:
            record = client.records[rid]
            assert record.final is not None and record.extra_terminals == 0, (rid, record)
            stats[f"final:{pb.FinishReason.Name(record.final.finish_reason)}"] += 1
        assert client.status == grpc.StatusCode.OK, (client.status, client.details)
    stats["requests"] += len(ids)
    client.reader.cancel()


async def _generate_trial(stub, rng: random.Random, tag: str, mode: str, stats: Counter) -> None:
    kw = {"timeout": rng.uniform(0.02, 0.3)} if mode == "deadline" else {}
    req = generate(tag, text=_prompt(rng), max_tokens=rng.randint(20, 150)).generate
    call = stub.Generate(req, **kw)
    stop_after = rng.randint(0, 6)
    seen = 0
    try:
        async for _ in call:
            seen += 1
            if mode == "unary_cancel" and seen >= stop_after:
                call.cancel()
                break
    except grpc.aio.AioRpcError as exc:
        stats[f"generate:{exc.code().name}"] += 1
    stats["requests"] += 1


async def _channel_drop_trial(target: str, rng: random.Random, tag: str, stats: Counter) -> None:
    """The whole connection goes away (as a killed client would) with requests streaming."""
    channel = grpc.aio.insecure_channel(target)
    client = StreamClient(pb_grpc.SloserveStub(channel))
    for i in range(rng.randint(1, 3)):
        await client.send(
            generate(f"{tag}-{i}", text=_prompt(rng), max_tokens=rng.randint(20, 150))
        )
        stats["requests"] += 1
    await _until_tokens(client, rng.randint(0, 8))
    await channel.close(grace=None)
    client.reader.cancel()


MODES = (
    "disconnect",
    "cancel_then_disconnect",
    "cancel_all",
    "unary_cancel",
    "deadline",
    "channel_drop",
)


@pytest.mark.parametrize(
    ("server_fixture", "trials"),
    [("small_pool_server", TRIALS), ("small_pool_moe_server", TRIALS // 4)],
    ids=["llama", "mixtral"],
)
async def test_random_disconnects_and_cancels_free_everything(request, server_fixture, trials):
    server = request.getfixturevalue(server_fixture)
    target = f"127.0.0.1:{server.port}"
    before = server.wait_quiescent()
    log_mark = len(server.logs)
    assert quiescent(before), describe(before)
    stats: Counter = Counter()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SloserveStub(channel)
        # First make sure requests are swapped out when the client vanishes: fill the pool
        # past its size so the scheduler preempts, then drop the stream.
        client = StreamClient(stub)
        for i in range(8):
            await client.send(generate(f"fill-{i}", text="x" * 60, max_tokens=180))
        deadline = time.monotonic() + 60
        while server.info().stats.preemptions_total == before.preemptions_total:
            assert time.monotonic() < deadline, (
                f"no preemption happened: {describe(server.info().stats)}"
            )
            await asyncio.sleep(0.02)
        client.abort()
        stats["requests"] += 8

        rng = random.Random(1234)
        sem = asyncio.Semaphore(PARALLEL)

        async def trial(n: int) -> None:
            mode = MODES[n % len(MODES)] if n < len(MODES) else rng.choice(MODES)
            stats[f"mode:{mode}"] += 1
            async with sem:
                if mode in ("unary_cancel", "deadline"):
                    await _generate_trial(stub, rng, f"t{n}", mode, stats)
                elif mode == "channel_drop":
                    await _channel_drop_trial(target, rng, f"t{n}", stats)
                else:
                    await _stream_trial(stub, rng, f"t{n}", mode, stats)

        await asyncio.wait_for(asyncio.gather(*(trial(n) for n in range(trials))), 480)

    after = server.wait_quiescent(timeout=60)
    print(
        f"\ndisconnects ({server_fixture}): {trials} trials, {dict(sorted(stats.items()))}\n"
        f"  before: {describe(before)}\n  after:  {describe(after)}\n  rss: {server.rss_bytes() / 2**20:.0f} MiB"
    )
    assert quiescent(after), f"resources still held after every client left: {describe(after)}"
    assert after.kv_blocks_total == before.kv_blocks_total
    assert after.preemptions_total > before.preemptions_total  # the swap path was exercised
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    assert server.health(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    errors = [e for e in server.logs[log_mark:] if e.get("level") == "error"]
    assert not errors, errors[:3]
