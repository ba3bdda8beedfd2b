"""Executor test fixtures: a ModelRunner factory over the session's tiny checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig

# What `auto` must resolve to on a CPU (pinned, so a silent change of the default fails a test).
CPU_AUTO_BACKEND = "sdpa"
# Every backend a CPU runs, `auto` included: the transformers-equality tests cover each.
CPU_BACKENDS = ("auto", "sdpa", "reference")


def runner_config(
    folder: Path,
    *,
    block_size: int | None = 4,
    backend: str = "auto",
    kv_pool_bytes: int = 2 * 2**20,
    max_batch: int = 8,
    max_batched_tokens: int = 256,
    swap_bytes: int = 2**20,
    device: str = "cpu",
    expert_slots_per_layer: int | None = None,
    kv_cache_dtype: str = "auto",
    **model_kw,
) -> SloserveConfig:
    """A small runner config; backend 'auto' by default, so tests run what users get."""
    return SloserveConfig(
        model=ModelConfig(path=str(folder), device=device, attention_backend=backend, **model_kw),
        cache=CacheConfig(
            block_size=block_size,
            kv_pool_bytes=kv_pool_bytes,
            swap_bytes=swap_bytes,
            expert_slots_per_layer=expert_slots_per_layer,
            kv_cache_dtype=kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(max_batch=max_batch, max_batched_tokens=max_batched_tokens),
    )


@pytest.fixture(scope="session")
def make_runner() -> Callable:
    """make_runner(folder, **runner_config kwargs) -> ModelRunner."""
    from sloserve.executor import ModelRunner

    def make(folder: Path, **kw):
        return ModelRunner(runner_config(folder, **kw))

    return make
