"""benchmarks/served_overhead.py: its arms, the sitecustomize that sets an arm's module attributes
in a child process, thread roles and the medians; no server is started."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from benchmarks import served_overhead as so


def test_an_arm_splits_serve_flags_from_module_attributes():
    arm = so.parse_arm("fused=@sloserve.executor.fused.BF16_DECODE=True --max-batch 8")
    assert arm.name == "fused"
    assert arm.flags == ["--max-batch", "8"]
    assert arm.attrs == {"sloserve.executor.fused.BF16_DECODE": True}
    assert so.parse_arm("plain=") == so.Arm("plain", [], {})


@pytest.mark.parametrize("text", ["noequals", "=--flag", "x=@noattr=1", "x=@mod.attr"])
def test_a_malformed_arm_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        so.parse_arm(text)


def test_the_sitecustomize_sets_the_attribute_in_a_new_python_process(tmp_path):
    env = so._sitecustomize({"json.decoder.SLOSERVE_PROBE": [1, "a"]}, tmp_path / "site")
    assert so._sitecustomize({}, tmp_path / "none") == {}
    out = subprocess.run(
        [sys.executable, "-c", "import json.decoder as d; print(d.SLOSERVE_PROBE)"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[1, 'a']"


def test_threads_are_told_apart_by_process_and_name():
    assert so.role(10, 10, "sloserve", frontend=10, engine=20) == "frontend_loop"
    assert so.role(10, 11, "event_engine", frontend=10, engine=20) == "frontend_other"
    assert so.role(20, 20, "python", frontend=10, engine=20) == "engine_main"
    assert so.role(20, 22, "python", frontend=10, engine=20) == "engine_team"
    assert so.role(20, 23, "ZMQbg/IO/0", frontend=10, engine=20) == "engine_io"
    assert so.role(30, 30, "python", frontend=10, engine=20) is None  # the resource tracker


def test_this_process_threads_are_read_from_proc():
    cpu = so.thread_cpu([os.getpid()])
    assert (os.getpid(), os.getpid()) in cpu
    assert all(seconds >= 0 for _, seconds in cpu.values())


def _run(arm, c, tok_s, cpu_main):
    return {
        "arm": arm,
        "concurrency": c,
        "output_tok_s": tok_s,
        "tpot_p50_s": 0.02,
        "ttft_p50_s": 0.1,
        "runner_ms_per_step": 20.0,
        "wall_ms_per_step": 21.0,
        "cpu_ms_per_token": dict.fromkeys(so.ROLES, 0.0) | {"engine_main": cpu_main},
        "load_avg": [1.0] * 6,
    }


def test_the_summary_takes_medians_per_arm_and_ratios_to_the_first():
    arms = [so.Arm("a", []), so.Arm("b", [])]
    runs = [_run("a", 1, 40.0, 1.0), _run("a", 1, 44.0, 3.0), _run("b", 1, 63.0, 2.0)]
    rows = so.summarize(runs, arms, [1, 4])
    assert [(r["arm"], r["rounds"]) for r in rows] == [("a", 2), ("b", 1)]
    assert rows[0]["output_tok_s"] == 42.0 and rows[0]["cpu_ms_per_token"]["engine_main"] == 2.0
    assert rows[1]["vs_first"]["output_tok_s"] == pytest.approx(1.5)
