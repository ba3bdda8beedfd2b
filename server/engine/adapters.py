"""The engine's LoRA adapters: load, unload and check by name, keeping the prefix cache's seeds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sloserve.errors import AdapterBusyError, AdapterError, UnknownAdapterError
from sloserve.sched.block_manager import adapter_root
from sloserve.sched.request import Request, RequestStatus
from sloserve.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from sloserve.lora import LoraRegistry


_KINDS = {"invalid": AdapterError, "not_found": UnknownAdapterError, "busy": AdapterBusyError}
# What unloading does to an adapter's requests in flight: refuse the unload (409 / FAILED_PRECONDITION),
# drain (refuse new requests of it, unload once the last finishes) or abort (end them now, each
# with NOT_FOUND naming the unload)
IN_FLIGHT = ("refuse", "drain", "abort")


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
        # unloaded once their last request finishes (`sweep`); no new request may name them
        self.draining: set[str] = set()
        # start-up adapters (--lora-modules) count as loads
        self.loads_total, self.unloads_total = len(self.names()), 0
        # per adapter loaded now: requests admitted, tokens generated (EngineStats.lora_*)
        self.requests: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        for name in self.names():
            self._seed(name)

    def names(self) -> list[str]:
        """Adapters that take requests, in load order (not those draining)."""
        if self.registry is None:
            return []
        return [name for name in self.registry.names() if name not in self.draining]

    def check(self, name: str | None) -> None:
        """UnknownAdapterError unless `name` is None (the base model) or a loaded adapter."""
        if name is not None and (self.registry is None or name not in self.registry):
            raise UnknownAdapterError(name)
        if name in self.draining:
            raise UnknownAdapterError(
                name, f"adapter {name!r} is being unloaded: load it again to use it"
            )

    def load(self, name: str, path: str, *, trusted: bool = False) -> None:
        """Load adapter `name` from `path` (under --lora-dir unless `trusted`)."""
        if self.registry is None:
            raise AdapterError("this engine serves no LoRA adapters (tensor parallelism)")
        self.registry.load(name, path, trusted=trusted)
        self.loads_total += 1
        self._seed(name)

    def unload(self, name: str, in_flight: str = "refuse") -> list[Request]:
        """Unload adapter `name`; what happens to its requests in flight is `in_flight`'s (see
        IN_FLIGHT). The requests it ended (abort), for their final outputs."""
        if in_flight not in IN_FLIGHT:
            raise AdapterError(
                f"in_flight must be one of {', '.join(IN_FLIGHT)}, got {in_flight!r}"
            )
        self.check(name)
        live = self._live(name)
        if live and in_flight == "refuse":
            raise AdapterBusyError(
                name,
                f"adapter {name!r} has {len(live)} request(s) in flight: unload it once they "
                "finish, or ask in_flight 'drain' (unload when they finish) or 'abort' (end them)",
            )
        if live and in_flight == "drain":
            self.draining.add(name)
            return []
        message = f"adapter {name!r} was unloaded while this request ran (in_flight 'abort')"
        for req in live:
            req.error_kind = "not_found"
            self.scheduler.stop_early(
                req, req.num_output_tokens, RequestStatus.FINISHED_ERROR, message
            )
        self._forget(name)
        return live

    def sweep(self) -> None:
        """Unload every draining adapter whose last request has finished."""
        for name in [n for n in self.draining if not self._live(n)]:
            self._forget(name)

    def _live(self, name: str) -> list[Request]:
        return [
            req
            for req in self.scheduler.requests.values()
            if req.sampling.adapter == name and not req.status.is_finished
        ]

    def count(self, requests: list[Request], tokens: list[int]) -> None:
        """Add a step's new tokens (tokens[i] of requests[i]) to their adapters' counts."""
        for req, n in zip(requests, tokens, strict=True):
            name = req.sampling.adapter
            if name is not None and n:
                self.tokens[name] = self.tokens.get(name, 0) + n

    def admitted(self, name: str | None) -> None:
        """Count a request of adapter `name` taken by the engine (None: the base model's)."""
        if name is not None:
            self.requests[name] = self.requests.get(name, 0) + 1

    def stats(self) -> dict:
        """The EngineStats fields of the adapters."""
        names = self.names()
        held = 0 if self.registry is None else self.registry.nbytes()
        return {
            "lora_adapters_loaded": len(names),
            "lora_adapter_bytes": held,
            "lora_loads_total": self.loads_total,
            "lora_unloads_total": self.unloads_total,
            "lora_requests": {n: self.requests.get(n, 0) for n in names},
            "lora_generated_tokens": {n: self.tokens.get(n, 0) for n in names},
        }

    def _forget(self, name: str) -> None:
        assert self.registry is not None
        self.draining.discard(name)
        self.unloads_total += 1
        self.requests.pop(name, None)
        self.tokens.pop(name, None)
        self.registry.unload(name)
        self.scheduler.block_manager.adapter_roots.pop(name, None)

    def _seed(self, name: str) -> None:
        assert self.registry is not None
        roots = self.scheduler.block_manager.adapter_roots
        roots[name] = adapter_root(name, self.registry.uid(name))
