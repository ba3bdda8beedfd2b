"""What the attack tests share: the limit refusal counter, a Stream's end, a reply to one message."""

from __future__ import annotations

import asyncio

import grpc
from sloserve.grpc.server import SloserveServer
from sloserve.pb import serving_pb2 as pb


def refusals(server: SloserveServer, limit: str) -> float:
    """sloserve_limit_refusals_total{limit} of the server's metrics."""
    value = server.metrics.registry.get_sample_value(
        "sloserve_limit_refusals_total", {"model_name": server.metrics.model_name, "limit": limit}
    )
    return value or 0.0


async def status(call, timeout: float = 10.0) -> tuple[grpc.StatusCode, str]:
    """Read the call to its end (bounded); its status code and details."""

    async def drain() -> None:
        while await call.read() is not grpc.aio.EOF:
            pass

    try:
        await asyncio.wait_for(drain(), timeout)
    except grpc.aio.AioRpcError:
        pass
    return await call.code(), await call.details()


async def open_stream(stub) -> grpc.aio.StreamStreamCall:
    """A Stream the server has certainly started: one message sent and its answer read."""
    call = stub.Stream()
    await call.write(pb.ClientMessage(cancel=pb.CancelRequest(request_id="nothing-live")))
    reply = await asyncio.wait_for(call.read(), 10)
    assert reply is not grpc.aio.EOF and reply.WhichOneof("kind") == "error", reply
    return call
