"""Quantized-checkpoint fixtures: the executor tests' runner factory, and the session's folders."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.executor.conftest import make_runner  # noqa: F401  (the executor tests' fixture)


@pytest.fixture(scope="session")
def root(checkpoint_root: Path) -> Path:
    """Where quantized folders are built, beside the tiny checkpoints they quantize."""
    return checkpoint_root
