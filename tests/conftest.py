"""Session-wide fixtures shared by every test area: tiny checkpoints built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.checkpoints import tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def make_checkpoint(checkpoint_root: Path) -> Callable[..., Path]:
    """make_checkpoint(arch, **config_overrides) -> folder (cached for the session)."""

    def make(arch: str, **overrides) -> Path:
        return tiny_checkpoint(arch, checkpoint_root, **overrides)

    return make


@pytest.fixture(scope="session")
def tiny_llama(make_checkpoint) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(make_checkpoint) -> Path:
    return make_checkpoint("qwen2")


@pytest.fixture(scope="session")
def tiny_mixtral(make_checkpoint) -> Path:
    return make_checkpoint("mixtral")


@pytest.fixture(scope="session")
def tiny_qwen2_moe(make_checkpoint) -> Path:
    return make_checkpoint("qwen2_moe")
