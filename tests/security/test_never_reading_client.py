"""A client that writes and never reads: the server stops reading it, then ends its Stream; RSS stays bounded.

The attack (issue 44): 200k cancels for unknown ids (200-character ids), each answered with a RequestError the client
never reads. Unbounded, the answers queued in the server (front end 90 -> 225 MiB, linear). Bounded,
the server reads at most --grpc-stream-queue messages ahead of what it could write, flow control
stops the client's writes, and the write that waited --grpc-stream-stall-timeout ends the Stream
RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
import orjson
import pytest
from sloserve.config import GrpcConfig
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.live_server import Transcript, gen, live_server, read_until
from sloserve.testing.procfs import vm_bytes
from sloserve.testing.server_process import ServerProcess

from tests.security.helpers import refusals, status

pytestmark = pytest.mark.timeout(120)
MESSAGES = 200_000
RSS_MARGIN = 24 * 1024 * 1024  # unbounded, 200k answers held ~135 MiB
STALL_S = 2.0
# a client whose HTTP/2 window holds a few dozen answers
SMALL_WINDOW = [
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 8192),
    ("grpc.use_local_subchannel_pool", 1),
]


async def _watch_rss(pid: int, peak: list[int]) -> None:
    while True:
        peak[0] = max(peak[0], vm_bytes(pid) or 0)
        await asyncio.sleep(0.05)


async def test_a_client_that_never_reads_holds_bounded_memory():
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc to read a process's RSS")
    server = ServerProcess(
        [orjson.dumps({"grace_s": 1.0, "grpc": {"stream_stall_s": STALL_S}}).decode()],
        command=(sys.executable, "-m", "sloserve.testing.fake_server"),
        startup_s=60,
    )
    try:
        async with server.aio_channel() as channel:
            stub = pb_grpc.SloserveStub(channel)
            # warm up: the allocator's and grpc's first buffers are not the attack's
            warm = stub.Stream()
            for i in range(20):
                await warm.write(gen(f"w{i}", max_tokens=8))
            await read_until(warm, Transcript(), {f"w{i}" for i in range(20)})
            await warm.done_writing()
            baseline = vm_bytes(server.proc.pid) or 0
            peak = [baseline]
            watcher = asyncio.create_task(_watch_rss(server.proc.pid, peak))
            sent = 0

            def flood():
                nonlocal sent
                for i in range(MESSAGES):
                    sent += 1
                    yield pb.ClientMessage(cancel=pb.CancelRequest(request_id=f"{i:0200d}"))

            call = stub.Stream(flood())  # written as fast as flow control lets it; never read
            await asyncio.to_thread(
                server.wait_log, lambda m: "ending a Stream whose client reads nothing" in m, 60
            )
            watcher.cancel()
            growth = peak[0] - baseline
            assert growth < RSS_MARGIN, f"server RSS grew {growth / 2**20:.1f} MiB"
            # 200k x 200+ bytes is more than any HTTP/2 window grpc grows to: a client that could
            # write them all was read all along
            assert sent < MESSAGES // 2, (
                f"the client could write {sent} messages: the server kept reading"
            )
            print(
                f"server RSS +{growth / 2**20:.1f} MiB; the client wrote {sent} of {MESSAGES} messages"
            )
            # NOTE: the status this client then reads is its grpc library's: the send the server's
            # end left blocked fails, and grpc.aio reports INTERNAL; the next test reads the status
            call.cancel()
            assert not [entry for entry in server.logs if entry["level"] not in ("info", "warning")]
    finally:
        server.kill()


async def test_the_stalled_stream_ends_resource_exhausted_naming_the_flag():
    config = GrpcConfig(stream_queue=16, stream_stall_s=0.5)
    async with live_server(grpc_config=config) as (server, _, _channel):
        # a small window: the client stops writing before its own sends block (a send left
        # blocked when the stream ends is failed by grpc.aio as INTERNAL)
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{server.port}", options=SMALL_WINDOW
        ) as channel:
            stub = pb_grpc.SloserveStub(channel)
            call = stub.Stream()
            for i in range(200):  # answers enough to fill that window, never read
                message = pb.ClientMessage(cancel=pb.CancelRequest(request_id=f"{i:0200d}"))
                await asyncio.wait_for(call.write(message), 10)
            await asyncio.wait_for(_until(lambda: refusals(server, "grpc_stream_stalled")), 30)
            # it reads at last: what was on its way, then the status
            code, details = await status(call, timeout=30)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
            assert "--grpc-stream-stall-timeout" in details
            healthy = stub.Stream()  # the server serves the next stream as before
            await healthy.write(gen("after", max_tokens=2))
            transcript = Transcript()
            await read_until(healthy, transcript, {"after"})
            assert transcript.terminal("after").WhichOneof("kind") == "final"
            healthy.cancel()


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.05)


async def test_a_generate_call_never_read_ends_resource_exhausted_and_frees_its_request():
    engine = FakeEngine(step_s=0.001, max_model_len=4096, num_blocks=512)
    async with live_server(engine, grpc_config=GrpcConfig(stream_stall_s=0.5)) as (
        server,
        _,
        _channel,
    ):
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{server.port}", options=SMALL_WINDOW
        ) as channel:
            call = pb_grpc.SloserveStub(channel).Generate(
                gen("never-read", max_tokens=3000).generate
            )
            await asyncio.wait_for(_until(lambda: refusals(server, "grpc_stream_stalled")), 30)
            # its KV blocks are back
            await asyncio.wait_for(_until(lambda: not engine.stats().running), 30)
            code, details = await status(call, timeout=30)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
            assert "--grpc-stream-stall-timeout" in details
