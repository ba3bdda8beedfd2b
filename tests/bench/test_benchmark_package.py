"""benchmarks/ is a package: every module imports as benchmarks.NAME, a script runs as
`python -m benchmarks.NAME` from the repository root, and no usage line runs it by its file path."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(
    p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("__init__", "_launch")
)


@pytest.mark.parametrize("name", MODULES)
def test_each_module_imports_from_the_package_and_documents_the_module_form(name):
    module = importlib.import_module(f"benchmarks.{name}")
    doc = module.__doc__ or ""
    assert (
        f"python benchmarks/{name}.py" not in doc and f"python3 benchmarks/{name}.py" not in doc
    ), doc


def test_a_script_runs_as_a_module_from_the_repository_root():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.idle_spin", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_a_launched_server_reports_its_info_and_peak_memory():
    """harness.launch: the typed-config server (python -m benchmarks._launch), ready, measured, stopped."""
    from benchmarks import harness

    with harness.launch("full", overrides={"server": {"idle_spin_s": 0.0}}) as server:
        info = server.wait_ready(300)
        assert info["model"] == "default" and info["device"] == "cpu"
        assert server.peak_rss_bytes() > 0
    assert server.proc.returncode == 0, "\n".join(server.raw[-20:])
