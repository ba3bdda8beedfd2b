"""Load helpers for the overload and soak tests: closed-loop and open-loop drivers, RSS sampling."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable

from sloserve.pb import serving_pb2 as pb

from tests.reliability.client import Record, StreamClient


async def closed_loop(
    clients: list[StreamClient],
    make: Callable[[str], pb.ClientMessage],
    *,
    concurrency: int,
    duration_s: float | None = None,
    total: int | None = None,
    prefix: str = "c",
    timeout_s: float = 120.0,
) -> list[Record]:
    """`concurrency` workers each send one request and wait for its end; stop after a time or a count."""
    ids = itertools.count()
    done: list[Record] = []
    stop_at = time.monotonic() + duration_s if duration_s is not None else None
    overall = time.monotonic() + timeout_s

    async def worker(w: int) -> None:
        client = clients[w % len(clients)]
        while True:
            if stop_at is not None and time.monotonic() >= stop_at:
                return
            n = next(ids)
            if total is not None and n >= total:
                return
            record = await client.send(make(f"{prefix}{n}"))
            while record.final is None and record.error is None:
                if time.monotonic() > overall or client.reader.done():
                    raise AssertionError(f"{record.request_id} got no terminal message: {record}")
                await asyncio.sleep(0.002)
            done.append(record)

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done


async def open_loop(
    clients: list[StreamClient],
    make: Callable[[str], pb.ClientMessage],
    *,
    rate: float,
    duration_s: float,
    prefix: str = "o",
) -> list[Record]:
    """Send at a fixed `rate` (requests/s) for `duration_s`, round-robin over the streams."""
    records: list[Record] = []
    start = time.monotonic()
    n = 0
    while (now := time.monotonic()) - start < duration_s:
        due = int((now - start) * rate) + 1
        while n < due:
            records.append(await clients[n % len(clients)].send(make(f"{prefix}{n}")))
            n += 1
        await asyncio.sleep(min(0.005, 1 / rate))
    return records


class LoopLag:
    """Measures how late this event loop wakes up from short sleeps (the client's own backlog)."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _run(self) -> None:
        while True:
            start = time.monotonic()
            await asyncio.sleep(self.interval_s)
            self.lags.append(time.monotonic() - start - self.interval_s)


class RssSampler:
    """Samples a process's RSS every `interval_s` in a thread; `peak` and `samples` read it back."""

    def __init__(self, read: Callable[[], int], interval_s: float = 0.25) -> None:
        self._read = read
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self._read())
            except (OSError, RuntimeError):
                return
            self._stop.wait(self.interval_s)

    @property
    def peak(self) -> int:
        return max(self.samples)
