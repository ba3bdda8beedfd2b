"""One safetensors file read with plain reads, never memory-mapped: each tensor lands in memory of its own.

The format: an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets into the data that follows), then the data. The safetensors library maps the whole
file, and every page of the mapping that was read counts in the process's RSS until it is
unmapped, so loading through it can peak near checkpoint bytes + weight bytes. Reading each
tensor with pread into a tensor of its own keeps the peak near the weights alone (the page
cache holds the file, outside the process).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# NOTE: a header larger than this is not a checkpoint's (the library's own limit is 100 MB)
_MAX_HEADER = 100 * 2**20
# converting to another dtype goes through a scratch buffer of this many bytes
CHUNK_BYTES = 8 * 2**20


@dataclass(slots=True, frozen=True)
class Entry:
    """Where one tensor's bytes lie in the file, and what they hold."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset of the first byte in the file
    nbytes: int


class SafetensorsFile:
    """The header of one safetensors file, and reads of its tensors (whole or a slice along one dim).

    Malformed files raise ValueError saying what is wrong; the caller names the file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, _MAX_HEADER):
                raise ValueError(f"header length {length} exceeds the file's {size} bytes")
            try:
                header = json.loads(f.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        data, data_size = 8 + length, size - 8 - length
        self.entries: dict[str, Entry] = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            self.entries[name] = _entry(name, meta, data, data_size)

    def keys(self) -> list[str]:
        """The names of the file's tensors."""
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor `name`'s shape, from the header (nothing is read)."""
        return self.entries[name].shape

    def read(
        self,
        name: str,
        part: tuple[int, slice] | None = None,
        *,
        dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
        scratch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tensor `name`, or with `part` = (dim, slice) only that slice of it, read from the file.

        Into `out` (a contiguous CPU tensor of the slice's shape, any dtype) when given, else into
        a new tensor in `dtype` (default: the stored one). A dtype other than the stored one is
        converted a chunk at a time through `scratch` (uint8; one of CHUNK_BYTES when None), so
        nothing the size of the tensor is held twice.
        """
        e = self.entries[name]
        dim, sl = part if part is not None else (0, slice(None))
        n = e.shape[dim] if e.shape else 1
        first, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"a slice with step {step}: only contiguous slices are read")
        rows = max(stop - first, 0)
        shape = list(e.shape)
        if shape:
            shape[dim] = rows
        if out is None:
            out = torch.empty(shape, dtype=dtype or e.dtype)
        elif tuple(out.shape) != tuple(shape) or not out.is_contiguous() or out.is_cuda:
            raise ValueError(
                f"cannot read {name!r} {tuple(shape)} into a {tuple(out.shape)} tensor"
            )
        if out.numel() == 0:
            return out
        inner = math.prod(e.shape[dim + 1 :])
        count, size = rows * inner, e.dtype.itemsize
        flat = out.reshape(-1)
        chunk = None
        if out.dtype != e.dtype:
            if scratch is None:
                scratch = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
            chunk = scratch[: len(scratch) // size * size].view(e.dtype)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            # NOTE: one run of contiguous bytes per index of the dims before `dim`: the whole slice
            # when dim is 0, one row of o_proj (say) for a slice of its columns.
            for o in range(math.prod(e.shape[:dim])):
                src = e.start + (o * n + first) * inner * size
                dst = flat[o * count : (o + 1) * count]
                if chunk is None:
                    _pread_into(fd, _bytes(dst), src)
                    continue
                for at in range(0, count, len(chunk)):
                    m = min(len(chunk), count - at)
                    _pread_into(fd, _bytes(chunk[:m]), src + at * size)
                    dst[at : at + m].copy_(chunk[:m])
        finally:
            os.close(fd)
        return out


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous 1-D CPU tensor, writable."""
    return memoryview(t.view(torch.uint8).numpy())


def _entry(name: str, meta: object, data: int, data_size: int) -> Entry:
    """One header entry, checked: a known dtype, a shape, offsets inside the data that fit it."""
    if not isinstance(meta, dict):
        raise ValueError(f"header entry {name!r} is not an object")
    dtype = _DTYPES.get(meta.get("dtype"))
    if dtype is None:
        raise ValueError(
            f"tensor {name!r} has dtype {meta.get('dtype')!r}; readable: {', '.join(_DTYPES)}"
        )
    shape, offsets = meta.get("shape"), meta.get("data_offsets")
    if not (
        isinstance(shape, list)
        and all(isinstance(d, int) and d >= 0 for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(x, int) for x in offsets)
    ):
        raise ValueError(f"header entry {name!r} lacks a valid shape or data_offsets")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if not 0 <= begin <= end <= data_size or end - begin != nbytes:
        raise ValueError(
            f"tensor {name!r}: data_offsets {offsets} do not hold {nbytes} bytes inside the "
            f"file's {data_size} data bytes"
        )
    return Entry(dtype, tuple(shape), data + begin, nbytes)


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fill `buf` from `offset` of `fd` (pread may return short)."""
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise ValueError(f"the file ends before byte {offset + len(buf)}")
        done += got
