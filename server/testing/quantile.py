"""One quantile for every latency figure the tests and benchmarks print or bound."""

from __future__ import annotations

import statistics


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; NaN for an empty list."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[
        max(0, min(998, round(q * 1000) - 1))
    ]
