"""The pure-Python twin of `_bench`: the same churns through the public API of the Python twins
(`_queue_py`, `_blocks_py`), returning the same checksums; they hold the GIL."""

from __future__ import annotations

from ._blocks_py import BlockAllocator
from ._limits import MAX_BLOCKS, MAX_QUEUE_CAPACITY
from ._queue_py import RequestQueue

_MASK64 = (1 << 64) - 1
_MAX_HELD = 16  # blocks per simulated request
_BENCH_MAX_REQUESTS = 2**24


def _lcg(x: int) -> int:
    return (x * 6364136223846793005 + 1442695040888963407) & _MASK64


def _bench_queue(
    n_live: int,
    n_ops: int,
    seed: int = 1,
    probe=None,
    probe_target: int = 0,
    release_gil: bool = True,
) -> tuple[int, int, int]:
    """Same churn as `_bench._bench_queue` through the public API (the twin holds the GIL)."""
    if n_live < 1 or n_live > MAX_QUEUE_CAPACITY or n_ops < 0:
        raise ValueError(
            f"need 1 <= n_live <= {MAX_QUEUE_CAPACITY} and n_ops >= 0, got {n_live}, {n_ops}"
        )
    q = RequestQueue(0.95, 0.2, 1e-4, n_live + 1)
    x, checksum, next_handle, now, done = seed, 0, 0, 0.0, 0
    start = seen = probe[0] if probe is not None else 0
    for _ in range(n_live):
        x = _lcg(x)
        r = x >> 33
        q.push(next_handle, now + (r % 2000) * 0.001, (r >> 11) % 4096, now)
        next_handle += 1
    for i in range(n_ops):
        now += 1e-6
        checksum = (checksum * 1000003 + q.pop()) & _MASK64
        x = _lcg(x)
        r = x >> 33
        q.push(next_handle, now + (r % 2000) * 0.001, (r >> 11) % 4096, now)
        next_handle += 1
        if i % 8 == 7:
            victim = next_handle - 1 - r % 16
            if victim in q:
                q.remove(victim)
                checksum = (checksum * 1000003 + victim) & _MASK64
                x = _lcg(x)
                r = x >> 33
                q.push(next_handle, now + (r % 2000) * 0.001, (r >> 11) % 4096, now)
                next_handle += 1
        done = i + 1
        if probe is not None and i % 256 == 255:
            seen = probe[0]
            if seen - start >= probe_target:
                break
    if probe is not None:
        seen = probe[0]
    return checksum, done, seen - start


def _bench_blocks(
    num_blocks: int,
    n_requests: int,
    n_ops: int,
    seed: int = 1,
    probe=None,
    probe_target: int = 0,
    release_gil: bool = True,
) -> tuple[int, int, int, int]:
    """Same churn as `_bench._bench_blocks` through the public API (the twin holds the GIL)."""
    if not 2 <= num_blocks <= MAX_BLOCKS or not 1 <= n_requests <= _BENCH_MAX_REQUESTS or n_ops < 0:
        raise ValueError(
            f"need 2 <= num_blocks <= {MAX_BLOCKS}, "
            f"1 <= n_requests <= {_BENCH_MAX_REQUESTS}, n_ops >= 0"
        )
    a = BlockAllocator(num_blocks)
    held: list[list[int]] = [[] for _ in range(n_requests)]
    x, checksum, done, hash_space = seed, 0, 0, 4 * n_requests
    start = seen = probe[0] if probe is not None else 0
    for i in range(n_ops):
        x = _lcg(x)
        r = x >> 33
        k = r % n_requests
        if held[k]:
            a.free(held[k][::-1])
            held[k] = []
        else:
            want = 1 + (r >> 8) % _MAX_HELD
            h = (r >> 12) % hash_space
            got = []
            b = a.lookup(h)
            a.record_lookup(b >= 0)
            if b >= 0:
                if a.ref_count(b) > 0:
                    a.incref(b)
                else:
                    a.touch(b)
                got = [b]
            new = a.allocate(want - len(got))
            if new is None:
                if got:
                    a.free(got)
            else:
                blocks = got + new
                if not got:
                    a.set_hash(blocks[0], h)
                for block in blocks:
                    checksum = (checksum * 1000003 + block) & _MASK64
                held[k] = blocks
        done = i + 1
        if probe is not None and i % 256 == 255:
            seen = probe[0]
            if seen - start >= probe_target:
                break
    if probe is not None:
        seen = probe[0]
    return checksum, done, seen - start, a.num_used
