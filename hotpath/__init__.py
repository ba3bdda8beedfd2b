"""sloserve.hotpath: the SLO request queue, batch sizing, and the KV block and expert allocators.

The compiled Cython modules (`_queue`, `_blocks`, `_experts`) are used by default. Setting
``SLOSERVE_NO_EXTENSIONS=1`` before this package is first imported selects the pure-Python
twins (`_queue_py`, `_blocks_py`, `_experts_py`), which have the same API and behaviour.
`USING_EXTENSIONS` says which ones were loaded.

Both are hardened the same way (see `_limits`): sizes above the MAX_* limits are a ValueError,
every argument is converted once and bounds-checked, an instance whose __init__ never ran is a
valid empty object, and the objects are not thread-safe: callers serialise, and an overlapping
call raises RuntimeError instead of corrupting anything.
"""

from __future__ import annotations

import os
import warnings

from ._limits import (
    MAX_BLOCKS,
    MAX_EXPERT_ENTRIES,
    MAX_QUEUE_CAPACITY,
    MAX_QUEUE_ENTRIES,
    MAX_REFCOUNT,
    MAX_WORKSPACE_ROWS,
)

# NOTE: the one environment read at import time that the project allows (see docs/architecture.md).
_FORCE_PYTHON = os.environ.get("SLOSERVE_NO_EXTENSIONS", "").strip() not in ("", "0")

if _FORCE_PYTHON:
    USING_EXTENSIONS = False
else:
    try:
        from ._blocks import BlockAllocator
        from ._experts import ExpertAllocator
        from ._queue import RequestQueue, target_batch_size

        USING_EXTENSIONS = True
    except ImportError as exc:
        warnings.warn(
            f"sloserve.hotpath: compiled extensions are not built ({exc}); using the slow "
            "pure-Python twins. Build them with `python3 setup.py build_ext --inplace` or "
            "`pip install -e .`",
            RuntimeWarning,
            stacklevel=2,
        )
        USING_EXTENSIONS = False

if not USING_EXTENSIONS:
    from ._blocks_py import BlockAllocator
    from ._experts_py import ExpertAllocator
    from ._queue_py import RequestQueue, target_batch_size

IMPLEMENTATION = "cython" if USING_EXTENSIONS else "python"

__all__ = [
    "IMPLEMENTATION",
    "MAX_BLOCKS",
    "MAX_EXPERT_ENTRIES",
    "MAX_QUEUE_CAPACITY",
    "MAX_QUEUE_ENTRIES",
    "MAX_REFCOUNT",
    "MAX_WORKSPACE_ROWS",
    "USING_EXTENSIONS",
    "BlockAllocator",
    "ExpertAllocator",
    "RequestQueue",
    "target_batch_size",
]
