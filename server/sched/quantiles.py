"""Nearest-rank quantiles over recent samples (step times, prediction errors, lateness)."""

from __future__ import annotations

import math


def nearest_rank(ordered: list[float], q: float) -> float:
    """The q-quantile (0 < q <= 1) of an ascending, non-empty list by the nearest-rank method."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
