"""Attention backends behind one interface; `get_backend` picks one by name or by capability.

Backend modules are imported lazily (flash-attn and Triton are optional). Each
entry of ``_REGISTRY`` names a module under this package and a class following the
AttentionBackend protocol (see base.py): a no-argument constructor and a static
``unavailable_reason(device, dtype, block_size, head_dim)``.
"""

from __future__ import annotations

import importlib
import logging

import torch
from sloserve.layers.attention.base import AttentionBackend, BackendUnavailableError, write_kv
from sloserve.layers.attention.metadata import AttentionMetadata, build_arrays
from sloserve.layers.attention.reference import ReferenceBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BackendUnavailableError",
    "ReferenceBackend",
    "available_backends",
    "build_arrays",
    "get_backend",
    "write_kv",
]

log = logging.getLogger(__name__)

# name -> (module under sloserve.layers.attention, class name)
_REGISTRY: dict[str, tuple[str, str]] = {
    "reference": ("reference", "ReferenceBackend"),
    "sdpa": ("sdpa", "SdpaBackend"),
    "flash": ("flash", "FlashBackend"),
    "triton": ("triton_decode", "TritonDecodeBackend"),
}
# Tried in order by name='auto'; the first that can run wins. On CPU sdpa beats reference on mixed
# prefill/decode steps and matches it on decode-only ones (benchmarks/attention_mixed.py).
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash", "triton", "sdpa", "reference"),
    "cpu": ("sdpa", "reference"),
}


def _construct(
    name: str, device: torch.device, dtype: torch.dtype | None, block_size: int | None, head_dim: int | None
) -> AttentionBackend:
    module_name, class_name = _REGISTRY[name]
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
        cls = getattr(module, class_name)
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(f"attention backend {name!r} is not installed: {exc}") from exc
    check = getattr(cls, "unavailable_reason", None)
    reason = check(device, dtype, block_size, head_dim) if check is not None else None
    if reason:
        raise BackendUnavailableError(f"attention backend {name!r} cannot run: {reason}")
    try:
        return cls()
    except (ImportError, RuntimeError) as exc:
        raise BackendUnavailableError(f"attention backend {name!r} cannot run: {exc}") from exc


def get_backend(
    name: str,
    device: torch.device | str,
    *,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> AttentionBackend:
    """The backend called `name` for these settings, or the best one that can run for name='auto'."""
    device = torch.device(device)
    if name == "auto":
        reasons = []
        for candidate in AUTO_ORDER.get(device.type, ("reference",)):
            try:
                backend = _construct(candidate, device, dtype, block_size, head_dim)
            except BackendUnavailableError as exc:
                reasons.append(str(exc))
                continue
            log.info("attention backend: %s on %s", backend.name, device)
            return backend
        raise BackendUnavailableError(f"no attention backend can run on {device}: {'; '.join(reasons)}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose one of: auto, {', '.join(_REGISTRY)}")
    return _construct(name, device, dtype, block_size, head_dim)


def available_backends(
    device: torch.device | str, *, dtype: torch.dtype | None = None, block_size: int | None = None,
    head_dim: int | None = None,
) -> list[str]:
    """Names of the backends that can run with these settings (imports each optional module)."""
    names = []
    for name in _REGISTRY:
        try:
            _construct(name, torch.device(device), dtype, block_size, head_dim)
        except BackendUnavailableError:
            continue
        names.append(name)
    return names
