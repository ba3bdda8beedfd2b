"""Process lifecycle: SIGTERM under load drains and exits 0; a dead engine loop exits non-zero."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import orjson
import pytest
from sloserve.pb import serving_pb2_grpc

from tests.service.helpers import Transcript, gen, read_until

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[2]


async def read_port(proc: asyncio.subprocess.Process) -> int:
    """The port from the server's JSON 'listening on 127.0.0.1:PORT' log line."""
    while True:
        line = await asyncio.wait_for(proc.stderr.readline(), 60)
        assert line, "the server exited before listening"
        if line.startswith(b"{"):
            found = re.match(r"listening on 127\.0\.0\.1:(\d+) ", orjson.loads(line)["msg"])
            if found:
                return int(found.group(1))


async def test_sigterm_under_load_finishes_in_flight_requests():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.service.fake_server", "0.01", cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        port = await read_port(proc)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = serving_pb2_grpc.SloserveStub(channel)
            call = stub.Stream()
            ids = [f"r{i}" for i in range(10)]
            for rid in ids:
                await call.write(gen(rid, max_tokens=40))
            transcript = Transcript()
            while not all(transcript.chunks(rid) for rid in ids):  # all ten are running
                transcript.messages.append(await call.read())
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)  # let the signal land before the next request
            await call.write(gen("late", max_tokens=2))
            await read_until(call, transcript, {*ids, "late"})
            for rid in ids:
                assert transcript.terminal(rid).final.completion_tokens == 40
            assert transcript.terminal("late").error.reason == "draining"
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        logs = [orjson.loads(x) for x in (await proc.stderr.read()).splitlines() if x.startswith(b"{")]
        messages = [entry["msg"] for entry in logs]
        assert all(entry["level"] in ("info", "warning") for entry in logs), logs
        assert any(m.startswith("draining: 10 request(s) in flight") for m in messages), messages
        assert "stopped" in messages
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_dead_engine_loop_exits_non_zero():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.service.fake_server", "0.01", "0.5", cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert await asyncio.wait_for(proc.wait(), 60) == 1
        logs = [orjson.loads(x) for x in (await proc.stderr.read()).splitlines() if x.startswith(b"{")]
        assert any(e["msg"] == "engine loop died: fake loop crashed" and e["level"] == "error" for e in logs), logs
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
