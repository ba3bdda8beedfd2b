# cython: language_level=3
"""The SLO request queue and adaptive batch size, over C arrays with `nogil` cores.

Ordering (smaller runs first; this is the invariant both implementations keep)::

    base  = (deadline - now) + length_weight_s * prompt_tokens      # seconds of slack
    scale = max(aging ** wait_steps, 1e-300)
    key   = base * scale   if base >= 0      # shrinks towards 0
            base / scale   otherwise          # overdue: grows more negative
    1. starved entries (waited > max_wait_s since push) come before all others,
       among themselves in arrival (push) order: the longest waiter goes first;
    2. the rest by key, then by arrival order (ties never depend on the handle).

Aging therefore always makes a request MORE urgent, whatever the sign of its slack: a plain
`base * aging**steps` would pull an overdue (negative) key up towards 0, i.e. make an overdue
request less urgent the longer it waits. Overdue requests stay ordered by how overdue they are.
`rekey(now)` is the one pass that advances wait_steps, recomputes keys and starvation for the
current time and re-heapifies (O(n), one nogil section); push keys with wait_steps = 0.

How this corrects the write-up:
- its min-heap keyed on 1 / (slo + 0.1 * len) pops the LARGEST slo + len first, i.e. serves the
  least urgent request first; here the heap is keyed on the slack itself, smallest first;
- it weighs 0.1 per prompt token against seconds, so a 2,000-token prompt counts as 200 s of
  slack and length swamps urgency; the default length_weight_s = 1e-4 s/token makes that
  prompt weigh like 0.2 s of slack, the same order as a TTFT SLO;
- its batch size computed from the (empty) current batch is always 0 and the current batch is
  never cleared; `target_batch_size` sizes the batch from the queue depth instead, and the
  engine builds a fresh batch every step.

Layout: entries live in an array of `Entry` structs whose unused slots form a free list; the
heap is an array of `Node` (key, seq, starved, slot) so comparisons read contiguous memory;
`Entry.pos` is the node's heap index and a C hash map sends a handle to its slot, which makes
remove-by-handle O(log n). No Python object per entry.
"""

from cpython.number cimport PyNumber_Index
from libc.math cimport INFINITY, ceil, isfinite, isnan, pow
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc, qsort, realloc

from _hashmap cimport I64Map, map_del, map_find, map_free, map_init, map_put

from ._queue_py import check_handle, check_now, check_push, check_queue_args

include "_queue_core.pxi"


cdef class RequestQueue:
    """SLO priority queue over caller-chosen int handles; see the module docstring for the order."""

    cdef Queue q
    cdef readonly double aging
    cdef readonly double max_wait_s
    cdef readonly double length_weight_s

    def __init__(self, double aging=0.95, double max_wait_s=0.2, double length_weight_s=1e-4,
                 Py_ssize_t capacity=1024):
        check_queue_args(aging, max_wait_s, length_weight_s, capacity)
        q_free(&self.q)
        self.aging = aging
        self.max_wait_s = max_wait_s
        self.length_weight_s = length_weight_s
        if q_init(&self.q, capacity, aging, max_wait_s, length_weight_s) < 0:
            raise MemoryError("RequestQueue: out of memory")

    def __dealloc__(self):
        q_free(&self.q)

    def __len__(self):
        return self.q.size

    def __contains__(self, handle):
        cdef int64_t h
        try:
            h = PyNumber_Index(handle)
        except (OverflowError, TypeError):
            return False
        return map_find(&self.q.index, h) >= 0

    def push(self, handle, double deadline, prompt_tokens, double now):
        """Queue `handle`; deadline is the absolute time.monotonic() of its SLO."""
        cdef int64_t h, tokens
        cdef int rc
        try:
            h = PyNumber_Index(handle)
        except OverflowError:
            check_handle(handle)
            raise
        try:
            tokens = PyNumber_Index(prompt_tokens)
        except OverflowError:
            check_push(deadline, prompt_tokens, now)
            raise
        if isnan(deadline) or deadline == -INFINITY or not isfinite(now) or tokens < 0:
            check_push(deadline, tokens, now)
        rc = q_push(&self.q, h, deadline, tokens, now)
        if rc == -2:
            raise ValueError(f"handle {h} is already queued; remove it first")
        if rc < 0:
            raise MemoryError("RequestQueue: out of memory")

    def peek(self):
        """Most urgent handle, left in the queue; IndexError when empty."""
        if self.q.size == 0:
            raise IndexError("peek from an empty RequestQueue")
        return self.q.entries[self.q.heap[0].slot].handle

    def pop(self):
        """Remove and return the most urgent handle; IndexError when empty."""
        if self.q.size == 0:
            raise IndexError("pop from an empty RequestQueue")
        return q_remove_at(&self.q, 0)

    def remove(self, handle):
        """Drop a queued handle (cancellation); ValueError when it is not queued."""
        cdef int64_t h
        try:
            h = PyNumber_Index(handle)
        except OverflowError:
            raise ValueError(f"handle {handle!r} is not in the queue") from None
        if not q_remove(&self.q, h):
            raise ValueError(f"handle {handle!r} is not in the queue")

    def rekey(self, double now):
        """One nogil pass: every entry waits one more step, keys recomputed for `now`, re-heapify."""
        if not isfinite(now):
            check_now(now)
        with nogil:
            q_rekey(&self.q, now)

    def handles_in_order(self):
        """Every queued handle, most urgent first (for tests and inspection; O(n log n))."""
        cdef Py_ssize_t n = self.q.size
        cdef Py_ssize_t i
        cdef Node* nodes = <Node*>malloc((n if n > 0 else 1) * sizeof(Node))
        if nodes == NULL:
            raise MemoryError("RequestQueue: out of memory")
        try:
            for i in range(n):
                nodes[i] = self.q.heap[i]
            with nogil:
                qsort(nodes, n, sizeof(Node), node_cmp)
            return [self.q.entries[nodes[i].slot].handle for i in range(n)]
        finally:
            free(nodes)


def target_batch_size(max_batch, queue_depth, double decay=0.9):
    """ceil(max_batch * (1 - decay ** queue_depth)), at least 1 while anything waits, 0 if none."""
    cdef long long batch = PyNumber_Index(max_batch)
    cdef long long depth = PyNumber_Index(queue_depth)
    cdef double target
    if batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch!r}")
    if depth < 0:
        raise ValueError(f"queue_depth must be >= 0, got {queue_depth!r}")
    if not (0.0 < decay < 1.0):
        raise ValueError(f"decay must be in (0, 1) (0.85-0.95 is the useful range), got {decay!r}")
    if depth == 0:
        return 0
    target = ceil(<double>batch * (1.0 - pow(decay, <double>depth)))
    if target < 1.0:
        return 1
    return batch if target > <double>batch else <long long>target


include "_queue_bench.pxi"
