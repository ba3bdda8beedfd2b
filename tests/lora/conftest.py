"""LoRA test fixtures: PEFT adapters of the session's tiny checkpoints, built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.lora.adapters import ALL_MODULES, make_adapter


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every test adapter is saved under (the --lora-dir of the HTTP tests)."""
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="session")
def make_lora(adapter_root: Path, make_checkpoint) -> Callable[..., Path]:
    """make_lora(arch, rank=, seed=, targets=, rslora=, saved=, **base overrides) -> the adapter's
    folder (cached)."""

    def make(
        arch: str,
        *,
        rank: int = 8,
        seed: int = 0,
        targets: tuple[str, ...] = ALL_MODULES,
        rslora: bool = False,
        saved: tuple[str, ...] = (),
        **base_overrides,
    ) -> Path:
        tag = "-".join(t.removesuffix("_proj") for t in (*targets, *saved))
        flags = ("-rs" if rslora else "") + "".join(f"-{k}{v}" for k, v in base_overrides.items())
        name = f"{arch}-r{rank}-s{seed}-{tag}{flags}"
        base = make_checkpoint(arch, **base_overrides)
        return make_adapter(
            base,
            adapter_root / name,
            rank=rank,
            seed=seed,
            targets=targets,
            rslora=rslora,
            saved=saved,
        )

    return make
