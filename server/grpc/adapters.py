"""The LoadAdapter / UnloadAdapter rpcs: LoRA adapters loaded and unloaded while serving."""

from __future__ import annotations

import grpc
from sloserve.engine.client import AdapterControl
from sloserve.errors import AdapterBusyError, InvalidRequestError, UnknownAdapterError
from sloserve.pb import serving_pb2 as pb

# the wire's InFlight -> engine/adapters.py IN_FLIGHT
IN_FLIGHT = {
    pb.IN_FLIGHT_REFUSE: "refuse",
    pb.IN_FLIGHT_DRAIN: "drain",
    pb.IN_FLIGHT_ABORT: "abort",
}


async def adapter_call(
    engine: object, request: pb.LoadAdapterRequest | pb.UnloadAdapterRequest
) -> tuple[grpc.StatusCode, str] | pb.AdapterResponse:
    """Run one adapter operation on `engine`: the adapters after it, or the status that ends the
    call and its message."""
    if not isinstance(engine, AdapterControl):
        return grpc.StatusCode.FAILED_PRECONDITION, "this engine serves no LoRA adapters"
    if not request.name:
        return grpc.StatusCode.INVALID_ARGUMENT, "name must be a non-empty string"
    try:
        if isinstance(request, pb.LoadAdapterRequest):
            if not request.path:
                return grpc.StatusCode.INVALID_ARGUMENT, "path must be a non-empty string"
            await engine.load_adapter(request.name, request.path)
        else:
            in_flight = IN_FLIGHT.get(request.in_flight)
            if in_flight is None:
                return grpc.StatusCode.INVALID_ARGUMENT, f"in_flight {request.in_flight} is unknown"
            await engine.unload_adapter(request.name, in_flight)
    except UnknownAdapterError as exc:
        return grpc.StatusCode.NOT_FOUND, str(exc)
    except AdapterBusyError as exc:
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    except InvalidRequestError as exc:
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return pb.AdapterResponse(adapters=engine.adapter_names())
