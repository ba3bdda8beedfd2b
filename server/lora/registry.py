"""The adapters a runner serves, by name: loaded from PEFT folders, looked up per step."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from sloserve.errors import AdapterError, UnknownAdapterError
from sloserve.lora.adapter import LoraAdapter
from sloserve.lora.peft_format import BaseHead, read_adapter
from sloserve.models.spec import ModelSpec

_NAME_LIMIT = 256


class LoraRegistry:
    """Adapters by name, held as plain tensors (pool slots with LRU residency are later work).

    Paths loaded through the API (`trusted=False`) must lie under `lora_dir`; start-up paths
    (--lora-modules, the operator's own) may lie anywhere. Each load gets a new `uid`, so a name
    unloaded and loaded again never shares prefix-cache blocks with its earlier weights.
    """

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: torch.device,
        max_rank: int,
        lora_dir: str | None,
        base: BaseHead | None = None,
    ) -> None:
        self.spec, self.dtype, self.device, self.max_rank = spec, dtype, device, max_rank
        self.base = base
        self.lora_dir = Path(lora_dir).resolve() if lora_dir else None
        self._adapters: dict[str, LoraAdapter] = {}
        self._uids: dict[str, int] = {}
        self._next_uid = itertools.count(1)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def names(self) -> list[str]:
        """Loaded adapter names, in load order."""
        return list(self._adapters)

    def get(self, name: str) -> LoraAdapter:
        """The adapter named `name`, or UnknownAdapterError."""
        adapter = self._adapters.get(name)
        if adapter is None:
            raise UnknownAdapterError(name)
        return adapter

    def nbytes(self) -> int:
        """Bytes every loaded adapter's tensors take."""
        return sum(adapter.nbytes for adapter in self._adapters.values())

    def uid(self, name: str) -> int:
        """The load id of adapter `name` (unique per load in this process)."""
        if name not in self._uids:
            raise UnknownAdapterError(name)
        return self._uids[name]

    def resolve(self, path: str, *, trusted: bool) -> Path:
        """The adapter folder `path` names: relative paths are under --lora-dir; an untrusted one
        must lie there."""
        if self.lora_dir is None:
            if not trusted:
                raise AdapterError(
                    "loading adapters through the API needs --lora-dir: start the server with "
                    "--lora-dir pointing at the folder that holds them"
                )
            return Path(path).resolve()
        folder = (self.lora_dir / path).resolve()
        if not trusted and not folder.is_relative_to(self.lora_dir):
            raise AdapterError(f"lora_path {path!r} is outside --lora-dir {self.lora_dir}")
        return folder

    def load(self, name: str, path: str, *, trusted: bool = False) -> LoraAdapter:
        """Read and register adapter `name` from `path`; AdapterError says what to change."""
        if not isinstance(name, str) or not name or len(name) > _NAME_LIMIT or name.isspace():
            raise AdapterError(f"lora_name must be a non-empty name of <= {_NAME_LIMIT} characters")
        if name in self._adapters:
            raise AdapterError(
                f"an adapter named {name!r} is already loaded: unload it first, or choose "
                "another lora_name"
            )
        folder = self.resolve(path, trusted=trusted)
        adapter = read_adapter(
            name, folder, self.spec, self.max_rank, self.dtype, self.device, self.base
        )
        self._adapters[name] = adapter
        self._uids[name] = next(self._next_uid)
        return adapter

    def unload(self, name: str) -> None:
        """Forget adapter `name` (UnknownAdapterError if none)."""
        self.get(name)
        del self._adapters[name]
        del self._uids[name]
