"""After a burst, the front end gives its freed heap back to the OS (glibc malloc_trim) once idle."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from sloserve.frontend import heap

pytestmark = pytest.mark.timeout(60)


@pytest.mark.skipif(heap._malloc_trim() is None, reason="malloc_trim is glibc's")
async def test_freed_heap_goes_back_to_the_os_once_idle():
    inflight = 1
    trimmer = asyncio.create_task(heap.trim_when_idle(lambda: inflight, interval_s=0.01))
    try:
        await asyncio.sleep(0.05)  # the trimmer has taken its floor
        # ~80 MiB of glibc heap blocks
        burst = [bytes(4000) + bytes([i % 256]) for i in range(20_000)]
        # allocated after them: the heap's top is not free, so glibc keeps the pages
        keep = bytes(4000) + b"k"
        del burst
        await asyncio.sleep(0.05)  # in flight: no trim
        busy = heap._resident_bytes()
        inflight = 0  # the load subsides
        for _ in range(500):  # until the trimmer has run (bounded)
            await asyncio.sleep(0.01)
            if heap._resident_bytes() < busy - (40 << 20):
                break
        assert heap._resident_bytes() < busy - (40 << 20)
    finally:
        trimmer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await trimmer
    assert keep
