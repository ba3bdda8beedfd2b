"""Attention backends behind one interface; `select_backend` picks one by name or by capability.

Backend modules are imported lazily (flash-attn and Triton are optional). Each
entry of ``_REGISTRY`` names a module under this package and a class following the
AttentionBackend protocol (see base.py): a no-argument constructor, a static
``unavailable_reason(device, dtype, block_size, head_dim)`` and, optionally, a
``preferred_block_size`` (the KV page size it runs with when the config sets none).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import torch
from sloserve.layers.attention.base import (
    AttentionBackend,
    BackendUnavailableError,
    CapturableDecode,
    write_kv,
)
from sloserve.layers.attention.metadata import AttentionMetadata, build_arrays
from sloserve.layers.attention.reference import ReferenceBackend

__all__ = [
    "AUTO_ORDER",
    "DEFAULT_BLOCK_SIZE",
    "AttentionBackend",
    "AttentionMetadata",
    "BackendChoice",
    "BackendUnavailableError",
    "CapturableDecode",
    "ReferenceBackend",
    "available_backends",
    "build_arrays",
    "get_backend",
    "select_backend",
    "write_kv",
]

log = logging.getLogger(__name__)

# tokens per KV page when neither the config nor the backend asks for another
DEFAULT_BLOCK_SIZE = 16

# name -> (module under sloserve.layers.attention, class name)
_REGISTRY: dict[str, tuple[str, str]] = {
    "reference": ("reference", "ReferenceBackend"),
    "sdpa": ("sdpa", "SdpaBackend"),
    "flash": ("flash", "FlashBackend"),
    "triton": ("triton_decode", "TritonDecodeBackend"),
}
# Tried in order by name='auto'; the first that can run wins. On CPU sdpa beats reference on mixed
# prefill/decode steps (benchmarks/attention_mixed.py), and its decode tokens run the in-place
# paged kernel (paged.py) wherever it can: 5x the gather path at batch 64 (benchmarks/executor.py).
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash", "triton", "sdpa", "reference"),
    "cpu": ("sdpa", "reference"),
}


@dataclass(slots=True, frozen=True)
class BackendChoice:
    """The backend that runs, the KV page size it runs with, and why (for the start-up log)."""

    backend: AttentionBackend
    block_size: int
    reason: str

    @property
    def name(self) -> str:
        return self.backend.name


def _load_class(name: str) -> type:
    module_name, class_name = _REGISTRY[name]
    try:
        return getattr(importlib.import_module(f"{__name__}.{module_name}"), class_name)
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(
            f"attention backend {name!r} is not installed: {exc}"
        ) from exc


def _construct(
    name: str,
    device: torch.device,
    dtype: torch.dtype | None,
    block_size: int | None,
    head_dim: int | None,
) -> AttentionBackend:
    cls = _load_class(name)
    check = getattr(cls, "unavailable_reason", None)
    reason = check(device, dtype, block_size, head_dim) if check is not None else None
    if reason:
        raise BackendUnavailableError(f"attention backend {name!r} cannot run: {reason}")
    try:
        return cls()
    except (ImportError, RuntimeError) as exc:
        raise BackendUnavailableError(f"attention backend {name!r} cannot run: {exc}") from exc


def _page_size(name: str, block_size: int | None) -> tuple[int, str]:
    """The block size `name` runs with, and where it comes from: the config, or the backend's preference."""
    if block_size is not None:
        return block_size, "set in the config"
    try:
        preferred = getattr(_load_class(name), "preferred_block_size", None)
    except BackendUnavailableError:
        preferred = None
    if preferred is None:
        return DEFAULT_BLOCK_SIZE, "the default"
    return preferred, f"as {name} needs"


def select_backend(
    name: str,
    device: torch.device | str,
    *,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> BackendChoice:
    """The backend called `name` (or, for 'auto', the first in AUTO_ORDER that can run) and its page size.

    block_size None lets the backend choose (flash-attn: 256, the others: DEFAULT_BLOCK_SIZE); a
    block size set in the config is kept, and 'auto' skips the backends it does not fit.
    """
    device = torch.device(device)
    if name != "auto":
        if name not in _REGISTRY:
            raise ValueError(
                f"unknown attention backend {name!r}; choose one of: auto, {', '.join(_REGISTRY)}"
            )
        size, source = _page_size(name, block_size)
        backend = _construct(name, device, dtype, size, head_dim)
        return BackendChoice(backend, size, f"named in the config; {size}-token KV pages, {source}")
    skipped: list[str] = []
    for candidate in AUTO_ORDER.get(device.type, ("reference",)):
        size, source = _page_size(candidate, block_size)
        try:
            backend = _construct(candidate, device, dtype, size, head_dim)
        except BackendUnavailableError as exc:
            skipped.append(str(exc).removeprefix("attention backend "))
            continue
        why = f"skipped {'; '.join(skipped)}" if skipped else "first choice"
        return BackendChoice(
            backend, size, f"auto on {device.type}, {why}; {size}-token KV pages, {source}"
        )
    raise BackendUnavailableError(f"no attention backend can run on {device}: {'; '.join(skipped)}")


def get_backend(
    name: str,
    device: torch.device | str,
    *,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> AttentionBackend:
    """The backend `select_backend` chooses for these settings (without its page size or reason)."""
    return select_backend(
        name, device, dtype=dtype, block_size=block_size, head_dim=head_dim
    ).backend


def available_backends(
    device: torch.device | str,
    *,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> list[str]:
    """Names of the backends that can run with these settings (imports each optional module)."""
    names = []
    for name in _REGISTRY:
        try:
            select_backend(name, device, dtype=dtype, block_size=block_size, head_dim=head_dim)
        except BackendUnavailableError:
            continue
        names.append(name)
    return names
