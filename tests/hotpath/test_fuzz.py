"""Hostile calls on every public method of every hot-path class, in a subprocess: never a crash.

`fuzz_driver.py` runs hypothesis programs (huge and negative integers, wrong types, NaN,
numbers whose `__index__` changes its answer, raises, mutates its list, calls back into the
object or re-initialises it, instances whose `__init__` never ran, two threads on one object)
against the implementation the environment selects. It must exit 0: a segfault or an abort is
a negative return code, reported with the program that was running. 500 examples per test in
CI (a few seconds per implementation), 5,000 with SLOSERVE_FULL=1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hotpath.test_hardening import child_env, describe

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("fuzz_driver.py")
FULL = os.environ.get("SLOSERVE_FULL") == "1"
EXAMPLES = 5000 if FULL else 500


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["cython", "python"])
def test_hostile_calls_never_crash(impl, tmp_path):
    trace = tmp_path / "last_program.txt"
    proc = subprocess.run(
        [sys.executable, str(DRIVER), "--examples", str(EXAMPLES), "--trace", str(trace)],
        cwd=ROOT,
        env=child_env(impl),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    last = trace.read_text() if trace.exists() else "(none)"
    assert proc.returncode == 0, f"{describe(proc)}\n--- last program ---\n{last[:4000]}"
    assert proc.stdout.startswith(f"{impl}: 7 hostile-call tests passed"), proc.stdout
