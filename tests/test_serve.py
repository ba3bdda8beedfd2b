"""Process lifecycle: SIGTERM under load drains and exits 0; a dead engine loop exits non-zero."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import orjson
import pytest
from sloserve.pb import serving_pb2_grpc
from sloserve.testing.live_server import Transcript, gen, read_until
from sloserve.testing.server_process import ServerProcess

pytestmark = pytest.mark.timeout(90)
FAKE_SERVER = (sys.executable, "-m", "sloserve.testing.fake_server")


async def test_sigterm_under_load_finishes_in_flight_requests():
    server = ServerProcess(['{"step_s": 0.01}'], command=FAKE_SERVER, startup_s=60)
    try:
        async with server.aio_channel() as channel:
            stub = serving_pb2_grpc.SloserveStub(channel)
            call = stub.Stream()
            ids = [f"r{i}" for i in range(10)]
            for rid in ids:
                await call.write(gen(rid, max_tokens=40))
            transcript = Transcript()
            while not all(transcript.chunks(rid) for rid in ids):  # all ten are running
                transcript.messages.append(await call.read())
            server.signal(signal.SIGTERM)
            await asyncio.sleep(0.2)  # let the signal land before the next request
            await call.write(gen("late", max_tokens=2))
            await read_until(call, transcript, {*ids, "late"})
            for rid in ids:
                assert transcript.terminal(rid).final.completion_tokens == 40
            assert transcript.terminal("late").error.reason == "draining"
        assert await asyncio.to_thread(server.wait, 30) == 0
        logs, messages = server.logs, server.messages()
        assert all(entry["level"] in ("info", "warning") for entry in logs), logs
        assert any(m.startswith("draining: 10 request(s) in flight") for m in messages), messages
        assert "stopped" in messages
    finally:
        server.kill()


def test_dead_engine_loop_exits_non_zero():
    done = subprocess.run(
        [*FAKE_SERVER, '{"step_s": 0.01, "die_after_s": 0.5}'],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=60,
    )
    assert done.returncode == 1
    logs = [orjson.loads(x) for x in done.stderr.splitlines() if x.startswith(b"{")]
    assert any(
        e["msg"] == "engine loop died: fake loop crashed" and e["level"] == "error" for e in logs
    ), logs
