"""Fixtures that run every hot-path test against the compiled modules and the Python twins."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

MODULES = {
    "cython": ("_queue", "_blocks", "_experts", "_bench"),
    "python": ("_queue_py", "_blocks_py", "_experts_py", "_bench_py"),
}


def load_impl(name: str) -> SimpleNamespace:
    """The public classes and bench churns of one implementation, imported directly."""
    queue, blocks, experts, bench = (
        importlib.import_module(f"sloserve.hotpath.{m}") for m in MODULES[name]
    )
    return SimpleNamespace(
        name=name,
        RequestQueue=queue.RequestQueue,
        target_batch_size=queue.target_batch_size,
        bench_queue=bench._bench_queue,
        BlockAllocator=blocks.BlockAllocator,
        bench_blocks=bench._bench_blocks,
        ExpertAllocator=experts.ExpertAllocator,
    )


@pytest.fixture(params=sorted(MODULES), ids=sorted(MODULES))
def impl(request: pytest.FixtureRequest) -> SimpleNamespace:
    """Each implementation in turn (ids `cython` / `python`); a missing build fails, never skips."""
    return load_impl(request.param)
