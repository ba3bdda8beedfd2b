"""What a bench run sends, from its flags: the workload's requests (a trace fitted to the server's
context), capped lengths, objectives from rules, and the same requests at any rate."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sloserve.bench.slo_rules import SloRule, apply_rules
from sloserve.bench.trace import load_trace, rescale
from sloserve.bench.workloads import WorkloadItem, load_workload


@dataclass(slots=True, frozen=True)
class WorkloadPlan:
    """A workload spec and how to shape it; `items` builds the requests once the server is known."""

    workload: str
    seed: int = 0
    attempts: int = 2
    num_requests: int | None = None  # None: each request of the workload once
    max_tokens: int | None = None
    length_scale: float = 1.0  # trace lengths
    time_scale: float | None = None  # trace arrivals at a rate of inf
    rules: tuple[SloRule, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if not self.is_trace and self.length_scale != 1.0:
            raise ValueError("--length-scale applies to a trace: workload only")
        if not self.is_trace and self.time_scale is not None:
            raise ValueError("--time-scale applies to a trace: workload only")
        if self.time_scale is not None and not (
            self.time_scale > 0 and math.isfinite(self.time_scale)
        ):
            raise ValueError(f"--time-scale must be a number > 0, got {self.time_scale:g}")

    @property
    def is_trace(self) -> bool:
        return self.workload.startswith("trace:")

    def items(self, max_model_len: int | None = None) -> list[WorkloadItem]:
        """The requests (a trace's with its recorded arrival times, fitted to max_model_len)."""
        if self.is_trace:
            items = load_trace(
                self.workload.partition(":")[2],
                seed=self.seed,
                num_requests=self.num_requests,
                length_scale=self.length_scale,
                max_model_len=max_model_len,
                rules=self.rules,
            )
        else:
            items = apply_rules(
                list(self.rules),
                load_workload(
                    self.workload,
                    seed=self.seed,
                    attempts=self.attempts,
                    num_requests=self.num_requests,
                ),
            )
        if self.max_tokens is not None:
            items = [replace(i, max_tokens=min(i.max_tokens, self.max_tokens)) for i in items]
        return items

    def at_rate(self, items: list[WorkloadItem], rate: float) -> list[WorkloadItem]:
        """The items as sent at `rate`: a trace rescaled to that mean rate (its shape kept), or at
        time_scale when the rate is inf; other workloads unchanged (the driver's Poisson process)."""
        if not self.is_trace:
            return items
        return (
            rescale(items, rate=rate)
            if math.isfinite(rate)
            else rescale(items, time_scale=self.time_scale)
        )


def unpaced(items: list[WorkloadItem]) -> list[WorkloadItem]:
    """The items without arrival times (a closed loop sends them as slots free up)."""
    return [replace(i, arrival_s=None) for i in items]
