"""The prompt blocks of queued requests: prefix work that one of them will do for all.

Requests that share a prompt prefix (ARC-AGI-2 attempts of one task: the same training grids)
compute it once. The first to start claims its blocks and the others wait for them
(BlockManager.is_claimed), then take them from the prefix cache. In a burst nothing is cached
or claimed yet when they arrive, so admission used to price every one of them for its whole
prompt and refused requests that would have been served in time. Admission asks this registry
which of a newcomer's blocks a request queued before it will compute, and prices the newcomer
(and, through Request.expected_cached_tokens, the backlog it joins) without them.

Only never-started requests are held: a started one claims or caches its blocks itself.
"""

from __future__ import annotations

from collections import Counter


class QueuedPrefixes:
    """Counts of full-block hashes over the prompts of the queued, never-started requests."""

    def __init__(self) -> None:
        self._count: Counter[int] = Counter()
        self._held: dict[str, list[int]] = {}  # request id -> its prompt's block hashes

    def add(self, request_id: str, hashes: list[int]) -> None:
        if request_id in self._held or not hashes:
            return
        self._held[request_id] = hashes
        self._count.update(hashes)

    def discard(self, request_id: str) -> None:
        """Forget a request (started, finished or refused); nothing if it is not held."""
        hashes = self._held.pop(request_id, None)
        if hashes is None:
            return
        self._count.subtract(hashes)
        for h in hashes:
            if self._count[h] <= 0:
                self._count.pop(h, None)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._count

    def __len__(self) -> int:
        return len(self._held)
