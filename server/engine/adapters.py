"""The engine's LoRA adapters: load, unload and check by name, keeping the prefix cache's seeds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sloserve.errors import AdapterBusyError, AdapterError, UnknownAdapterError
from sloserve.sched.block_manager import adapter_root
from sloserve.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from sloserve.lora import LoraRegistry


_KINDS = {"invalid": AdapterError, "not_found": UnknownAdapterError, "busy": AdapterBusyError}


def adapter_error_kind(exc: Exception) -> str:
    """The wire's name for an adapter operation's error (see wire.AdapterDone)."""
    if isinstance(exc, UnknownAdapterError):
        return "not_found"
    return "busy" if isinstance(exc, AdapterBusyError) else "invalid"


def adapter_error(kind: str | None, name: str, message: str) -> Exception:
    """The exception an adapter operation raised in the engine process, raised again here."""
    cls = _KINDS.get(kind or "invalid", AdapterError)
    return cls(message) if cls is AdapterError else cls(name, message)


class Adapters:
    """The runner's adapter registry (None: a runner that serves none) seen from the engine."""

    def __init__(self, registry: LoraRegistry | None, scheduler: Scheduler) -> None:
        self.registry = registry
        self.scheduler = scheduler
        for name in self.names():
            self._seed(name)

    def names(self) -> list[str]:
        """Loaded adapters, in load order."""
        return [] if self.registry is None else self.registry.names()

    def check(self, name: str | None) -> None:
        """UnknownAdapterError unless `name` is None (the base model) or a loaded adapter."""
        if name is not None and (self.registry is None or name not in self.registry):
            raise UnknownAdapterError(name)

    def load(self, name: str, path: str, *, trusted: bool = False) -> None:
        """Load adapter `name` from `path` (under --lora-dir unless `trusted`)."""
        if self.registry is None:
            raise AdapterError("this engine serves no LoRA adapters (tensor parallelism)")
        self.registry.load(name, path, trusted=trusted)
        self._seed(name)

    def unload(self, name: str) -> None:
        """Unload adapter `name`; AdapterBusyError while requests of it are live (they finish first)."""
        self.check(name)
        live = sum(
            1
            for req in self.scheduler.requests.values()
            if req.sampling.adapter == name and not req.status.is_finished
        )
        if live:
            raise AdapterBusyError(
                name,
                f"adapter {name!r} has {live} request(s) in flight: unload it once they finish",
            )
        assert self.registry is not None
        self.registry.unload(name)
        self.scheduler.block_manager.adapter_roots.pop(name, None)

    def _seed(self, name: str) -> None:
        assert self.registry is not None
        roots = self.scheduler.block_manager.adapter_roots
        roots[name] = adapter_root(name, self.registry.uid(name))
