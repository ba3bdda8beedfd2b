"""The engine: the core, its process and clients, the wire and output processing (imports no torch)."""

from sloserve.engine.async_engine import AsyncEngine
from sloserve.engine.outputs import EngineStats, RequestOutput
from sloserve.engine.stream import RequestStream

__all__ = ["AsyncEngine", "EngineStats", "RequestOutput", "RequestStream"]
