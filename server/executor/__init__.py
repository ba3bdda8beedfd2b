"""The executor: SchedulerOutput in, StepResult out (the only code that touches devices)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sloserve.executor.runner import ModelRunner

__all__ = ["ModelRunner"]


def __getattr__(name: str) -> Any:
    if name == "ModelRunner":
        from sloserve.executor.runner import ModelRunner

        return ModelRunner
    raise AttributeError(f"module 'sloserve.executor' has no attribute {name!r}")
