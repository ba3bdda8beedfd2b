"""How torch's OpenMP workers wait between parallel regions: a bounded spin, then sleep.

OpenMP reads its environment once, when torch loads it, so `default_waiting` must run before
torch is imported: the `sloserve` command calls it first thing, and so does the benchmark harness
for the servers it starts (their figures are of what the command runs). An explicit
OMP_WAIT_POLICY or GOMP_SPINCOUNT (libgomp, torch's OpenMP on Linux) wins.

Why a short bounded spin (GOMP_SPINCOUNT busy-wait iterations), on 2 shared cores:

- libgomp's default spin (300,000 iterations) keeps idle workers on the cores the engine, gRPC
  and asyncio threads need: under tests/reliability/test_overload.py's flood a spin of 100,000
  once completed 145 req/s where passive waiting completed 546 (before small steps ran on one
  thread, executor/runner.py's SERIAL_STEP_MACS).
- Sleeping at once (PASSIVE) makes every parallel region of a mixed step pay a wake-up: a step of
  12 decodes and an 85-token chunk of the built-in model took 13.0 ms passive against 7.8 ms with
  the default spin. Served by benchmarks/goodput.py (slo and fifo, 1.5x / 2x / 3x capacity, 3
  seeds, two alternating rounds), the slo policy met 72-82% / 45-73% / 32-48% of interactive
  objectives passive against 100% / 70-92% / 73-87% with this spin (a spin of 100,000: 98-100%
  / 70-87% / 48-78%).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPIN_COUNT = 10_000


def default_waiting(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set the bounded spin unless either variable is already set."""
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["OMP_WAIT_POLICY"] = "ACTIVE"
        environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
