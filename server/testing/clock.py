"""A manual clock for code that takes a `clock` callable in place of time.monotonic."""

from __future__ import annotations


class Clock:
    """A manual time.monotonic(): it reads `t`, which a test moves forward."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
