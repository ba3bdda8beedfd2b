# cython: language_level=3
# distutils: extra_compile_args = -fopenmp
# distutils: extra_link_args = -fopenmp
# distutils: include_dirs = hotpath
"""Paged decode attention on the CPU, reading K/V pages in place (no gather, no mask tensors).

One query token per sequence attends to positions 0 .. seq_len-1 of its own pages::

    k_cache, v_cache  [P, page, Hkv, D] float32 or bf16 (widened in registers), or int8 rows of
                      D values and their bf16 scale ([P, page, Hkv, D + 2] bytes); contiguous
                      (one layer of the pool)
    q, out            [S, Hq, D] float32, contiguous; query head h reads KV head h // (Hq / Hkv)
    block_tables      [S, W] int32; position p of sequence s lives in page block_tables[s, p // page]
    seq_lens          [S] int32

Consecutive rows whose lengths count up by one over the same pages (one sequence's verify
rows or chunk tokens) attend together, reading each page once for all of them (up to 16 rows: a
run). Work items are runs (every KV head: whole rows of each page) or, while there are fewer
than two runs per thread, (run, KV head) pairs, spread over OpenMP threads (`prange`, nogil). Each item (`_paged_attention_item.h`, C built for several instruction sets) scores its
query heads against every key it owns (one pass over K, page by page, the next page
prefetched), softmaxes in float32 with the running maximum subtracted, and accumulates V (one
pass over V). A head's result is the same bits whichever items the batch is cut into. Slots past seq_len are never read, so whatever
the pool holds there (NaN included) cannot leak in.

The pure-torch twin is `SdpaBackend`'s gather path; SLOSERVE_NO_EXTENSIONS=1 selects it.
"""

from cython.parallel cimport prange
from libc.stdint cimport int8_t, int32_t, int64_t, uint16_t, uintptr_t
from libc.stdlib cimport free, malloc


# Multiply-adds below which one thread runs the whole call (~20 us of arithmetic).
cdef enum:
    _SERIAL_WORK = 1 << 18


cdef extern from "_paged_attention_item.h" nogil:
    int sloserve_paged_item_f32(const float* q, Py_ssize_t q_stride, Py_ssize_t rows, const float* k_cache,
                                const float* v_cache, const int32_t* table, Py_ssize_t seq_len, Py_ssize_t kv_head,
                                Py_ssize_t kv_count, Py_ssize_t group, Py_ssize_t hkv, Py_ssize_t dim,
                                Py_ssize_t page, Py_ssize_t num_pages, float scale, float* scores, float* out,
                                Py_ssize_t out_stride)
    int sloserve_paged_item_bf16(const float* q, Py_ssize_t q_stride, Py_ssize_t rows, const uint16_t* k_cache,
                                 const uint16_t* v_cache, const int32_t* table, Py_ssize_t seq_len,
                                 Py_ssize_t kv_head, Py_ssize_t kv_count, Py_ssize_t group, Py_ssize_t hkv,
                                 Py_ssize_t dim, Py_ssize_t page, Py_ssize_t num_pages, float scale, float* scores,
                                 float* out, Py_ssize_t out_stride)
    int sloserve_paged_item_kv8(const float* q, Py_ssize_t q_stride, Py_ssize_t rows, const int8_t* k_cache,
                                const int8_t* v_cache, const int32_t* table, Py_ssize_t seq_len, Py_ssize_t kv_head,
                                Py_ssize_t kv_count, Py_ssize_t group, Py_ssize_t hkv, Py_ssize_t dim,
                                Py_ssize_t page, Py_ssize_t num_pages, float scale, float* scores, float* out,
                                Py_ssize_t out_stride)
    Py_ssize_t sloserve_item_kv_heads(Py_ssize_t seqs, Py_ssize_t hkv, int threads)
    Py_ssize_t sloserve_row_runs(const int32_t* tables, Py_ssize_t width, const int32_t* lens, Py_ssize_t page,
                                 Py_ssize_t batch, Py_ssize_t* first)
    enum: SLOSERVE_ROWS_PER_ITEM
    void sloserve_kv8_store(int8_t* row, const float* v, Py_ssize_t n)


def write_int8_rows(uintptr_t rows, uintptr_t cache, uintptr_t slots, Py_ssize_t num_tokens, Py_ssize_t heads,
                    Py_ssize_t head_dim, Py_ssize_t num_slots):
    """cache[slots[t], h] = row h of token t quantized (kv_int8.quantize_rows' bytes): rows float32
    [T, heads, head_dim] and slots int64 [T], contiguous; cache [num_slots, heads, head_dim + 2]
    int8. ValueError, before anything is written, when a slot is outside [0, num_slots)."""
    cdef const float* src = <const float*> rows
    cdef int8_t* dst = <int8_t*> cache
    cdef const int64_t* sp = <const int64_t*> slots
    cdef Py_ssize_t t, h, pitch = head_dim + 2
    for t in range(num_tokens):
        if sp[t] < 0 or sp[t] >= num_slots:
            raise ValueError(f"slot {sp[t]} of token {t} is outside the cache's [0, {num_slots})")
    with nogil:
        for t in range(num_tokens):
            for h in range(heads):
                sloserve_kv8_store(dst + (sp[t] * heads + h) * pitch, src + (t * heads + h) * head_dim, head_dim)


def paged_decode(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_tables, uintptr_t seq_lens,
                 uintptr_t out, Py_ssize_t num_seqs, Py_ssize_t num_heads, Py_ssize_t num_kv_heads,
                 Py_ssize_t head_dim, Py_ssize_t page, Py_ssize_t num_pages, Py_ssize_t table_width,
                 float scale, int num_threads, bint kv_bf16=False, bint kv_int8=False):
    """out[S, Hq, D] = softmax(q k^T * scale) v over each sequence's pages, read in place.

    Arguments are data pointers of contiguous CPU tensors (the caller checks dtypes, shapes and
    contiguity; see sloserve.layers.attention.paged): q and out float32, the caches float32, bf16
    (uint16) with kv_bf16, or int8 rows with their scales with kv_int8 (head_dim counts the values
    only). ValueError when a sequence's length needs
    more pages than its table row holds or names a page outside the pool; then `out` is undefined.
    """
    if num_seqs <= 0:
        return
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads or head_dim <= 0 or page <= 0:
        raise ValueError(f"bad shapes: {num_heads} query heads, {num_kv_heads} KV heads, head_dim {head_dim}, "
                         f"page {page}")
    cdef const float* qp = <const float*> q
    cdef const int32_t* tp = <const int32_t*> block_tables
    cdef const int32_t* lp = <const int32_t*> seq_lens
    cdef float* op = <float*> out
    cdef Py_ssize_t group = num_heads // num_kv_heads
    cdef Py_ssize_t longest = 0, i, r, s, n, h, seq_len, per_item, items, runs, row_tile
    cdef Py_ssize_t row = num_heads * head_dim
    cdef int bad = 0
    cdef float* scores
    cdef Py_ssize_t* first
    for s in range(num_seqs):
        seq_len = lp[s]
        if seq_len < 1 or seq_len > table_width * page:
            raise ValueError(f"sequence {s} has length {seq_len}, outside 1..{table_width * page} "
                             f"(its block table holds {table_width} pages of {page})")
        if seq_len > longest:
            longest = seq_len
    if num_threads < 1 or num_seqs * num_heads * longest * head_dim < _SERIAL_WORK:
        num_threads = 1  # waking a sleeping OpenMP team costs more than a small step's arithmetic
    first = <Py_ssize_t*> malloc((num_seqs + 1) * sizeof(Py_ssize_t))
    if first == NULL:
        raise MemoryError("paged_decode: cannot allocate the runs")
    runs = sloserve_row_runs(tp, table_width, lp, page, num_seqs, first)
    row_tile = min(num_seqs, SLOSERVE_ROWS_PER_ITEM)
    per_item = sloserve_item_kv_heads(runs, num_kv_heads, num_threads)
    items = runs * (num_kv_heads // per_item)
    with nogil:
        for i in prange(items, num_threads=num_threads, schedule="dynamic"):
            scores = <float*> malloc(row_tile * per_item * group * longest * sizeof(float))
            if scores == NULL:
                bad |= 2  # a reduction: the only way a prange body may write a shared variable
            else:
                r = (i * per_item) // num_kv_heads
                h = (i * per_item) % num_kv_heads
                s = first[r]
                n = first[r + 1] - s
                if kv_int8:
                    bad |= -sloserve_paged_item_kv8(qp + s * row + h * group * head_dim, row, n,
                                                    <const int8_t*> k_cache, <const int8_t*> v_cache,
                                                    tp + s * table_width, lp[s], h, per_item, group, num_kv_heads,
                                                    head_dim, page, num_pages, scale, scores,
                                                    op + s * row + h * group * head_dim, row)
                elif kv_bf16:
                    bad |= -sloserve_paged_item_bf16(qp + s * row + h * group * head_dim, row, n,
                                                     <const uint16_t*> k_cache, <const uint16_t*> v_cache,
                                                     tp + s * table_width, lp[s], h, per_item, group, num_kv_heads,
                                                     head_dim, page, num_pages, scale, scores,
                                                     op + s * row + h * group * head_dim, row)
                else:
                    bad |= -sloserve_paged_item_f32(qp + s * row + h * group * head_dim, row, n,
                                                    <const float*> k_cache, <const float*> v_cache,
                                                    tp + s * table_width, lp[s], h, per_item, group, num_kv_heads,
                                                    head_dim, page, num_pages, scale, scores,
                                                    op + s * row + h * group * head_dim, row)
                free(scores)
    free(first)
    if bad & 2:
        raise MemoryError("paged_decode: cannot allocate the scores buffer")
    if bad & 1:
        raise ValueError(f"a block table names a page outside [0, {num_pages})")
