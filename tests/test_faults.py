"""The fault-injection switch: parsed and validated once, off by default, matching by id marker."""

from __future__ import annotations

from dataclasses import fields

import pytest
from sloserve.config import SloserveConfig
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput, StepResult
from sloserve.testing.faults import FaultPlan, FaultyRunner, InjectedFault


def test_off_by_default():
    assert "faults" not in {f.name for f in fields(SloserveConfig)}  # the product has no switch
    assert not FaultPlan.parse(None) and not FaultPlan.parse(" , ")


def test_rules_match_requests_whose_id_contains_the_marker():
    plan = FaultPlan.parse("fail-forward:poison, slow-step:hold=0.25,slow-step:crawl=1")
    with pytest.raises(
        InjectedFault, match="injected fail-forward fault for request 'abc:poison-1'"
    ):
        plan.check("fail-forward", ["abc:ok", "abc:poison-1"])
    plan.check("fail-forward", ["abc:ok"])
    plan.check("kill-loop", ["abc:poison-1"])  # no kill-loop rule
    assert plan.delay_s(["x:hold-1", "x:crawl"]) == 1.0 and plan.delay_s(["x:ok"]) == 0.0


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("explode:x", "KIND one of"),
        ("fail-forward", "KIND one of"),
        ("fail-forward:", "must not be empty"),
        ("slow-step:x", "needs =SECONDS"),
        ("slow-step:x=-1", "needs =SECONDS"),
        ("slow-step:x=nan", "needs =SECONDS"),
        ("slow-step:x=1e9", "needs =SECONDS"),
        ("kill-loop:x=2", "only slow-step"),
    ],
)
def test_bad_specs_say_what_to_fix(spec, needle):
    with pytest.raises(ValueError, match=needle):
        FaultPlan.parse(spec)


class _Runner:
    block_size = 4

    def __init__(self) -> None:
        self.calls = 0

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.calls += 1
        return StepResult([[7] for _ in out.sequences])


def _out(*ids: str) -> SchedulerOutput:
    return SchedulerOutput([ScheduledSequence(i, [1], 0, [1], True, SamplingParams()) for i in ids])


def test_faulty_runner_fails_only_steps_with_a_marked_request_and_passes_the_rest_through():
    inner = _Runner()
    runner = FaultyRunner(inner, FaultPlan.parse("fail-forward:bad"))
    assert runner.execute(_out("a", "b")).tokens == [[7], [7]] and runner.block_size == 4
    with pytest.raises(InjectedFault):
        runner.execute(_out("a", "s:bad"))
    assert inner.calls == 1
