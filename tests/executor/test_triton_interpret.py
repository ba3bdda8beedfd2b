"""The Triton kernels on a CPU, through Triton's interpreter (TRITON_INTERPRET=1), against the oracles.

The interpreter must be switched on before triton is first imported, so each check runs in a fresh
interpreter (`python -m tests.executor.triton_interpret CHECK`). Skipped where triton is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


def interpret(*args: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.executor.triton_interpret", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_paged_attention_matches_the_reference_for_every_split_count():
    """forward (decode and mixed batches) and the capturable decode, split 1, 3, 8 ways and automatically."""
    for case, error in interpret("attention").items():
        assert error < 1e-5, case


def test_fused_kernels_compute_the_unfused_formulas():
    """add + RMSNorm, rotary + KV write, SwiGLU against torch's ops, errors relative to the largest value.

    float32: the elementwise kernels give the same bits, the norms differ in summation order only.
    bfloat16: within two of its rounding steps (the interpreter rounds float32 to bfloat16 its own way).
    """
    out = interpret("fused")
    for case, error in out.items():
        if case.startswith("rope.elsewhere") or case.startswith("rms_norm.passes_x"):
            # nothing written outside the step's slots; no add: x itself is returned
            assert error == 0, case
        elif case.endswith("float32") and (
            case.startswith("rope") or case.startswith("add_rms_norm.sum")
        ):
            assert error == 0, case
        else:
            assert error < (1e-6 if case.endswith("float32") else 2**-6), (case, error)


@pytest.mark.parametrize("kernels", ["unfused", "fused"])
def test_graph_decode_with_triton_kernels_equals_transformers(tiny_llama, kernels):
    """The GPU's captured decode forward (Triton attention; with the fused kernels or without) on a CPU."""
    out = interpret("model", str(tiny_llama), *(["fused"] if kernels == "fused" else []))
    assert out["sloserve"] == out["transformers"]
