"""Asyncio load generator over sloserve's bidirectional Stream RPC (HTTP: sloserve.bench.http_client).

Requests are spread round-robin over ``streams`` open streams; the arrival process (Poisson or
closed loop) is sloserve.bench.driver's, shared by both protocols.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from sloserve.bench.driver import drive
from sloserve.bench.record import RequestRecord
from sloserve.bench.workloads import WorkloadItem
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc
from sloserve.sampling_params import SLO

_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_FINISH_NAMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
}
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Sloserve"].full_name
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024**2),
    ("grpc.max_send_message_length", 64 * 1024**2),
]


@dataclass(slots=True)
class LoadSpec:
    """How to send a workload: arrival process, limits, objectives and sampling."""

    rate: float = math.inf  # Poisson arrivals per second; inf = no pacing
    concurrency: int | None = None  # most requests in flight; None = unbounded
    num_requests: int | None = None  # None: one pass over the workload (unless duration_s)
    duration_s: float | None = None  # stop sending after this long
    streams: int = 1
    seed: int = 0
    slo: SLO | None = None  # sent with each request and used for attainment
    temperature: float = 0.0
    ignore_eos: bool = False
    request_timeout_s: float = 600.0  # a request still open this long is cancelled and failed
    auth_token: str | None = None
    # a Lark grammar every answer must follow (structured output), e.g. the ARC grid's
    grammar: str | None = None

    def __post_init__(self) -> None:
        if not (self.rate > 0):
            raise ValueError(f"rate must be > 0 requests/s (inf for no pacing), got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.streams < 1:
            raise ValueError(f"streams must be >= 1, got {self.streams}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"number of requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration_s}")
        if self.duration_s is not None and math.isinf(self.rate) and self.concurrency is None:
            raise ValueError(
                "a run bounded by duration needs a finite rate or a concurrency limit; "
                "set --rate or --concurrency"
            )


@dataclass(slots=True)
class RunResult:
    """Every request record of one run at one rate, and the run's wall-clock span."""

    rate: float
    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0


class _StreamConn:
    """One open Stream: writes requests, reads server messages and routes them by request id."""

    def __init__(self, stub: pb_grpc.SloserveStub, metadata: tuple) -> None:
        self._call = stub.Stream(metadata=metadata or None)
        self._lock = asyncio.Lock()
        self._pending: dict[str, tuple[RequestRecord, asyncio.Future]] = {}
        self._reader = asyncio.create_task(self._read())

    async def send(self, request: pb.GenerateRequest, record: RequestRecord) -> asyncio.Future:
        """Send one request; the future resolves when its terminal message arrives."""
        done = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = (record, done)
        async with self._lock:
            record.send_time = time.perf_counter()
            try:
                await self._call.write(pb.ClientMessage(generate=request))
            except grpc.aio.AioRpcError as exc:
                self.finish(request.request_id, "failed", exc.code(), "stream_lost")
            except (grpc.aio.UsageError, asyncio.InvalidStateError):
                self.finish(
                    request.request_id, "failed", grpc.StatusCode.UNAVAILABLE, "stream_lost"
                )
        return done

    async def give_up(self, request_id: str) -> None:
        """Cancel a request that ran past the client's timeout and record it as failed."""
        self.finish(request_id, "failed", grpc.StatusCode.DEADLINE_EXCEEDED, "client_timeout")
        async with self._lock:
            try:
                await self._call.write(
                    pb.ClientMessage(cancel=pb.CancelRequest(request_id=request_id))
                )
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass

    def finish(
        self, request_id: str, status: str, code: grpc.StatusCode | str | None, reason: str | None
    ) -> RequestRecord | None:
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return None
        record, done = entry
        record.end_time = time.perf_counter()
        record.status = status
        if code is not None:
            record.error_code = code if isinstance(code, str) else code.name
        record.error_reason = reason
        if not done.done():
            done.set_result(record)
        return record

    async def _read(self) -> None:
        code: grpc.StatusCode | None = grpc.StatusCode.UNKNOWN
        try:
            while (message := await self._call.read()) is not grpc.aio.EOF:
                self._dispatch(message)
            code = None
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
        for request_id in list(self._pending):
            self.finish(request_id, "failed", code or grpc.StatusCode.UNAVAILABLE, "stream_lost")

    def _dispatch(self, message: pb.ServerMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "chunk":
            entry = self._pending.get(message.chunk.request_id)
            if entry is not None:
                record = entry[0]
                if message.chunk.token_ids:
                    record.chunk_times.append(time.perf_counter())
                    record.chunk_tokens.append(len(message.chunk.token_ids))
                record.text += message.chunk.text
        elif kind == "final":
            final = message.final
            record = self.finish(final.request_id, "ok", None, None)
            if record is not None:
                record.finish_reason = _FINISH_NAMES.get(final.finish_reason, "unspecified")
                record.prompt_tokens = final.prompt_tokens
                record.output_tokens = final.completion_tokens or sum(record.chunk_tokens)
                record.cached_tokens = final.cached_prompt_tokens
        elif kind == "error":
            error = message.error
            self.finish(
                error.request_id,
                "refused",
                _CODE_NAMES.get(error.code, str(error.code)),
                error.reason or None,
            )

    async def close(self) -> None:
        try:
            await self._call.done_writing()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), 5.0)
        except (TimeoutError, asyncio.CancelledError):
            self._call.cancel()
            self._reader.cancel()


def build_request(
    request_id: str, item: WorkloadItem, spec: LoadSpec, slo: SLO | None
) -> pb.GenerateRequest:
    """The GenerateRequest for one workload item."""
    sampling = pb.SamplingParams(
        temperature=spec.temperature, ignore_eos=item.ignore_eos or spec.ignore_eos
    )
    if spec.grammar is not None:
        sampling.structured.grammar = spec.grammar
    message = pb.GenerateRequest(
        request_id=request_id, text=item.prompt, max_tokens=item.max_tokens, sampling=sampling
    )
    if slo is not None:
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            if (value := getattr(slo, name)) is not None:
                setattr(message.slo, name, value)
    if item.priority is not None:
        message.priority = item.priority
    return message


async def ready_within(channel: grpc.aio.Channel, timeout_s: float) -> bool:
    """Whether the channel connects within timeout_s; one that does not is closed."""
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        await channel.close()
        return False
    return True


async def connect(target: str, timeout_s: float = 10.0) -> grpc.aio.Channel:
    """An open channel to a server; ConnectionError when it is not reachable within timeout_s."""
    channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    if not await ready_within(channel, timeout_s):
        raise ConnectionError(
            f"cannot reach a sloserve server at {target} within {timeout_s:g} s: "
            "check --server HOST:PORT and that the server is running"
        )
    return channel


async def wait_ready(
    channel: grpc.aio.Channel, timeout_s: float, auth_token: str | None = None
) -> None:
    """Wait until the server's health check says the service is SERVING (model loaded).

    Servers without the health service are taken as ready; ConnectionError after timeout_s.
    """
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reply = await stub.Check(request, timeout=5.0, metadata=_metadata(auth_token) or None)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise ConnectionError(
                    f"the server refused our credentials: {exc.details()}"
                ) from None
        if time.monotonic() >= deadline:
            raise ConnectionError(
                f"the server is reachable but not ready after {timeout_s:g} s "
                "(model still loading?): raise --ready-timeout"
            ) from None
        await asyncio.sleep(0.5)


async def fetch_info(channel: grpc.aio.Channel, auth_token: str | None = None) -> dict:
    """The server's model and limits ({} when the server does not answer Info)."""
    try:
        info = await pb_grpc.SloserveStub(channel).Info(
            pb.InfoRequest(), timeout=10.0, metadata=_metadata(auth_token) or None
        )
    except grpc.aio.AioRpcError:
        return {}
    return info_fields(info)


def info_fields(info: pb.InfoResponse) -> dict:
    """The model and limits of an InfoResponse, as fetch_info returns them."""
    return {
        "model": info.model,
        "architecture": info.architecture,
        "version": info.version,
        "device": info.device,
        "max_model_len": info.max_model_len,
        "attention_backend": info.attention_backend,
    }


def _metadata(auth_token: str | None) -> tuple:
    return (("authorization", f"Bearer {auth_token}"),) if auth_token else ()


async def run_load(
    channel: grpc.aio.Channel,
    items: list[WorkloadItem],
    spec: LoadSpec,
    on_done: Callable[[RequestRecord], None] | None = None,
    id_prefix: str = "bench",
) -> RunResult:
    """Send the workload as spec says and record every request; never raises for a request."""
    if not items:
        raise ValueError("the workload holds no requests")
    stub = pb_grpc.SloserveStub(channel)
    conns = [_StreamConn(stub, _metadata(spec.auth_token)) for _ in range(spec.streams)]
    records, duration_s = await drive(conns, items, spec, build_request, on_done, id_prefix)
    return RunResult(spec.rate, records, duration_s)
