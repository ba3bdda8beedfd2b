"""`make demo` runs `python -m sloserve.cli.demo`; here on a tiny checkpoint with a small burst."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)


def test_demo_runs_end_to_end(tiny_llama):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sloserve.cli.demo",
            "--model",
            str(tiny_llama),
            "--requests",
            "4",
            "--workload",
            "fixed:8,4",
            "--max-tokens",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "server ready (health SERVING)" in out
    assert "cancel-me  cancelled" in out and len(re.findall(r"  (length|stop) ", out)) >= 3
    assert "mirror: test input -> model's answer" in out
    assert re.search(r"completed / sent +4/4", out), out
    assert re.search(r'sloserve_requests_total\{model_name="[^"]+",outcome="length"\}', out), out
    for rid in ("drain-1", "drain-2", "drain-3"):
        assert f"{rid}  finished, 6 tokens" in out
    assert "late     UNAVAILABLE: the server is shutting down" in out
    assert out.rstrip().endswith("server exited with status 0")
