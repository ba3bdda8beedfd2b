"""Fault injection for reliability tests: off by default, one documented switch, no monkeypatching.

A fault plan is a comma-separated list of rules ``KIND:MARKER[=SECONDS]``; a rule applies to
every request whose id contains MARKER (request ids reach the engine as
``<stream prefix>:<client id>``, so a client id containing the marker is enough):

  fail-forward:M      the forward pass raises while such a request is in the batch
                      (the engine retries sequences alone, so only that request fails)
  fail-postprocess:M  post-processing of such a request's sampled token raises
  kill-loop:M         the engine loop itself dies while such a request is live
  slow-step:M=S       every step with such a request in the batch takes S seconds longer
                      (holds a request past a grace period on any machine, by construction)

The product knows nothing of faults: `WithFaults(plan)` is a core factory (`make_core=` of
`serve.run`, `AsyncEngine`, `run_engine`) that wraps the core and its runner. A spawned server
gets one from the test-only entry point ``python -m sloserve.testing.serve_faults serve
--inject-faults SPEC ...`` (or ``SLOSERVE_INJECT_FAULTS``), which refuses unless
``SLOSERVE_ALLOW_FAULT_INJECTION=1`` (which only tests set), since any client can name a marker
in its request id. Never run it in production.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sloserve.config import SloserveConfig
from sloserve.engine.core import EngineCore, load_runner
from sloserve.engine.output_processor import OutputProcessor, RequestText
from sloserve.engine.runner import Runner
from sloserve.sched.output import SchedulerOutput, StepResult
from sloserve.sched.request import Request
from sloserve.sched.scheduler import Scheduler

log = logging.getLogger(__name__)

KINDS = ("fail-forward", "fail-postprocess", "kill-loop", "slow-step")


class InjectedFault(RuntimeError):
    """Raised where a fault rule says so."""


@dataclass(frozen=True, slots=True)
class FaultRule:
    kind: str
    marker: str
    seconds: float = 0.0

    def applies(self, request_id: str) -> bool:
        return self.marker in request_id


@dataclass(frozen=True, slots=True)
class FaultPlan:
    rules: tuple[FaultRule, ...] = ()

    @classmethod
    def parse(cls, spec: str | None) -> FaultPlan:
        """'fail-forward:poison,slow-step:slow=0.05' -> FaultPlan; ValueError says what to fix."""
        rules = []
        for item in (spec or "").split(","):
            item = item.strip()
            if not item:
                continue
            kind, sep, rest = item.partition(":")
            if not sep or kind not in KINDS:
                raise ValueError(
                    f"fault rule {item!r}: use KIND:MARKER with KIND one of {', '.join(KINDS)}"
                )
            marker, eq, value = rest.partition("=")
            if not marker:
                raise ValueError(
                    f"fault rule {item!r}: the marker (part of a request id) must not be empty"
                )
            seconds = 0.0
            if kind == "slow-step":
                try:
                    seconds = float(value) if eq else math.nan
                except ValueError:
                    seconds = math.nan
                if not (math.isfinite(seconds) and 0 < seconds <= 60):
                    raise ValueError(f"fault rule {item!r}: slow-step needs =SECONDS in (0, 60]")
            elif eq:
                raise ValueError(f"fault rule {item!r}: only slow-step takes =SECONDS")
            rules.append(FaultRule(kind, marker, seconds))
        return cls(tuple(rules))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def _first(self, kind: str, request_ids: Iterable[str]) -> tuple[FaultRule, str] | None:
        for rule in self.rules:
            if rule.kind == kind:
                for rid in request_ids:
                    if rule.applies(rid):
                        return rule, rid
        return None

    def check(self, kind: str, request_ids: Iterable[str]) -> None:
        """Raise InjectedFault when a `kind` rule applies to one of `request_ids`."""
        hit = self._first(kind, request_ids)
        if hit is not None:
            raise InjectedFault(f"injected {kind} fault for request {hit[1]!r}")

    def delay_s(self, request_ids: Sequence[str]) -> float:
        """Extra seconds a step over `request_ids` takes (the longest matching slow-step rule)."""
        return max(
            (
                r.seconds
                for r in self.rules
                if r.kind == "slow-step"
                for rid in request_ids
                if r.applies(rid)
            ),
            default=0.0,
        )


class FaultyRunner:
    """Wraps a runner: injected forward failures and slow steps; everything else passes through."""

    def __init__(self, runner, plan: FaultPlan) -> None:
        self._runner = runner
        self._plan = plan

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def execute(self, out: SchedulerOutput) -> StepResult:
        ids = [seq.req_id for seq in out.sequences]
        self._plan.check("fail-forward", ids)
        delay = self._plan.delay_s(ids)
        if delay:
            time.sleep(delay)
        return self._runner.execute(out)


class FaultyOutput(OutputProcessor):
    """The output stage, failing a fail-postprocess request before its next new token."""

    def __init__(self, decode, plan: FaultPlan) -> None:
        super().__init__(decode)
        self._plan = plan

    def _add_text(self, req: Request, state: RequestText, scheduler: Scheduler) -> None:
        if state.tokens < len(req.output_token_ids):
            self._plan.check("fail-postprocess", (req.request_id,))
        super()._add_text(req, state, scheduler)


class FaultyCore(EngineCore):
    """EngineCore over a FaultyRunner and a FaultyOutput; its loop dies on a kill-loop request."""

    def __init__(self, plan: FaultPlan, config: SloserveConfig, runner: Runner, **kw) -> None:
        super().__init__(config, FaultyRunner(runner, plan), **kw)
        self.output = FaultyOutput(runner.tokenizer.decode, plan)
        self._plan = plan

    def schedule(self) -> SchedulerOutput:
        self._plan.check("kill-loop", self.scheduler.requests)
        return super().schedule()


@dataclass(frozen=True, slots=True)
class WithFaults:
    """A core factory (picklable, for the engine process): EngineCore with `spec`'s faults injected."""

    spec: str

    def __call__(self, config: SloserveConfig, runner: Runner | None = None, **kw) -> EngineCore:
        plan = FaultPlan.parse(self.spec)
        log.warning("fault injection is ON (%s): for tests only", self.spec)
        return FaultyCore(plan, config, runner if runner is not None else load_runner(config), **kw)
