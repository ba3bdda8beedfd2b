"""What the reliability tests share beyond sloserve.testing: the CI/full counts and a health watcher."""

from __future__ import annotations

import asyncio
import os

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

FULL = os.environ.get("SLOSERVE_FULL") == "1"


def count(ci: int, full: int) -> int:
    """The CI count, or the full one with SLOSERVE_FULL=1."""
    return full if FULL else ci


def watch_health(channel: grpc.aio.Channel, service: str, statuses: list[int]) -> asyncio.Task:
    """A task appending every status the health Watch stream reports for `service` until it ends."""
    watch = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=service)
    )

    async def follow() -> None:
        try:
            async for reply in watch:
                statuses.append(reply.status)
        except grpc.aio.AioRpcError:
            pass

    return asyncio.create_task(follow())
