"""gRPC method handlers for sloserve.v1.Sloserve whose request parsing never raises.

grpc parses a request before any handler or interceptor runs; a parse error there becomes status
UNKNOWN with an error-level traceback. These handlers parse leniently instead: bytes that do not
parse arrive at the servicer as an `Undecodable`, and the servicer answers INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message
from sloserve.pb import serving_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Sloserve"]

_FACTORIES = {  # (client_streaming, server_streaming) -> handler factory
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A request whose bytes are not a valid `type_name` message."""

    type_name: str
    error: str

    @property
    def message(self) -> str:
        return (
            f"could not parse {self.type_name}: {self.error}; send a valid {self.type_name} message"
        )


def lenient_parser(cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """`cls.FromString`, returning an Undecodable instead of raising."""
    name = cls.DESCRIPTOR.full_name

    def parse(data: bytes) -> Message | Undecodable:
        try:
            return cls.FromString(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or RecursionError on absurd nesting
            return Undecodable(name, str(exc) or type(exc).__name__)

    return parse


def method_handlers(servicer: Any) -> dict[str, grpc.RpcMethodHandler]:
    """One handler per method of the service descriptor, bound to the servicer's method of that name."""
    handlers = {}
    for method in SERVICE.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        factory = _FACTORIES[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=lenient_parser(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    return handlers


def add_to_server(servicer: Any, server: grpc.aio.Server) -> None:
    """Register the servicer (like the generated add_SloserveServicer_to_server, with lenient parsing)."""
    handlers = method_handlers(servicer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
