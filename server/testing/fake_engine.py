"""A small asyncio engine implementing the AsyncEngine contract, for tests of the front end and the edges.

Each request holds ceil((prompt + max_tokens) / block_size) blocks from a fixed pool until it
ends; it emits one token per `step_s` (token id = (prompt sum + i) % 200 + 32, text = chr(id)),
so tests can check chunk interleaving, cancellation and block accounting through Info.
It speaks the real torch-free output types (RequestOutput, EngineStats), and an exception in a
request's task is delivered to that request's stream, never dropped (a dropped one is a hang).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from sloserve.engine.outputs import EngineStats, RequestOutput
from sloserve.engine.stream import RequestStream
from sloserve.errors import EngineDeadError, InvalidRequestError, RequestRefusedError
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SLO, SamplingParams
from sloserve.testing.tokenizer import ByteTokenizer


@dataclass(slots=True)
class _Req:
    id: str
    prompt: list[int]
    params: SamplingParams
    slo: SLO | None
    blocks: int
    stream: RequestStream  # what add_request returned: RequestOutputs, or an exception to raise
    task: asyncio.Task | None = None
    arrival: float = field(default_factory=time.monotonic)
    scheduled: float = field(default_factory=time.monotonic)  # when add_request took it


class FakeEngine:
    """Contract-compatible stand-in for sloserve.engine.AsyncEngine (tests of the front end and the edges)."""

    def __init__(
        self,
        *,
        num_blocks: int = 64,
        block_size: int = 16,
        max_model_len: int = 256,
        step_s: float = 0.01,
        max_running: int = 8,
        start_delay_s: float = 0.0,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.step_s = step_s
        self.max_running = max_running
        self.start_delay_s = start_delay_s
        self.tokenizer = ByteTokenizer()
        self.model_info = {
            "model": "fake",
            "architecture": "FakeForCausalLM",
            "max_model_len": max_model_len,
            "block_size": block_size,
            "device": "cpu",
            "attention_backend": "none",
        }
        self.ready = False
        self.alive = False
        self.dead_reason: str | None = None
        self.flowing = asyncio.Event()  # clear it to hold every token back
        self.flowing.set()
        self.reqs: dict[str, _Req] = {}
        # every request's SLO as received (for deadline tests)
        self.slos: dict[str, SLO | None] = {}
        self.arrivals: dict[str, float] = {}  # every request's arrival_time as received
        self.priorities: dict[str, int] = {}  # every request's priority as received
        # prompt text -> (refusal reason or None, error): such requests fail after they were queued
        self.late_failures: dict[str, tuple[str | None, str]] = {}
        self._free = num_blocks
        self._stats = EngineStats(kv_blocks_total=num_blocks)
        self.stopped = False

    async def start(self) -> None:
        await asyncio.sleep(self.start_delay_s)
        self.ready = self.alive = True

    async def stop(self) -> None:
        self.stopped = True
        self.alive = False
        for rid in list(self.reqs):
            self.abort(rid)

    def add_request(self, new: NewRequest) -> AsyncIterator[RequestOutput]:
        if self.dead_reason is not None or self.stopped:
            raise EngineDeadError(self.dead_reason or "engine stopped")
        request_id, ids, params = new.request_id, new.token_ids, new.params
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"length {self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        if request_id in self.reqs:
            raise InvalidRequestError(f"request id {request_id!r} is already live")
        if len(self.reqs) >= self.max_running:
            self._stats.refusals["queue_full"] = self._stats.refusals.get("queue_full", 0) + 1
            raise RequestRefusedError(
                "queue_full", f"{len(self.reqs)} requests already queued; retry later"
            )
        blocks = math.ceil((len(ids) + params.max_tokens) / self.block_size)
        if blocks > self._free:
            self._stats.refusals["no_kv_blocks"] = self._stats.refusals.get("no_kv_blocks", 0) + 1
            raise RequestRefusedError(
                "no_kv_blocks", "not enough KV cache blocks free; retry later"
            )
        self._free -= blocks
        req = _Req(
            request_id,
            list(ids),
            params,
            new.slo,
            blocks,
            RequestStream(request_id, asyncio.get_running_loop()),
        )
        if new.arrival_time is not None:  # like the real engine: times and deadlines count from it
            req.arrival = new.arrival_time
        self.arrivals[request_id] = req.arrival
        self.priorities[request_id] = new.priority
        self.reqs[request_id] = req
        self.slos[request_id] = new.slo
        self._stats.prompt_tokens_total += len(ids)
        req.task = asyncio.create_task(self._run(req))
        return req.stream

    def report_delivery_lag(self, lag_s: float) -> None:
        """The engine contract's hook for the front end's first-token delay (the fake prices nothing)."""

    async def _run(self, req: _Req) -> None:
        """Produce the request's outputs; an exception goes to its stream instead of vanishing."""
        try:
            await self._produce(req)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, who raises it
            if self.reqs.pop(req.id, None) is not None:
                self._free += req.blocks
            req.stream.put(exc)

    async def _produce(self, req: _Req) -> None:
        failure = self.late_failures.get(self.tokenizer.decode(req.prompt))
        if failure is not None:
            await asyncio.sleep(self.step_s)
            self.reqs.pop(req.id, None)
            self._free += req.blocks
            req.stream.put(
                RequestOutput(
                    req.id,
                    [],
                    "",
                    True,
                    "error",
                    failure[1],
                    len(req.prompt),
                    refusal_reason=failure[0],
                )
            )
            return
        base = sum(req.prompt)
        first = None
        for i in range(req.params.max_tokens):
            await self.flowing.wait()
            await asyncio.sleep(self.step_s)
            tok = (base + i) % 200 + 32
            first = first or time.monotonic()
            self._stats.generated_tokens_total += 1
            if tok in req.params.stop_token_ids:
                self._finish(req, "stop", i + 1, first, [tok])
                return
            if i == req.params.max_tokens - 1:
                self._finish(req, "length", i + 1, first, [tok])
                return
            req.stream.put(RequestOutput(req.id, [tok], chr(tok), False))

    def _finish(self, req: _Req, reason: str, n: int, first: float | None, last: list[int]) -> None:
        if self.reqs.pop(req.id, None) is None:
            return
        self._free += req.blocks
        self._stats.requests_finished_total += 1
        req.stream.put(
            RequestOutput(
                req.id,
                last,
                "".join(chr(t) for t in last),
                True,
                reason,
                None,
                len(req.prompt),
                n,
                0,
                req.arrival,
                req.scheduled,
                first,
                time.monotonic(),
            )
        )

    def abort(self, request_id: str) -> bool:
        req = self.reqs.get(request_id)
        if req is None:
            return False
        if req.task is not None:
            req.task.cancel()
        self._finish(req, "cancelled", 0, None, [])
        return True

    def stats(self) -> EngineStats:
        s = self._stats
        s.running = len(self.reqs)
        s.kv_blocks_free = self._free
        return EngineStats(**{k: getattr(s, k) for k in EngineStats.__slots__})
