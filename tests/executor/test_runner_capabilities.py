"""Every runner class declares each capability the engine relies on (a no-op where it has none)."""

from __future__ import annotations

import inspect

import pytest
from sloserve.executor.runner import ModelRunner
from sloserve.parallel.runner import TensorParallelRunner
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

# What the engine core and priming read from a runner (the Runner protocol's optional part).
CAPABILITIES = (
    "vocab_size",
    "runs_steps",
    "check_health",
    "close",
    "expert_stats",
    "time_steps",
)


@pytest.mark.parametrize("cls", [ModelRunner, TensorParallelRunner])
def test_each_capability_is_declared_on_the_class(cls):
    """Declared in the class itself, not reached through TensorParallelRunner's delegation."""
    missing = [name for name in CAPABILITIES if inspect.getattr_static(cls, name, None) is None]
    assert not missing, f"{cls.__name__} does not declare {missing}"
    assert cls.runs_steps is True


def test_a_dense_runner_answers_each_capability(make_runner, tiny_llama):
    runner = make_runner(tiny_llama)
    assert runner.vocab_size == runner.spec.vocab_size
    assert runner.check_health() is None and runner.expert_stats() == {}
    greedy = SamplingParams(max_tokens=1)
    result = runner.execute(SchedulerOutput([ScheduledSequence("a", [5], 0, [1], True, greedy)]))
    assert result.logprobs == {} and result.prompt_logprobs == {}
    assert runner.time_steps([(1, 1)], rounds=1)[0][:2] == (1, 1)


def test_a_moe_runner_reports_its_expert_counters(make_runner, tiny_mixtral):
    stats = make_runner(tiny_mixtral, expert_slots_per_layer=2).expert_stats()
    assert stats["expert_resident_per_layer"] and "expert_hit_rate" in stats
