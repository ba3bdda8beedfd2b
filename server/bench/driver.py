"""The arrival process of a load run, whatever the protocol: Poisson or unpaced, capped concurrency.

Requests are spread round-robin over ``conns`` (gRPC streams, or HTTP clients). Arrivals are
Poisson at ``rate`` requests/s (``inf`` sends as fast as allowed), or, for items that carry an
``arrival_s`` (a trace), at those times from the run's start; ``concurrency`` caps requests
in flight (with an infinite rate that is a closed loop). A run ends after ``num_requests``
arrivals or once ``duration_s`` has passed, and then waits for the requests in flight.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sloserve.bench.record import RequestRecord
from sloserve.bench.stats import effective_slo, slo_class_name
from sloserve.bench.workloads import WorkloadItem


class Conn(Protocol):
    """One way to send requests: `send` returns a future that resolves once the request is over."""

    async def send(self, request: Any, record: RequestRecord) -> asyncio.Future: ...

    async def give_up(self, request_id: str) -> None: ...

    async def close(self) -> None: ...


async def drive(
    conns: Sequence[Conn],
    items: list[WorkloadItem],
    spec: Any,
    build: Callable[..., Any],
    on_done: Callable[[RequestRecord], None] | None,
    id_prefix: str,
) -> tuple[list[RequestRecord], float]:
    """Send the workload as `spec` (a LoadSpec) says; returns every record and the run's span (s).

    `build(request_id, item, spec, slo)` makes the protocol's request. Never raises for a request.
    """
    rng = random.Random(spec.seed)
    limit = spec.num_requests or (None if spec.duration_s else len(items))
    gate = asyncio.Semaphore(spec.concurrency) if spec.concurrency else None
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []

    async def one(index: int, conn: Conn, item: WorkloadItem) -> None:
        slo = effective_slo(item.slo, spec.slo)
        request_id = f"{id_prefix}-{index}"
        record = RequestRecord(
            request_id,
            0.0,
            item.max_tokens,
            item.expected_output,
            slo,
            slo_class=item.slo_class or slo_class_name(slo),
        )
        records.append(record)
        try:
            done = await conn.send(build(request_id, item, spec, slo), record)
            try:
                await asyncio.wait_for(asyncio.shield(done), spec.request_timeout_s)
            except TimeoutError:
                await conn.give_up(request_id)
            if on_done is not None:
                on_done(record)
        finally:
            if gate is not None:
                gate.release()

    start = time.perf_counter()
    next_arrival = start
    try:
        index = 0
        while limit is None or index < limit:
            item = items[index % len(items)]
            if item.arrival_s is not None:  # a trace: its own send time
                next_arrival = start + item.arrival_s
            elif math.isfinite(spec.rate):
                next_arrival += rng.expovariate(spec.rate)
            if item.arrival_s is not None or math.isfinite(spec.rate):
                await asyncio.sleep(max(0.0, next_arrival - time.perf_counter()))
            if spec.duration_s is not None and time.perf_counter() - start >= spec.duration_s:
                break
            if gate is not None:
                await gate.acquire()
            tasks.append(asyncio.create_task(one(index, conns[index % len(conns)], item)))
            index += 1
            await asyncio.sleep(0)  # let the request task write before the next arrival
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*(conn.close() for conn in conns), return_exceptions=True)
    ends = [r.end_time for r in records if r.end_time is not None]
    return records, (max(ends) if ends else time.perf_counter()) - start
