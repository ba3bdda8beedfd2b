"""One allocation at start-up, divided into arena blocks, from which every long-lived tensor is carved.

Layout (A = arena_bytes)::

    [ arena 0 | arena 1 | arena 2 | ... | arena n-1 (may be short) ]
      small carves (< A) never cross an arena boundary; large carves (>= A) start on one
      and take whole arenas; space skipped by either becomes a hole for later small carves.

Carved tensors are views into the one buffer, zero-filled unless the pool was made with
zero=False (the host swap pool: only ever read after being written), and live as long as the
pool: nothing is freed or allocated afterwards, so steady-state steps make no device allocations
for KV or workspaces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_ALIGN = 256  # bytes; enough for every dtype and for vectorised kernels
GPU_ARENA_BYTES = 256 * 1024**2
CPU_ARENA_BYTES = 16 * 1024**2
CPU_DEFAULT_POOL_BYTES = 256 * 1024**2


class PoolExhaustedError(MemoryError):
    """A carve does not fit in what is left of the pool."""


@dataclass(slots=True)
class _Carve:
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def default_arena_bytes(device: torch.device | str) -> int:
    """256 MiB arenas on a GPU, 16 MiB on a CPU."""
    return GPU_ARENA_BYTES if torch.device(device).type == "cuda" else CPU_ARENA_BYTES


def default_pool_bytes(device: torch.device | str, gpu_memory_fraction: float) -> int:
    """A fraction of free device memory on a GPU (call after loading weights); 256 MiB on a CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return max(_ALIGN, int(free * gpu_memory_fraction) // _ALIGN * _ALIGN)
    return CPU_DEFAULT_POOL_BYTES


class DevicePool:
    """Bump allocator over a single uint8 buffer, carving named typed views."""

    def __init__(
        self,
        total_bytes: int,
        arena_bytes: int | None = None,
        device: torch.device | str = "cpu",
        *,
        pin_memory: bool = False,
        zero: bool = True,
    ) -> None:
        if total_bytes <= 0:
            raise ValueError(f"pool size must be > 0 bytes, got {total_bytes}")
        self.device = torch.device(device)
        arena = default_arena_bytes(self.device) if arena_bytes is None else arena_bytes
        if arena <= 0:
            raise ValueError(f"arena size must be > 0 bytes, got {arena}")
        self.total_bytes = _align(total_bytes, _ALIGN)
        self.arena_bytes = min(_align(arena, _ALIGN), self.total_bytes)
        # NOTE: pinning is a host-memory property that only exists with CUDA; guard it.
        self.pinned = bool(pin_memory and self.device.type == "cpu" and torch.cuda.is_available())
        try:
            # empty host memory is not committed until written
            make = torch.zeros if zero else torch.empty
            self._buffer = make(
                self.total_bytes, dtype=torch.uint8, device=self.device, pin_memory=self.pinned
            )
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            raise PoolExhaustedError(
                f"cannot allocate a {self.total_bytes / 2**20:.1f} MiB pool on {self.device}: {exc}; "
                "lower the KV pool size (cache.kv_pool_bytes / --kv-pool) or the GPU memory fraction"
            ) from exc
        self._top = 0  # first byte never handed out
        self._holes: list[tuple[int, int]] = []  # (start, end) skipped ranges for small carves
        self._carves: dict[str, _Carve] = {}

    @property
    def num_arenas(self) -> int:
        return math.ceil(self.total_bytes / self.arena_bytes)

    @property
    def used_bytes(self) -> int:
        return sum(c.nbytes for c in self._carves.values())

    def free_bytes(self, *, contiguous: bool = True) -> int:
        """Bytes a large carve can still take (contiguous), or all bytes not yet carved."""
        if contiguous:
            arena = self.arena_bytes
            # small carves
            in_arena = min(_align(self._top + 1, arena), self.total_bytes) - self._top
            whole = self.total_bytes - _align(self._top, arena)  # large carves start on a boundary
            return max(0, in_arena, whole) // _ALIGN * _ALIGN
        return self.total_bytes - self.used_bytes

    def carve(
        self, name: str, shape: tuple[int, ...] | list[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """A tensor view of `shape` and `dtype` owned by the pool under `name` (zeroed if the pool is)."""
        if name in self._carves:
            raise ValueError(f"pool already holds a carve named {name!r}")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"carve {name!r}: negative dimension in shape {shape}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        offset = self._place(name, max(nbytes, 1))
        self._carves[name] = _Carve(offset, nbytes, shape, dtype)
        return self._buffer[offset : offset + nbytes].view(dtype).view(shape)

    def _place(self, name: str, nbytes: int) -> int:
        size = _align(nbytes, _ALIGN)
        arena = self.arena_bytes
        if size < arena:
            for i, (lo, hi) in enumerate(self._holes):
                if hi - lo >= size:
                    self._holes[i] = (lo + size, hi)
                    return lo
            start = self._top
            if start // arena != (start + size - 1) // arena:  # would cross an arena boundary
                start = _align(start, arena)
        else:
            start = _align(self._top, arena)
        if start + size > self.total_bytes:
            raise PoolExhaustedError(
                f"pool on {self.device} cannot fit {name!r} ({nbytes / 2**20:.2f} MiB): "
                f"{self.free_bytes() / 2**20:.2f} MiB contiguous left of {self.total_bytes / 2**20:.2f} MiB; "
                "raise the KV pool size (cache.kv_pool_bytes / --kv-pool) or lower max_batched_tokens"
            )
        if start > self._top:
            self._holes.append((self._top, start))
        self._top = start + size
        return start

    def report(self) -> dict:
        """Sizes, arena use and every carve (name -> bytes, shape, dtype, offset)."""
        arenas_used = len(
            {
                off // self.arena_bytes
                for c in self._carves.values()
                for off in range(c.offset, c.offset + max(c.nbytes, 1), self.arena_bytes)
            }
        )
        return {
            "device": str(self.device),
            "pinned": self.pinned,
            "total_bytes": self.total_bytes,
            "used_bytes": self.used_bytes,
            "free_bytes": self.free_bytes(contiguous=False),
            "arena_bytes": self.arena_bytes,
            "num_arenas": self.num_arenas,
            "arenas_used": arenas_used,
            "carves": {
                name: {
                    "bytes": c.nbytes,
                    "offset": c.offset,
                    "shape": list(c.shape),
                    "dtype": str(c.dtype),
                }
                for name, c in self._carves.items()
            },
        }
