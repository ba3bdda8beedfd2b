"""sloserve: an SLO-aware LLM inference server with bidirectional gRPC token streaming.

The offline API is `from sloserve import LLM, SamplingParams`; it is imported lazily so that
light modules (the hot path, the scheduler) never pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SLO", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from sloserve.llm import LLM
    from sloserve.sampling_params import SLO, SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from sloserve.llm import LLM

        return LLM
    if name in ("SamplingParams", "SLO"):
        from sloserve import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module 'sloserve' has no attribute {name!r}")
