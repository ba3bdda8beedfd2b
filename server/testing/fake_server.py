"""Run `sloserve.serve.run` over a FakeEngine in this process: the server a test starts as a child
process when it needs a process of its own (SIGTERM, RSS bounds).

Usage: python -m sloserve.testing.fake_server '{"step_s": 0.01, "die_after_s": 0.5, "grpc": {...}}'
Every key is optional: step_s (default 0.005 s a token), die_after_s (the fake engine loop "dies"
that long after start, and the server must exit 1), grace_s (default 20 s), grpc (GrpcConfig
fields). Logs JSON lines on stderr; the 'listening on HOST:PORT' line gives the port.
"""

from __future__ import annotations

import asyncio
import sys

import orjson
from sloserve import serve
from sloserve.config import GrpcConfig, ServerConfig, SloserveConfig
from sloserve.logs import configure_logging
from sloserve.testing.fake_engine import FakeEngine


async def main(
    step_s: float = 0.005,
    die_after_s: float | None = None,
    grace_s: float = 20.0,
    grpc: dict | None = None,
) -> int:
    config = SloserveConfig(
        server=ServerConfig(port=0, metrics_port=None, grace_s=grace_s),
        grpc=GrpcConfig(**(grpc or {})),
    )
    engine = FakeEngine(step_s=step_s, max_running=64, num_blocks=1024)
    if die_after_s is not None:

        async def die() -> None:
            await asyncio.sleep(die_after_s)
            engine.dead_reason = "fake loop crashed"
            engine.alive = False

        dying = asyncio.create_task(die())  # noqa: F841 - held so the task is not collected
    return await serve.run(config, engine=engine)


if __name__ == "__main__":
    configure_logging("json")
    sys.exit(asyncio.run(main(**(orjson.loads(sys.argv[1]) if len(sys.argv) > 1 else {}))))
