"""The engine's work counters: model steps, the runner's seconds on them, and prompt tokens computed.

They say what a scheduling policy costs: one that composes many small steps pays each step's
fixed cost more often, and one that preempts recomputes prompts (benchmarks/goodput.py reads them
per arm). They travel from EngineCore through the wire and Info to Prometheus.
"""

from __future__ import annotations

import pytest
from sloserve.config import CacheConfig, SchedulerConfig, SloserveConfig
from sloserve.engine import wire
from sloserve.engine.core import EngineCore
from sloserve.engine.outputs import EngineStats
from sloserve.frontend.metrics import Metrics
from sloserve.grpc.convert import stats_pb
from sloserve.new_request import NewRequest
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import SchedulerOutput

from tests.engine.fakes import FakeRunner

SHARED = [97 + k % 26 for k in range(16)]  # four whole blocks of 4 tokens


def _core(steps: int) -> EngineCore:
    config = SloserveConfig(
        cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(
            admission_control=False, num_scheduler_steps=steps, prefill_chunk=8
        ),
    )
    runner = FakeRunner(num_blocks=64, block_size=4)
    runner.runs_steps = True
    return EngineCore(config, runner)


@pytest.mark.parametrize("steps", [1, 4])
def test_the_counters_add_up_every_step_and_count_only_computed_prompt_tokens(steps):
    core = _core(steps)
    assert (core.stats().steps_total, core.stats().busy_seconds_total) == (
        0,
        0.0,
    )  # warm-up is not counted
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    core.add(NewRequest("a", SHARED + [1, 2, 3], params))
    counted, seconds = 0, 0.0
    while core.has_work():
        out = core.schedule()
        result, took = core.execute(out)
        core.update(out, result, took)
        if out.sequences:  # a call that only tells the runner of finished requests is no step
            counted += out.num_steps
            seconds += took
        if counted == 1:  # after a's prompt: b's first four blocks are a's, prefix-cache hits
            core.add(NewRequest("b", SHARED + [4, 5], params))
    stats = core.stats()
    assert stats.steps_total == counted and stats.busy_seconds_total == pytest.approx(seconds)
    assert stats.prefix_hit_tokens_total == len(SHARED)
    assert (
        stats.computed_prompt_tokens_total
        == stats.prompt_tokens_total - len(SHARED)
        == 19 + 18 - 16
    )
    if steps > 1:
        assert counted > core.scheduler.step_count  # runs of decode steps count every step they ran


def test_a_preempted_prompt_is_computed_again():
    config = SloserveConfig(
        cache=CacheConfig(block_size=4, prefix_cache=False),
        scheduler=SchedulerConfig(admission_control=False, preemption_mode="recompute"),
    )
    core = EngineCore(config, FakeRunner(num_blocks=64, block_size=4))
    core.add(NewRequest("a", [97, 98, 99, 100, 101], SamplingParams(max_tokens=4, ignore_eos=True)))
    core.step()  # the prompt and the first token
    # K/V dropped: recompute
    core.scheduler.preemption.preempt(core.scheduler.requests["a"], SchedulerOutput())
    while core.has_work():
        core.step()
    assert core.stats().computed_prompt_tokens_total == 2 * 5


def test_the_counters_cross_the_wire_and_reach_info_and_prometheus():
    stats = EngineStats(steps_total=12, busy_seconds_total=0.375, computed_prompt_tokens_total=640)
    assert wire.decode_from_engine(wire.encode(wire.StepOutputs([], stats))).stats == stats
    msg = stats_pb(stats)
    assert (msg.steps_total, msg.busy_seconds_total, msg.computed_prompt_tokens_total) == (
        12,
        0.375,
        640,
    )
    registry = Metrics(lambda: stats, model_name="m").registry

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m"})

    assert value("sloserve_engine_steps_total") == 12
    assert value("sloserve_engine_busy_seconds_total") == 0.375
    assert value("sloserve_computed_prompt_tokens_total") == 640
