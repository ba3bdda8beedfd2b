"""An SSE client that stops reading: the stream buffers a bounded amount, then is aborted (in the
engine too) with a logged reason, once its writes stayed blocked past --http-stream-stall-timeout."""

from __future__ import annotations

import asyncio
import logging
import socket

import orjson
import pytest
from sloserve.config import ServerConfig, SloserveConfig
from sloserve.frontend.lifecycle import Lifecycle
from sloserve.http import sse
from sloserve.http.config import HttpConfig
from sloserve.http.server import HttpServer
from sloserve.testing.fake_engine import FakeEngine
from sloserve.testing.live_server import wait_for

pytestmark = pytest.mark.timeout(120)

STALL_S = 0.5
MAX_TOKENS = 50_000  # far more than loopback's socket buffers hold as SSE chunks


async def test_a_stream_whose_client_stopped_reading_is_aborted_in_the_engine(caplog):
    # ~20 s of tokens at least
    engine = FakeEngine(num_blocks=10_000, max_model_len=MAX_TOKENS + 100, step_s=0.001)
    config = SloserveConfig(
        server=ServerConfig(port=0, metrics_port=None, max_tokens_limit=MAX_TOKENS)
    )
    lifecycle = Lifecycle(config, engine, watchdog_interval_s=0.02)
    http = HttpServer(lifecycle, HttpConfig(port=0, stream_stall_s=STALL_S))
    await http.start()
    lifecycle.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        await wait_for(lambda: lifecycle.ready)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, and never read
        sock.connect(("127.0.0.1", http.port))
        body = orjson.dumps(
            {"prompt": "hi", "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True}
        )
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        with caplog.at_level(logging.INFO):
            await wait_for(lambda: engine.stats().requests_finished_total == 1, timeout=60)
        assert not engine.reqs  # aborted in the engine, long before its 50,000 tokens
        assert engine.stats().generated_tokens_total < MAX_TOKENS
        stalls = [r for r in caplog.records if "--http-stream-stall-timeout" in r.getMessage()]
        assert stalls and stalls[0].levelno == logging.WARNING, caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
        refusals = lifecycle.metrics.limit_refusals.labels(
            lifecycle.metrics.model_name, "http_stream_stall"
        )._value.get()
        assert refusals == 1
        assert (
            lifecycle.metrics.requests.labels(
                lifecycle.metrics.model_name, "cancelled"
            )._value.get()
            == 1
        )
    finally:
        sock.close()
        await lifecycle.stop()
        await http.stop()


async def test_a_blocked_stream_makes_no_chunk_past_the_one_it_cannot_send():
    made, sent, stalled, aborted, closed = 0, [], [], [], []
    unblocked = asyncio.Event()

    async def body():
        nonlocal made
        while True:
            made += 1
            yield b"data: {}\n\n"

    async def send(message: dict) -> None:
        # the client's window is full: this write completes only once the connection drops
        if len(sent) == 3:
            await unblocked.wait()
            return
        sent.append(message)

    async def close() -> None:
        closed.append(True)

    # what http/guard.py's hook does: drop the connection, the blocked send returns
    def abort() -> None:
        aborted.append(True)
        unblocked.set()

    watcher = asyncio.create_task(asyncio.sleep(3600))
    stream = sse.EventStream(body(), watcher, close, lambda: stalled.append(True))
    task = asyncio.create_task(stream({"extensions": {sse.ABORT_EXTENSION: abort}}, None, send))
    for _ in range(1000):  # until the send is blocked (bounded)
        if stream.sending_since is not None and len(sent) == 3:
            break
        await asyncio.sleep(0.001)
    assert stream.sending_since is not None
    stream.stall()
    await asyncio.wait_for(task, 30)
    # the start, two chunks sent, the third blocked: nothing more made
    assert made == 3 and len(sent) == 3
    assert stalled == aborted == closed == [True] and watcher.cancelled()
