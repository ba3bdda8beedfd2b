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

Layout: entries live in a dense array of `Entry` structs (slot = index < size; removing one
moves the last entry into the hole); the heap is an array of `Node` (key, seq, starved, slot) so
comparisons read contiguous memory; `Entry.pos` is the node's heap index and a C hash map sends
a handle to its slot, which makes remove-by-handle O(log n). No Python object per entry.
"""

from cpython.number cimport PyNumber_Index
from libc.math cimport INFINITY, ceil, isfinite, isnan, pow
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc, qsort, realloc

from _hashmap cimport I64Map, map_del, map_find, map_free, map_init, map_put

from ._queue_py import check_handle, check_now, check_push, check_queue_args

cdef double MIN_SCALE = 1e-300


ctypedef struct Node:
    double key
    uint64_t seq
    int32_t starved
    int32_t slot


ctypedef struct Entry:  # one cache line per queued request
    int64_t handle
    double deadline
    double length_term
    double push_time
    int64_t steps
    Py_ssize_t pos  # index of this entry's node in the heap


ctypedef struct Queue:
    Node* heap
    Entry* entries
    Py_ssize_t size
    Py_ssize_t cap
    uint64_t next_seq
    double aging
    double max_wait
    double length_weight
    I64Map index


cdef inline double entry_key(double deadline, double now, double length_term, int64_t steps,
                             double aging) noexcept nogil:
    cdef double base = (deadline - now) + length_term
    cdef double scale = pow(aging, <double>steps)
    if scale < MIN_SCALE:
        scale = MIN_SCALE
    return base * scale if base >= 0.0 else base / scale


cdef inline bint node_less(const Node* a, const Node* b) noexcept nogil:
    if a.starved != b.starved:
        return a.starved > b.starved
    if not a.starved:
        if a.key < b.key:
            return True
        if a.key > b.key:
            return False
    return a.seq < b.seq


cdef int node_cmp(const void* a, const void* b) noexcept nogil:
    if node_less(<const Node*>a, <const Node*>b):
        return -1
    return 1 if node_less(<const Node*>b, <const Node*>a) else 0


cdef int q_reserve(Queue* q, Py_ssize_t need) noexcept nogil:
    """Grow both arrays to hold `need` entries; -1 when out of memory."""
    cdef Py_ssize_t cap = q.cap if q.cap > 0 else 16
    cdef void* p
    if need <= q.cap:
        return 0
    while cap < need:
        cap *= 2
    p = realloc(q.heap, cap * sizeof(Node))
    if p == NULL:
        return -1
    q.heap = <Node*>p
    p = realloc(q.entries, cap * sizeof(Entry))
    if p == NULL:
        return -1
    q.entries = <Entry*>p
    q.cap = cap
    return 0


cdef int q_init(Queue* q, Py_ssize_t capacity, double aging, double max_wait,
                double length_weight) noexcept nogil:
    """Initialise a Queue whose memory may be garbage; -1 when out of memory."""
    q.heap = NULL
    q.entries = NULL
    q.size = 0
    q.cap = 0
    q.next_seq = 0
    q.aging = aging
    q.max_wait = max_wait
    q.length_weight = length_weight
    if map_init(&q.index, capacity) < 0:
        return -1
    return q_reserve(q, capacity if capacity > 16 else 16)


cdef void q_free(Queue* q) noexcept nogil:
    free(q.heap)
    free(q.entries)
    map_free(&q.index)
    q.heap = NULL
    q.entries = NULL
    q.size = 0
    q.cap = 0


cdef inline void sift_up(Queue* q, Py_ssize_t i) noexcept nogil:
    cdef Node node = q.heap[i]
    cdef Py_ssize_t parent
    while i > 0:
        parent = (i - 1) >> 1
        if not node_less(&node, &q.heap[parent]):
            break
        q.heap[i] = q.heap[parent]
        q.entries[q.heap[i].slot].pos = i
        i = parent
    q.heap[i] = node
    q.entries[node.slot].pos = i


cdef inline void sift_down(Queue* q, Py_ssize_t i) noexcept nogil:
    cdef Node node = q.heap[i]
    cdef Py_ssize_t n = q.size
    cdef Py_ssize_t child
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and node_less(&q.heap[child + 1], &q.heap[child]):
            child += 1
        if not node_less(&q.heap[child], &node):
            break
        q.heap[i] = q.heap[child]
        q.entries[q.heap[i].slot].pos = i
        i = child
    q.heap[i] = node
    q.entries[node.slot].pos = i


cdef int q_push(Queue* q, int64_t handle, double deadline, int64_t tokens,
                double now) noexcept nogil:
    """0 when queued, -1 when out of memory, -2 when the handle is already queued."""
    cdef Py_ssize_t s = q.size
    cdef Entry* e
    if map_find(&q.index, handle) >= 0:
        return -2
    if q_reserve(q, s + 1) < 0 or map_put(&q.index, handle, s) < 0:
        return -1
    e = &q.entries[s]
    e.handle = handle
    e.deadline = deadline
    e.length_term = q.length_weight * <double>tokens
    e.push_time = now
    e.steps = 0
    q.heap[s].key = entry_key(deadline, now, e.length_term, 0, q.aging)
    q.heap[s].seq = q.next_seq
    q.heap[s].starved = 0
    q.heap[s].slot = <int32_t>s
    q.next_seq += 1
    q.size = s + 1
    sift_up(q, s)
    return 0


cdef int64_t q_remove_at(Queue* q, Py_ssize_t i) noexcept nogil:
    """Remove the node at heap index i; return its handle."""
    cdef Py_ssize_t s = q.heap[i].slot
    cdef Py_ssize_t last
    cdef int64_t handle = q.entries[s].handle
    q.size -= 1
    last = q.size
    if i != last:
        q.heap[i] = q.heap[last]
        q.entries[q.heap[i].slot].pos = i
        if i > 0 and node_less(&q.heap[i], &q.heap[(i - 1) >> 1]):
            sift_up(q, i)
        else:
            sift_down(q, i)
    map_del(&q.index, handle)
    if s != last:  # keep slots dense: move the last entry into the hole
        q.entries[s] = q.entries[last]
        q.heap[q.entries[s].pos].slot = <int32_t>s
        q.index.cells[map_find(&q.index, q.entries[s].handle)].val = s
    return handle


cdef bint q_remove(Queue* q, int64_t handle) noexcept nogil:
    cdef Py_ssize_t at = map_find(&q.index, handle)
    if at < 0:
        return False
    q_remove_at(q, q.entries[q.index.cells[at].val].pos)
    return True


cdef void q_rekey(Queue* q, double now) noexcept nogil:
    cdef Py_ssize_t i
    cdef Node* node
    cdef Entry* e
    for i in range(q.size):
        node = &q.heap[i]
        e = &q.entries[node.slot]
        e.steps += 1
        if node.starved or now - e.push_time > q.max_wait:
            node.starved = 1
        else:
            node.key = entry_key(e.deadline, now, e.length_term, e.steps, q.aging)
    i = q.size // 2
    while i > 0:
        i -= 1
        sift_down(q, i)


cdef inline uint64_t lcg(uint64_t x) noexcept nogil:
    return x * <uint64_t>6364136223846793005ULL + <uint64_t>1442695040888963407ULL


cdef inline int64_t read_probe(const int64_t* p) noexcept nogil:
    return (<volatile const int64_t*>p)[0]


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


cpdef int target_batch_size(long long max_batch, long long queue_depth, double decay=0.9) except -1:
    """ceil(max_batch * (1 - decay ** queue_depth)), at least 1 while anything waits, 0 if none."""
    cdef double target
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch!r}")
    if queue_depth < 0:
        raise ValueError(f"queue_depth must be >= 0, got {queue_depth!r}")
    if not (0.0 < decay < 1.0):
        raise ValueError(f"decay must be in (0, 1) (0.85-0.95 is the useful range), got {decay!r}")
    if queue_depth == 0:
        return 0
    target = ceil(<double>max_batch * (1.0 - pow(decay, <double>queue_depth)))
    if target < 1.0:
        return 1
    return <int>max_batch if target > <double>max_batch else <int>target


include "_queue_bench.pxi"
