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

from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.number cimport PyNumber_Index
from libc.math cimport INFINITY, ceil, isfinite, isnan, pow
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc, qsort, realloc

from _hashmap cimport I64Map, map_del, map_find, map_free, map_init, map_put

from ._limits import MAX_QUEUE_CAPACITY, MAX_QUEUE_ENTRIES, busy_error
from ._queue_py import (
    check_handle,
    check_now,
    check_push,
    check_queue_args,
    queue_full_error,
)
from ._queue_py import target_batch_size as _py_target_batch_size

include "_queue_core.pxi"

if MAX_QUEUE_ENTRIES != QUEUE_MAX_ENTRIES:
    raise ImportError("_queue: QUEUE_MAX_ENTRIES disagrees with _limits.MAX_QUEUE_ENTRIES")


cdef class RequestQueue:
    """SLO priority queue over caller-chosen int handles; see the module docstring for the order.

    Not thread-safe: callers serialise (see `_limits`); a call that overlaps another call on the
    same queue raises RuntimeError and changes nothing. `rekey` and `handles_in_order` run their
    O(n) passes without the GIL; every other method is O(log n) or O(1) and keeps it.
    """

    cdef Queue q
    cdef int _busy  # set for the duration of every call that touches the tables
    cdef readonly double aging
    cdef readonly double max_wait_s
    cdef readonly double length_weight_s
    # GIL-release test hook (`_set_gil_probe`); NULL in normal use.
    cdef const int64_t* _probe
    cdef object _probe_owner
    cdef int64_t _probe_target
    cdef int64_t _probe_max_spins
    cdef bint _probe_hold_gil
    cdef readonly int64_t _probe_advance

    def __cinit__(self, *args, **kwargs):
        # A valid empty queue with the default parameters, so an instance whose __init__ never
        # ran (cls.__new__(cls)) works like RequestQueue() with capacity 0.
        self.aging = 0.95
        self.max_wait_s = 0.2
        self.length_weight_s = 1e-4
        if q_init(&self.q, 0, self.aging, self.max_wait_s, self.length_weight_s) < 0:
            q_free(&self.q)
            raise MemoryError("RequestQueue: out of memory")

    def __init__(self, double aging=0.95, double max_wait_s=0.2, double length_weight_s=1e-4,
                 capacity=1024):
        cdef Queue fresh
        cap = PyNumber_Index(capacity)
        check_queue_args(aging, max_wait_s, length_weight_s, cap)
        if q_init(&fresh, <Py_ssize_t>cap, aging, max_wait_s, length_weight_s) < 0:
            q_free(&fresh)
            raise MemoryError(f"RequestQueue: out of memory for capacity {cap}")
        if self._busy:
            q_free(&fresh)
            raise busy_error("RequestQueue", "__init__")
        q_free(&self.q)
        self.q = fresh
        self.aging = aging
        self.max_wait_s = max_wait_s
        self.length_weight_s = length_weight_s

    def __dealloc__(self):
        q_free(&self.q)

    cdef inline int _enter(self, str method) except -1:
        if self._busy:
            raise busy_error("RequestQueue", method)
        self._busy = 1
        return 0

    def __len__(self):
        return self.q.size

    def __contains__(self, handle):
        cdef int overflow = 0
        cdef int64_t h
        try:
            value = PyNumber_Index(handle)
        except TypeError:
            return False
        h = PyLong_AsLongLongAndOverflow(value, &overflow)
        if overflow:
            return False
        self._enter("__contains__")
        try:
            return map_find(&self.q.index, h) >= 0
        finally:
            self._busy = 0

    def push(self, handle, double deadline, prompt_tokens, double now):
        """Queue `handle`; deadline is the absolute time.monotonic() of its SLO."""
        cdef int overflow = 0
        cdef int64_t h, tokens
        cdef int rc
        handle = PyNumber_Index(handle)
        h = PyLong_AsLongLongAndOverflow(handle, &overflow)
        if overflow:
            check_handle(handle)
        prompt_tokens = PyNumber_Index(prompt_tokens)
        tokens = PyLong_AsLongLongAndOverflow(prompt_tokens, &overflow)
        if (overflow or tokens < 0 or isnan(deadline) or deadline == -INFINITY
                or not isfinite(now)):
            check_push(deadline, prompt_tokens, now)
        self._enter("push")
        try:
            rc = q_push(&self.q, h, deadline, tokens, now)
        finally:
            self._busy = 0
        if rc == -2:
            raise ValueError(f"handle {h} is already queued; remove it first")
        if rc == QUEUE_FULL:
            raise queue_full_error()
        if rc < 0:
            raise MemoryError("RequestQueue: out of memory")

    def peek(self):
        """Most urgent handle, left in the queue; IndexError when empty."""
        self._enter("peek")
        try:
            if self.q.size == 0:
                raise IndexError("peek from an empty RequestQueue")
            return self.q.entries[self.q.heap[0].slot].handle
        finally:
            self._busy = 0

    def pop(self):
        """Remove and return the most urgent handle; IndexError when empty."""
        self._enter("pop")
        try:
            if self.q.size == 0:
                raise IndexError("pop from an empty RequestQueue")
            return q_remove_at(&self.q, 0)
        finally:
            self._busy = 0

    def remove(self, handle):
        """Drop a queued handle (cancellation); ValueError when it is not queued."""
        cdef int overflow = 0
        cdef int64_t h
        cdef bint found = False
        handle = PyNumber_Index(handle)
        h = PyLong_AsLongLongAndOverflow(handle, &overflow)
        self._enter("remove")
        try:
            found = not overflow and q_remove(&self.q, h)
        finally:
            self._busy = 0
        if not found:
            raise ValueError(f"handle {handle!r} is not in the queue")

    def rekey(self, double now):
        """One nogil pass: every entry waits one more step, keys recomputed for `now`, re-heapify."""
        if not isfinite(now):
            check_now(now)
        self._enter("rekey")
        try:
            if self._probe_hold_gil:
                self._rekey_section(now)
            else:
                with nogil:
                    self._rekey_section(now)
        finally:
            self._busy = 0

    cdef void _rekey_section(self, double now) noexcept nogil:
        cdef int64_t start = 0
        if self._probe != NULL:
            start = probe_read(self._probe)
        q_rekey(&self.q, now)
        if self._probe != NULL:
            self._probe_advance = probe_wait(self._probe, start, self._probe_target,
                                             self._probe_max_spins)

    def handles_in_order(self):
        """Every queued handle, most urgent first (for tests and inspection; O(n log n))."""
        cdef Py_ssize_t n, i
        cdef Node* nodes
        self._enter("handles_in_order")
        try:
            n = self.q.size
            nodes = <Node*>malloc((n if n > 0 else 1) * sizeof(Node))
            if nodes == NULL:
                raise MemoryError("RequestQueue: out of memory")
            try:
                for i in range(n):
                    nodes[i] = self.q.heap[i]
                if self._probe_hold_gil:
                    self._sort_section(nodes, n)
                else:
                    with nogil:
                        self._sort_section(nodes, n)
                return [self.q.entries[nodes[i].slot].handle for i in range(n)]
            finally:
                free(nodes)
        finally:
            self._busy = 0

    cdef void _sort_section(self, Node* nodes, Py_ssize_t n) noexcept nogil:
        cdef int64_t start = 0
        if self._probe != NULL:
            start = probe_read(self._probe)
        qsort(nodes, n, sizeof(Node), node_cmp)
        if self._probe != NULL:
            self._probe_advance = probe_wait(self._probe, start, self._probe_target,
                                             self._probe_max_spins)

    def _set_gil_probe(self, int64_t[::1] probe=None, int64_t target=0,
                       int64_t max_spins=0, bint release_gil=True):
        """Test hook (tests/hotpath/test_gil.py): each GIL-free section then waits for probe[0].

        With a probe, the sections of `rekey` and `handles_in_order` read probe[0] when they
        start and, after their work, spin until it has advanced by `target` (at most max_spins
        reads), recording the advance in `_probe_advance`. Only a Python thread can advance it,
        so an advance proves the section ran without the GIL; release_gil=False runs the same
        sections holding it (the control). probe=None switches the hook off.
        """
        self._enter("_set_gil_probe")
        try:
            self._probe = NULL if probe is None else &probe[0]
            self._probe_owner = probe
            self._probe_target = target
            self._probe_max_spins = max_spins
            self._probe_hold_gil = not release_gil
            self._probe_advance = 0
        finally:
            self._busy = 0


def target_batch_size(max_batch, queue_depth, double decay=0.9):
    """ceil(max_batch * (1 - decay ** queue_depth)), at least 1 while anything waits, 0 if none."""
    cdef int overflow_b = 0, overflow_d = 0
    cdef long long batch, depth
    cdef double target
    max_batch = PyNumber_Index(max_batch)
    queue_depth = PyNumber_Index(queue_depth)
    batch = PyLong_AsLongLongAndOverflow(max_batch, &overflow_b)
    depth = PyLong_AsLongLongAndOverflow(queue_depth, &overflow_d)
    if overflow_b or overflow_d or batch > (1LL << 53):
        # Past 2**53 a double no longer holds every batch size: the twin's exact integers.
        return _py_target_batch_size(max_batch, queue_depth, decay)
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
