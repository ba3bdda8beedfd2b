"""Pure-Python twin of `_queue.pyx`: the SLO request queue and adaptive batch size.

Same API, same order, same errors as the compiled module; see `_queue.pyx` for the ordering
rules and how they correct the write-up. The heap here is `heapq` with lazy deletion (a removed
entry stays in the list until it reaches the top or the list is compacted), which is the idiomatic
fast form in Python; the compiled module uses an indexed heap instead.
"""

from __future__ import annotations

import heapq
import math
import operator
from _thread import allocate_lock

from ._limits import MAX_QUEUE_CAPACITY, MAX_QUEUE_ENTRIES, busy_error

_MIN_SCALE = 1e-300  # aging ** steps is clamped here so a negative base never divides by 0
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def as_double(value: object) -> float:
    """A C double argument's conversion (PyFloat_AsDouble: __float__ or __index__, no strings)."""
    return value if type(value) is float else math.ldexp(value, 0)


def entry_key(deadline: float, now: float, length_term: float, steps: int, aging: float) -> float:
    """Urgency key (smaller = sooner); aging always lowers it, whatever the sign of the base."""
    base = (deadline - now) + length_term
    scale = aging**steps
    if scale < _MIN_SCALE:
        scale = _MIN_SCALE
    return base * scale if base >= 0.0 else base / scale


def check_queue_args(
    aging: float, max_wait_s: float, length_weight_s: float, capacity: int
) -> None:
    """Raise ValueError naming the first bad RequestQueue constructor argument."""
    if not 0.0 < aging <= 1.0:
        raise ValueError(f"aging must be in (0, 1] (1 disables aging), got {aging!r}")
    if math.isnan(max_wait_s) or max_wait_s < 0.0:
        raise ValueError(
            f"max_wait_s must be >= 0 seconds (inf disables the guard), got {max_wait_s!r}"
        )
    if not math.isfinite(length_weight_s) or length_weight_s < 0.0:
        raise ValueError(
            f"length_weight_s must be a finite number >= 0 s/token, got {length_weight_s!r}"
        )
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity!r}")
    if capacity > MAX_QUEUE_CAPACITY:
        raise ValueError(
            f"capacity must be <= {MAX_QUEUE_CAPACITY} (sloserve.hotpath.MAX_QUEUE_CAPACITY), "
            f"got {capacity!r}"
        )


def check_handle(handle: int) -> None:
    """Handles are caller-chosen signed 64-bit ints."""
    if not _INT64_MIN <= handle <= _INT64_MAX:
        raise ValueError(f"handle must fit in a signed 64-bit int, got {handle!r}")


def check_push(deadline: float, prompt_tokens: int, now: float) -> None:
    """Raise ValueError for a NaN/-inf deadline, a non-finite now or a negative token count."""
    if math.isnan(deadline) or deadline == -math.inf:
        raise ValueError(
            f"deadline must be a time.monotonic() value or +inf (no SLO), got {deadline!r}"
        )
    if not math.isfinite(now):
        raise ValueError(f"now must be a finite time.monotonic() value, got {now!r}")
    if not 0 <= prompt_tokens <= _INT64_MAX:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens!r}")


def queue_full_error() -> ValueError:
    """The error of a push onto a queue that already holds MAX_QUEUE_ENTRIES entries."""
    return ValueError(f"RequestQueue is full: it holds at most {MAX_QUEUE_ENTRIES} entries")


def check_now(now: float) -> None:
    """`now` must be a finite time.monotonic() value."""
    if not math.isfinite(now):
        raise ValueError(f"now must be a finite time.monotonic() value, got {now!r}")


class _Entry:
    """One queued request (the heap holds tuples that point back here by sequence number)."""

    __slots__ = ("seq", "deadline", "length_term", "push_time", "steps", "starved")

    def __init__(self, seq: int, deadline: float, length_term: float, push_time: float) -> None:
        self.seq = seq
        self.deadline = deadline
        self.length_term = length_term
        self.push_time = push_time
        self.steps = 0
        self.starved = False


class RequestQueue:
    """SLO priority queue over caller-chosen int handles (pure-Python twin).

    Not thread-safe: callers serialise (see `_limits`); a call that overlaps another call on the
    same queue raises RuntimeError and changes nothing, as in the compiled module.
    """

    __slots__ = ("aging", "max_wait_s", "length_weight_s", "_heap", "_entries", "_seq", "_guard")

    def __new__(cls, *args: object, **kwargs: object) -> RequestQueue:
        # Like the compiled __cinit__: an instance whose __init__ never ran is a valid empty
        # queue with the default parameters.
        self = super().__new__(cls)
        self._guard = allocate_lock()
        self.aging, self.max_wait_s, self.length_weight_s = 0.95, 0.2, 1e-4
        self._heap: list[tuple[int, float, int, int]] = []
        self._entries: dict[int, _Entry] = {}
        self._seq = 0
        return self

    def __init__(
        self,
        aging: float = 0.95,
        max_wait_s: float = 0.2,
        length_weight_s: float = 1e-4,
        capacity: int = 1024,
    ) -> None:
        aging, max_wait_s = as_double(aging), as_double(max_wait_s)
        length_weight_s = as_double(length_weight_s)
        capacity = operator.index(capacity)
        check_queue_args(aging, max_wait_s, length_weight_s, capacity)
        if not self._guard.acquire(False):
            raise busy_error("RequestQueue", "__init__")
        try:
            self.aging = aging
            self.max_wait_s = max_wait_s
            self.length_weight_s = length_weight_s
            # Heap items: (group, primary, seq, handle); group 0 = starved (primary = seq),
            # group 1 = not starved (primary = key). An item is live iff its seq matches the entry.
            self._heap = []
            self._entries = {}
            self._seq = 0
        finally:
            self._guard.release()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, handle: object) -> bool:
        try:
            handle = operator.index(handle)
        except TypeError:
            return False
        if not _INT64_MIN <= handle <= _INT64_MAX:
            return False
        if not self._guard.acquire(False):
            raise busy_error("RequestQueue", "__contains__")
        try:
            return handle in self._entries
        finally:
            self._guard.release()

    def push(self, handle: int, deadline: float, prompt_tokens: int, now: float) -> None:
        """Queue `handle`; deadline is the absolute time.monotonic() of its SLO."""
        deadline, now = as_double(deadline), as_double(now)
        handle = operator.index(handle)
        check_handle(handle)
        prompt_tokens = operator.index(prompt_tokens)
        check_push(deadline, prompt_tokens, now)
        if not self._guard.acquire(False):
            raise busy_error("RequestQueue", "push")
        try:
            if handle in self._entries:
                raise ValueError(f"handle {handle} is already queued; remove it first")
            if len(self._entries) >= MAX_QUEUE_ENTRIES:
                raise queue_full_error()
            entry = _Entry(self._seq, deadline, self.length_weight_s * prompt_tokens, now)
            self._seq += 1
            self._entries[handle] = entry
            key = entry_key(deadline, now, entry.length_term, 0, self.aging)
            heapq.heappush(self._heap, (1, key, entry.seq, handle))
        finally:
            self._guard.release()

    def _drop_stale_top(self) -> None:
        heap, entries = self._heap, self._entries
        while heap:
            _, _, seq, handle = heap[0]
            entry = entries.get(handle)
            if entry is not None and entry.seq == seq:
                return
            heapq.heappop(heap)

    def peek(self) -> int:
        """Most urgent handle, left in the queue; IndexError when empty."""
        if not self._guard.acquire(False):
            raise busy_error("RequestQueue", "peek")
        try:
            self._drop_stale_top()
            if not self._heap:
                raise IndexError("peek from an empty RequestQueue")
            return self._heap[0][3]
        finally:
            self._guard.release()

    def pop(self) -> int:
        """Remove and return the most urgent handle; IndexError when empty."""
        if not self._guard.acquire(False):
            raise busy_error("RequestQueue", "pop")
        try:
            self._drop_stale_top()
            if not self._heap:
                raise IndexError("pop from an empty RequestQueue")
            handle = heapq.heappop(self._heap)[3]
            del self._entries[handle]
            return handle
        finally:
            self._guard.release()

    def remove(self, handle: int) -> None:
        """Drop a queued handle (cancellation); ValueError when it is not queued."""
        handle = operator.index(handle)
        if not self._guard.acquire(False):
            raise busy_error("RequestQueue", "remove")
        try:
            if self._entries.pop(handle, None) is None:
                raise ValueError(f"handle {handle!r} is not in the queue")
            if len(self._heap) > 2 * len(self._entries) + 64:
                self._rebuild()
        finally:
            self._guard.release()

    def _rebuild(self) -> None:
        """Compact the heap: drop removed items, keep the live ones with their current keys."""
        heap = [item for item in self._heap if self._is_live(item)]
        heapq.heapify(heap)
        self._heap = heap

    def _is_live(self, item: tuple[int, float, int, int]) -> bool:
        entry = self._entries.get(item[3])
        return entry is not None and entry.seq == item[2]

    def rekey(self, now: float) -> None:
        """One pass: every entry waits one more step, keys are recomputed for `now`, re-heapify."""
        now = as_double(now)
        check_now(now)
        if not self._guard.acquire(False):
            raise busy_error("RequestQueue", "rekey")
        try:
            aging, max_wait = self.aging, self.max_wait_s
            heap = []
            append = heap.append
            for handle, entry in self._entries.items():
                entry.steps += 1
                if entry.starved or now - entry.push_time > max_wait:
                    entry.starved = True
                    append((0, entry.seq, entry.seq, handle))
                else:
                    key = entry_key(entry.deadline, now, entry.length_term, entry.steps, aging)
                    append((1, key, entry.seq, handle))
            heapq.heapify(heap)
            self._heap = heap
        finally:
            self._guard.release()

    def handles_in_order(self) -> list[int]:
        """Every queued handle, most urgent first (for tests and inspection; O(n log n))."""
        if not self._guard.acquire(False):
            raise busy_error("RequestQueue", "handles_in_order")
        try:
            return [item[3] for item in sorted(item for item in self._heap if self._is_live(item))]
        finally:
            self._guard.release()


def target_batch_size(max_batch: int, queue_depth: int, decay: float = 0.9) -> int:
    """ceil(max_batch * (1 - decay ** queue_depth)), at least 1 while anything waits, 0 if none."""
    decay = as_double(decay)
    max_batch, queue_depth = operator.index(max_batch), operator.index(queue_depth)
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch!r}")
    if queue_depth < 0:
        raise ValueError(f"queue_depth must be >= 0, got {queue_depth!r}")
    if not 0.0 < decay < 1.0:
        raise ValueError(f"decay must be in (0, 1) (0.85-0.95 is the useful range), got {decay!r}")
    if queue_depth == 0:
        return 0
    target = math.ceil(max_batch * (1.0 - decay**queue_depth))
    return min(max(target, 1), max_batch)
