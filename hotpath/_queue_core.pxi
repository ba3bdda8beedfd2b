# Included by _queue.pyx: the C structs and `noexcept nogil` cores of the request queue.
# The ordering rules are in the module docstring of _queue.pyx.

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
    Py_ssize_t pos  # index of this entry's node in the heap; next free slot while unused


ctypedef struct Queue:
    Node* heap
    Entry* entries
    Py_ssize_t size  # queued entries = heap nodes
    Py_ssize_t cap  # allocated nodes and entries
    Py_ssize_t slots_used  # entries ever handed out (high-water mark)
    Py_ssize_t free_slot  # head of the free-slot list threaded through Entry.pos, or -1
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


cdef enum:
    QUEUE_MAX_ENTRIES = 2147483647  # _limits.MAX_QUEUE_ENTRIES: Node.slot is an int32
    QUEUE_FULL = -3


cdef int q_reserve(Queue* q, Py_ssize_t need) noexcept nogil:
    """Grow both arrays to hold `need` entries; -1 when out of memory, QUEUE_FULL past the limit."""
    cdef Py_ssize_t cap = q.cap if q.cap > 0 else 16
    cdef void* p
    if need <= q.cap:
        return 0
    if need > QUEUE_MAX_ENTRIES:
        return QUEUE_FULL
    while cap < need:  # need <= 2**31 - 1, so cap <= 2**31 and the byte sizes cannot wrap
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
    """Initialise a Queue whose memory may be garbage; -1 when out of memory (then q_free it)."""
    q.heap = NULL
    q.entries = NULL
    q.size = 0
    q.cap = 0
    q.slots_used = 0
    q.free_slot = -1
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
    q.slots_used = 0
    q.free_slot = -1


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
    """0 when queued, -1 when out of memory, -2 when the handle is already queued, QUEUE_FULL."""
    cdef Py_ssize_t s = q.free_slot
    cdef Py_ssize_t i = q.size
    cdef Entry* e
    cdef int rc
    if map_find(&q.index, handle) >= 0:
        return -2
    if s < 0:
        s = q.slots_used
        rc = q_reserve(q, s + 1)
        if rc < 0:
            return rc
    if map_put(&q.index, handle, s) < 0:
        return -1
    if s == q.slots_used:
        q.slots_used += 1
    else:
        q.free_slot = q.entries[s].pos
    e = &q.entries[s]
    e.handle = handle
    e.deadline = deadline
    e.length_term = q.length_weight * <double>tokens
    e.push_time = now
    e.steps = 0
    q.heap[i].key = entry_key(deadline, now, e.length_term, 0, q.aging)
    q.heap[i].seq = q.next_seq
    q.heap[i].starved = 0
    q.heap[i].slot = <int32_t>s
    q.next_seq += 1
    q.size = i + 1
    sift_up(q, i)
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
    q.entries[s].pos = q.free_slot  # the entry's slot joins the free-slot list
    q.free_slot = s
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


cdef inline int64_t probe_read(const int64_t* p) noexcept nogil:
    return (<volatile const int64_t*>p)[0]


cdef int64_t probe_wait(const int64_t* p, int64_t start, int64_t target,
                        int64_t max_spins) noexcept nogil:
    """Spin until probe[0] has advanced by target since start (or max_spins reads); the advance."""
    cdef int64_t seen = probe_read(p)
    cdef int64_t spins = 0
    while seen - start < target and spins < max_spins:
        spins += 1
        seen = probe_read(p)
    return seen - start
