"""Run `sloserve.serve.run` over a FakeEngine in this process (for the process-lifecycle tests).

Usage: python -m tests.service.fake_server STEP_S [DIE_AFTER_S]
Logs JSON lines on stderr (the 'listening on HOST:PORT' line gives the port). With DIE_AFTER_S
the fake engine loop "dies" that long after start, and the server must exit 1.
"""

from __future__ import annotations

import asyncio
import sys

from sloserve import serve
from sloserve.config import ServerConfig, SloserveConfig
from sloserve.logs import configure_logging

from tests.service.fake_engine import FakeEngine


async def main(step_s: float, die_after_s: float | None = None) -> int:
    config = SloserveConfig(server=ServerConfig(port=0, metrics_port=None, grace_s=20.0))
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
    die = float(sys.argv[2]) if len(sys.argv) > 2 else None
    sys.exit(asyncio.run(main(float(sys.argv[1]), die)))
