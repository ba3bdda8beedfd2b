"""An asyncio Stream client that records, per request, what came back and when."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
from sloserve.pb import serving_pb2 as pb
from sloserve.pb import serving_pb2_grpc as pb_grpc


@dataclass
class Record:
    """One request as the client saw it."""

    request_id: str
    sent_at: float
    first_chunk_at: float | None = None
    done_at: float | None = None
    tokens: int = 0
    final: pb.Final | None = None
    error: pb.RequestError | None = None
    extra_terminals: int = 0  # terminal messages after the first: must stay 0

    @property
    def outcome(self) -> str:
        """'final:<reason>', 'error:<CODE>' or 'none' (no terminal message yet)."""
        if self.final is not None:
            return f"final:{pb.FinishReason.Name(self.final.finish_reason)}"
        if self.error is not None:
            return f"error:{grpc.StatusCode(_CODES[self.error.code]).name}"
        return "none"


_CODES = {code.value[0]: code.value for code in grpc.StatusCode}


def generate(
    request_id: str,
    *,
    text: str | None = None,
    ids: list[int] | None = None,
    max_tokens: int = 16,
    ignore_eos: bool = True,
    slo: pb.Slo | None = None,
) -> pb.ClientMessage:
    req = pb.GenerateRequest(request_id=request_id, max_tokens=max_tokens)
    if ids is not None:
        req.token_ids.ids.extend(ids)
    else:
        req.text = text or "hello"
    req.sampling.ignore_eos = ignore_eos
    if slo is not None:
        req.slo.CopyFrom(slo)
    return pb.ClientMessage(generate=req)


@dataclass
class StreamClient:
    """Many requests multiplexed on one bidirectional Stream; a reader task files every reply."""

    stub: pb_grpc.SloserveStub
    metadata: tuple[tuple[str, str], ...] | None = None
    records: dict[str, Record] = field(default_factory=dict)
    unmatched: list[pb.ServerMessage] = field(default_factory=list)
    status: grpc.StatusCode | None = None
    details: str = ""

    def __post_init__(self) -> None:
        self.call = self.stub.Stream(metadata=self.metadata)
        self._write_lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self.reader = asyncio.create_task(self._read())

    async def send(self, msg: pb.ClientMessage) -> Record | None:
        """Write one message; a generate gets a Record keyed by its id."""
        record = None
        if msg.WhichOneof("kind") == "generate":
            rid = msg.generate.request_id
            record = self.records[rid] = Record(rid, time.monotonic())
        async with self._write_lock:
            await self.call.write(msg)
        return record

    async def cancel(self, request_id: str) -> None:
        async with self._write_lock:
            await self.call.write(pb.ClientMessage(cancel=pb.CancelRequest(request_id=request_id)))

    async def _read(self) -> None:
        try:
            while (msg := await self.call.read()) is not grpc.aio.EOF:
                self._file(msg, time.monotonic())
        except grpc.aio.AioRpcError:
            pass
        except asyncio.CancelledError:
            pass
        try:
            self.status = await self.call.code()
            self.details = await self.call.details() or ""
        except asyncio.CancelledError:
            self.status = grpc.StatusCode.CANCELLED
        self._changed.set()

    def _file(self, msg: pb.ServerMessage, now: float) -> None:
        kind = msg.WhichOneof("kind")
        body = getattr(msg, kind)
        record = self.records.get(body.request_id)
        if record is None:
            self.unmatched.append(msg)
            return
        if kind == "chunk":
            record.tokens += len(body.token_ids)
            if record.first_chunk_at is None:
                record.first_chunk_at = now
        elif record.final is not None or record.error is not None:
            record.extra_terminals += 1
        else:
            record.done_at = now
            if kind == "final":
                record.final = body
            else:
                record.error = body
        self._changed.set()

    def pending(self) -> list[str]:
        return [r.request_id for r in self.records.values() if r.final is None and r.error is None]

    async def wait_terminals(self, timeout: float) -> bool:
        """Wait until every request has its terminal message or the stream ended; False on timeout."""

        async def poll() -> None:
            while self.pending() and not self.reader.done():
                self._changed.clear()
                await self._changed.wait()

        try:
            await asyncio.wait_for(poll(), timeout)
            return True
        except TimeoutError:
            return False

    async def close(self, timeout: float = 60.0) -> None:
        """Half-close and wait for the server to end the stream."""
        async with self._write_lock:
            await self.call.done_writing()
        await asyncio.wait_for(asyncio.shield(self.reader), timeout)

    def abort(self) -> None:
        """Drop the stream mid-flight, as a vanished client would."""
        self.call.cancel()


def outcomes(records: list[Record]) -> Counter[str]:
    return Counter(r.outcome for r in records)
