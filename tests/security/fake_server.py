"""`sloserve.serve.run` over a FakeEngine in a process of its own, for the attacks whose bound is its RSS.

Usage: python -m tests.security.fake_server '{"stream_stall_s": 2}'   (GrpcConfig fields as JSON)
Logs JSON lines on stderr; the 'listening on HOST:PORT' line gives the port.
"""

from __future__ import annotations

import asyncio
import sys

import orjson
from sloserve import serve
from sloserve.config import GrpcConfig, ServerConfig, SloserveConfig
from sloserve.logs import configure_logging

from tests.service.fake_engine import FakeEngine


async def main(grpc_fields: dict) -> int:
    config = SloserveConfig(server=ServerConfig(port=0, metrics_port=None, grace_s=1.0),
                            grpc=GrpcConfig(**grpc_fields))
    return await serve.run(config, engine=FakeEngine(step_s=0.005, max_running=64, num_blocks=1024))


if __name__ == "__main__":
    configure_logging("json")
    sys.exit(asyncio.run(main(orjson.loads(sys.argv[1]) if len(sys.argv) > 1 else {})))
