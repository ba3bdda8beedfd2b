"""What the front end needs of its engine client (a typing.Protocol).

MPEngineClient (the engine in a process of its own) and AsyncEngine (in a thread of this one)
implement it, and so do the tests' fake engines; tests/engine/test_protocols.py checks each
against it member by member, signatures included.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from sloserve.engine.outputs import EngineStats, RequestOutput
from sloserve.new_request import NewRequest

if TYPE_CHECKING:
    from sloserve.tokenizer import Tokenizer


@runtime_checkable
class EngineClient(Protocol):
    """Starts and stops an engine, streams its requests' outputs, reports its health and stats."""

    ready: bool  # loaded and warmed up: requests may be added

    @property
    def alive(self) -> bool:
        """The engine runs: its loop has not died and no step is stuck."""

    @property
    def dead_reason(self) -> str | None:
        """Why the engine died (None while it has not)."""

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (the front end tokenizes and detokenizes prompts with it)."""

    @property
    def model_info(self) -> dict:
        """The model's description (Info, /v1/models)."""

    async def start(self) -> None:
        """Load and warm up the engine; `ready` turns True when it may take requests."""

    async def stop(self) -> None:
        """Stop the engine; requests still live end 'cancelled'."""

    def add_request(self, new: NewRequest) -> AsyncIterator[RequestOutput]:
        """Queue a request and return its stream of outputs (the last has finished=True)."""

    def report_delivery_lag(self, lag_s: float) -> None:
        """The front end handed a first token to its client `lag_s` after the engine made it."""

    def abort(self, request_id: str) -> bool:
        """Cancel a live request (its stream ends 'cancelled'); False when it is not live."""

    def stats(self) -> EngineStats:
        """The engine's latest stats."""


@runtime_checkable
class AdapterControl(Protocol):
    """An engine client that loads and unloads LoRA adapters while serving (both real ones do)."""

    def adapter_names(self) -> list[str]:
        """The adapters loaded, by name."""

    async def load_adapter(self, name: str, path: str) -> None:
        """Load adapter `name` from `path` under --lora-dir; AdapterError says why not."""

    async def unload_adapter(self, name: str, in_flight: str = "refuse") -> None:
        """Unload adapter `name`, its requests in flight refused, drained or aborted
        (engine/adapters.py IN_FLIGHT); UnknownAdapterError or AdapterBusyError say why not."""
