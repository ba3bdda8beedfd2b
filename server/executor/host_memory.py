"""Keep freed host memory in the process: a CPU step's activations reuse pages instead of faulting in fresh ones.

A CPU forward allocates its activations as torch tensors from glibc's malloc. glibc serves a
block larger than its mmap threshold with a fresh mmap and unmaps it on free, and returns the
free top of its heap to the OS past the trim threshold. Both thresholds start at 128 KiB and
adapt only partly, so a prefill step often maps fresh pages for its larger activations (a few
MiB per layer) and each page's first touch faults. With the thresholds raised the allocations
reuse the heap's pages and prefills fault almost never (docs/design/cpu-decode.md,
`benchmarks/host_memory.py`). The cost: RSS stays
at its peak, as with jemalloc or tcmalloc, which PyTorch's CPU tuning guide preloads for the
same reason.

Applied once per process when a model is loaded on a CPU; a no-op off glibc.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for the mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): blocks above it
# (a prefill's logits over a large vocabulary, say) still get their own mapping.
MMAP_THRESHOLD = 32 << 20
# Free memory kept at the heap's top before glibc returns it: more than any step's activations.
TRIM_THRESHOLD = 1 << 30

_applied: str | None = None


def keep_freed_memory() -> str:
    """Raise glibc's mmap and trim thresholds (once per process); returns what was done, for the log."""
    global _applied
    if _applied is None:
        _applied = _set_thresholds()
        log.info("host memory: %s", _applied)
    return _applied


def _set_thresholds() -> str:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "not glibc: malloc left as it is"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if not (
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    ):
        return f"glibc {version} refused mallopt: malloc left as it is"
    return (
        f"glibc {version}: freed blocks up to {MMAP_THRESHOLD >> 20} MiB stay in the heap "
        f"(mmap threshold), up to {TRIM_THRESHOLD >> 20} MiB of free heap kept (trim threshold)"
    )


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS now (glibc's malloc_trim; a no-op off glibc):
    after load-time work frees much at once (plain weights replaced by packed copies), which
    the raised trim threshold would otherwise keep resident."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
