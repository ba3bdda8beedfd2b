"""Give the front end's freed heap back to the OS once load subsides (glibc's malloc_trim).

Request bodies, JSON and token buffers of a burst are freed when it ends, but glibc keeps most
of those pages in the process (only the heap's free top is returned, past its trim threshold),
so RSS stayed at its peak; malloc_trim(0) returns most of them. When no request is in flight, the trimmer calls
it at most once per interval, and only when RSS grew past what the last call left.
NOTE: not when the engine runs in this process with --host-malloc keep: that engine keeps freed
activation pages on purpose (executor/host_memory.py).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

INTERVAL_S = 10.0
SLACK_BYTES = 16 << 20  # growth of RSS since the last trim that is worth a trim
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None off glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = (ctypes.c_size_t,)
    return trim


def _resident_bytes() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES


async def trim_when_idle(inflight: Callable[[], int], interval_s: float = INTERVAL_S) -> None:
    """Forever: every `interval_s`, if nothing is in flight and RSS grew SLACK_BYTES past what the
    last trim left, trim."""
    trim = _malloc_trim()
    if trim is None:
        return
    floor = _resident_bytes()
    while True:
        await asyncio.sleep(interval_s)
        if inflight() == 0 and _resident_bytes() > floor + SLACK_BYTES:
            before = _resident_bytes()
            trim(0)
            floor = _resident_bytes()
            log.debug("malloc_trim: RSS %d -> %d MiB", before >> 20, floor >> 20)
