"""The scheduler switches reach SchedulerConfig from the command line."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner
from sloserve.cli.options import build_config, engine_options


def _invoke(*args: str):
    seen = {}

    @click.command()
    @engine_options
    def command(**kwargs) -> None:
        seen["config"] = build_config(kwargs)

    return CliRunner().invoke(command, list(args), catch_exceptions=False), seen


def _config(*args: str):
    result, seen = _invoke(*args)
    assert result.exit_code == 0, result.output
    return seen["config"].scheduler


def test_the_defaults_are_the_slo_policy_with_every_mechanism_but_the_adaptive_batch():
    sc = _config()
    assert (
        sc.policy,
        sc.deadline_steps,
        sc.slack_preemption,
        sc.admission_control,
        sc.max_wait_s,
        sc.adaptive_batch,
        sc.finish_margin,
    ) == ("slo", True, True, True, 2.0, False, 0.05)


def test_each_switch_turns_its_mechanism_off():
    sc = _config(
        "--policy",
        "priority",
        "--no-deadline-steps",
        "--no-slack-preemption",
        "--no-admission-control",
        "--max-wait",
        "1.5",
        "--finish-margin",
        "0",
    )
    assert (
        sc.policy,
        sc.deadline_steps,
        sc.slack_preemption,
        sc.admission_control,
        sc.max_wait_s,
        sc.finish_margin,
    ) == ("priority", False, False, False, 1.5, 0.0)


@pytest.mark.parametrize("value", ["1", "-0.1"])
def test_a_finish_margin_outside_0_to_1_names_its_flag(value):
    result, _ = _invoke("--finish-margin", value)
    assert result.exit_code != 0
    assert "--finish-margin: finish margin must be in [0, 1)" in result.output
