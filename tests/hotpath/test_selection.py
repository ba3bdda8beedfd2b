"""The compiled extension is what `sloserve.hotpath` ships; SLOSERVE_NO_EXTENSIONS=1 selects the twins."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys

import pytest
import sloserve.hotpath as hotpath

PROBE = (
    "import json, sloserve.hotpath as h; "
    "print(json.dumps([h.USING_EXTENSIONS, h.IMPLEMENTATION, "
    "[c.__module__ for c in (h.RequestQueue, h.BlockAllocator, h.ExpertAllocator, "
    "h.target_batch_size)]]))"
)


def run_probe(env_value: str | None) -> list:
    env = {k: v for k, v in os.environ.items() if k != "SLOSERVE_NO_EXTENSIONS"}
    if env_value is not None:
        env["SLOSERVE_NO_EXTENSIONS"] = env_value
    out = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_compiled_extension_is_imported_by_default():
    if os.environ.get("SLOSERVE_NO_EXTENSIONS", "") not in ("", "0"):
        pytest.skip("this process forces the twins; the subprocess tests still check the default")
    assert hotpath.USING_EXTENSIONS is True and hotpath.IMPLEMENTATION == "cython"
    for cls in (hotpath.RequestQueue, hotpath.BlockAllocator, hotpath.ExpertAllocator):
        module = sys.modules[cls.__module__]
        assert module.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), module
        assert not module.__name__.endswith("_py")


def test_default_subprocess_gets_the_extension_without_warnings():
    using, name, modules = run_probe(None)
    assert (using, name) == (True, "cython")
    assert modules == [
        "sloserve.hotpath._queue",
        "sloserve.hotpath._blocks",
        "sloserve.hotpath._experts",
        "sloserve.hotpath._queue",
    ]


def test_env_switch_selects_the_twins():
    using, name, modules = run_probe("1")
    assert (using, name) == (False, "python")
    assert modules == [
        "sloserve.hotpath._queue_py",
        "sloserve.hotpath._blocks_py",
        "sloserve.hotpath._experts_py",
        "sloserve.hotpath._queue_py",
    ]
    assert run_probe("0")[0] is True


def test_the_shipped_modules_carry_no_benchmark_loops():
    """The churns live in `_bench` and its twin `_bench_py` only (benchmarks/hotpath.py, the GIL tests)."""
    from sloserve.hotpath import _bench, _bench_py, _blocks, _blocks_py, _queue, _queue_py

    for module in (_queue, _queue_py, _blocks, _blocks_py):
        assert not [name for name in vars(module) if "bench" in name.lower()], module
    for module in (_bench, _bench_py):
        assert callable(module._bench_queue) and callable(module._bench_blocks), module
