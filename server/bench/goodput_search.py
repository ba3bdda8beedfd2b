"""Goodput as DistServe defines it: the highest request rate at which at least a target share of
requests meet their objectives, found by a search over the rate.

From a starting rate the search doubles (while the target holds) or halves (while it does not)
until one rate meets the target and one above it does not, then bisects that bracket on a
geometric midpoint until its upper end is within ``tolerance`` of its lower end. Each rate is
measured ``repeats`` times and judged on the mean attainment. The answer is the bracket's lower
end (the highest rate measured to meet the target), reported with the bracket.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

MAX_MEASURED_RATES = 24  # the search gives up (converged False) after this many rates


@dataclass(slots=True, frozen=True)
class SearchSettings:
    """The target attainment, runs per rate and the bracket's relative width at which to stop."""

    attainment: float = 0.9
    repeats: int = 2
    tolerance: float = 0.05

    def __post_init__(self) -> None:
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {self.attainment:g}")
        if self.repeats < 1:
            raise ValueError(f"--search-repeats must be >= 1, got {self.repeats}")
        if not 0 < self.tolerance < 1:
            raise ValueError(f"--search-tolerance must be in (0, 1), got {self.tolerance:g}")


@dataclass(slots=True)
class SearchResult:
    """The highest rate that met the target (None if none did), its bracket and every rate measured."""

    target: float
    rate: float | None = None
    bracket: tuple[float | None, float | None] = (None, None)  # (met, missed)
    converged: bool = False
    # {"rate", "attainments", "attainment"} in order
    points: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "attainment_target": self.target,
            "rate": self.rate,
            "bracket": list(self.bracket),
            "converged": self.converged,
            "points": self.points,
        }


async def search_goodput(
    measure: Callable[[float, int], Awaitable[float]],
    start: float,
    settings: SearchSettings | None = None,
    *,
    low: float | None = None,
    high: float | None = None,
) -> SearchResult:
    """Search with `await measure(rate, repeat)` -> attainment in [0, 1].

    low / high: a bracket already known (rates that met / missed the target); start: the first
    rate to try otherwise.
    """
    settings = settings or SearchSettings()
    target, repeats, tolerance = settings.attainment, settings.repeats, settings.tolerance
    if not (start > 0 and math.isfinite(start)):
        raise ValueError(
            f"the goodput search needs a finite starting rate > 0 (--rate), got {start:g}"
        )
    result = SearchResult(target)

    async def meets(rate: float) -> bool:
        attainments = [await measure(rate, k) for k in range(repeats)]
        mean = sum(attainments) / len(attainments)
        result.points.append({"rate": rate, "attainments": attainments, "attainment": mean})
        return mean >= target

    rate = start
    while len(result.points) < MAX_MEASURED_RATES:
        if low is not None and high is not None:
            if high / low - 1 <= tolerance:
                result.converged = True
                break
            rate = math.sqrt(low * high)
        elif low is not None:
            rate = low * 2
        elif high is not None:
            rate = high / 2
        if await meets(rate):
            low = rate
        else:
            high = rate
    result.rate, result.bracket = low, (low, high)
    return result


def format_search(found: SearchResult) -> str:
    """One line: the goodput found and its bracket."""
    low, high = found.bracket
    target = f"{100 * found.target:g}%"
    if found.rate is None:
        return (
            f"goodput ({target}): no rate measured met the target (lowest tried {high:.3g} req/s)"
        )
    upper = "not found" if high is None else f"{high:.3g}"
    note = "" if found.converged else f" (stopped after {len(found.points)} rates)"
    return (
        f"goodput ({target} attainment): {found.rate:.3g} req/s, bracket [{low:.3g}, {upper}] req/s, "
        f"{len(found.points)} rates measured{note}"
    )
