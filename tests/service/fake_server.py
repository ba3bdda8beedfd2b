"""Run `sloserve.serve.run` over a FakeEngine in this process (for the SIGTERM subprocess test).

Usage: python -m tests.service.fake_server STEP_S   (prints 'PORT <n>' once bound)
"""

from __future__ import annotations

import asyncio
import sys

from sloserve import serve
from sloserve.config import ServerConfig, SloserveConfig
from sloserve.logs import configure_logging

from tests.service.fake_engine import FakeEngine


async def main(step_s: float) -> int:
    config = SloserveConfig(server=ServerConfig(port=0, metrics_port=None, grace_s=20.0))
    original_start = serve.SloserveServer.start

    async def start_and_announce(self, **kw) -> None:
        await original_start(self, **kw)
        print(f"PORT {self.port}", flush=True)

    serve.SloserveServer.start = start_and_announce
    return await serve.run(config, engine=FakeEngine(step_s=step_s, max_running=64, num_blocks=1024))


if __name__ == "__main__":
    configure_logging("json")
    sys.exit(asyncio.run(main(float(sys.argv[1]))))
