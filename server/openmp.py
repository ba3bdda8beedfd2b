"""How torch's OpenMP workers wait between parallel regions: a bounded spin, then sleep.

OpenMP reads its environment once, when torch loads it, so `default_waiting` must run before
torch is imported: the `sloserve` command calls it first thing, and so does the benchmark harness
for the servers it starts (their figures are of what the command runs). An explicit
OMP_WAIT_POLICY or GOMP_SPINCOUNT (libgomp, torch's OpenMP on Linux) wins.

Why a short bounded spin (GOMP_SPINCOUNT busy-wait iterations): libgomp's default spin keeps
idle workers on the cores the engine, gRPC and asyncio threads need (a flood completes far fewer
requests), while sleeping at once (PASSIVE) makes every parallel region of a step pay a wake-up
(mixed steps take much longer, and the slo policy meets fewer interactive objectives).
Measurements: docs/design/cpu-decode.md.
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
