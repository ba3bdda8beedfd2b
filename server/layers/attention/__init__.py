"""Attention backends behind one interface; `get_backend` picks one by name or by capability.

Backend modules are imported lazily (flash-attn, Triton and FlexAttention are optional). Each
module named in ``_REGISTRY`` defines the listed AttentionBackend subclass; its constructor takes
the device and raises BackendUnavailableError (or ImportError) when it cannot run there.
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
    "flex": ("flex", "FlexBackend"),
    "flash": ("flash", "FlashBackend"),
    "triton": ("triton_decode", "TritonDecodeBackend"),
}
# Tried in order by name='auto'; the first that constructs wins.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash", "triton", "sdpa", "reference"),
    "cpu": ("reference",),
}


def _construct(name: str, device: torch.device) -> AttentionBackend:
    module_name, class_name = _REGISTRY[name]
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
        cls = getattr(module, class_name)
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(f"attention backend {name!r} is not installed: {exc}") from exc
    try:
        return cls(device)
    except ImportError as exc:
        raise BackendUnavailableError(f"attention backend {name!r} cannot run: {exc}") from exc


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend called `name` on `device`, or the best available one for name='auto'."""
    device = torch.device(device)
    if name == "auto":
        reasons = []
        for candidate in AUTO_ORDER.get(device.type, ("reference",)):
            try:
                backend = _construct(candidate, device)
            except BackendUnavailableError as exc:
                reasons.append(str(exc))
                continue
            log.info("attention backend: %s on %s", backend.name, device)
            return backend
        raise BackendUnavailableError("no attention backend can run on " f"{device}: {'; '.join(reasons)}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose one of: auto, {', '.join(_REGISTRY)}")
    return _construct(name, device)


def available_backends(device: torch.device | str) -> list[str]:
    """Names of the backends that construct on `device` (imports each optional module)."""
    names = []
    for name in _REGISTRY:
        try:
            _construct(name, torch.device(device))
        except BackendUnavailableError:
            continue
        names.append(name)
    return names
