/* The kernels of _paged_attention_item.h that read rows of one element type: included once per
 * type (no include guard), after the includer defines
 *
 *     SLOSERVE_T            the element type (float, or uint16_t holding bf16)
 *     SLOSERVE_T_NAME(f)    f's name for this type (f_f32, f_bf16)
 *     SLOSERVE_T_LOAD8(p)   eight elements at p as float lanes (sloserve_v8)
 *     SLOSERVE_T_AT(p, i)   element i of p as a float
 *
 * and, for KV rows that carry a scale after their values (int8 pages), optionally
 *
 *     SLOSERVE_T_PITCH(dim)           elements from one (position, KV head) row to the next
 *                                     (default: dim)
 *     SLOSERVE_T_ROW_SCALE(row, dim)  the float a row's values are multiplied by
 *
 * and undefines them. The other operand (queries, activations, scores) and every sum are float32,
 * in the same lanes and order whatever the type, so the float32 instance gives the bits these
 * kernels gave before they were typed, and a row's result never depends on the batch, the
 * thread or the instruction set.
 */

#ifndef SLOSERVE_T_PITCH
#define SLOSERVE_T_PITCH(dim) (dim)
#endif

/* sloserve_dot's sum (8 lanes, the tail to lane 0, then the fold) of float a against typed b. */
SLOSERVE_INLINE float SLOSERVE_T_NAME(sloserve_dot)(const float *a, const SLOSERVE_T *b, ptrdiff_t n) {
    float acc[SLOSERVE_LANES] = {0};
    ptrdiff_t d = 0;
    for (; d + SLOSERVE_LANES <= n; d += SLOSERVE_LANES)
        for (int j = 0; j < SLOSERVE_LANES; j++) acc[j] += a[d + j] * SLOSERVE_T_AT(b, d + j);
    for (; d < n; d++) acc[0] += a[d] * SLOSERVE_T_AT(b, d);
    for (int width = SLOSERVE_LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) acc[j] += acc[j + width];
    return acc[0];
}

/* out[r] = sloserve_dot(q, rows + r * stride, dim) for r < 4, the same bits; dim a multiple of 8. */
SLOSERVE_INLINE sloserve_v4 SLOSERVE_T_NAME(sloserve_dot4_strided)(const float *q, const SLOSERVE_T *rows,
                                                                   ptrdiff_t stride, ptrdiff_t dim) {
    sloserve_v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (ptrdiff_t d = 0; d < dim; d += 8) {
        const sloserve_v8 qv = sloserve_load8(q + d);
        a0 += SLOSERVE_T_LOAD8(rows + d) * qv;
        a1 += SLOSERVE_T_LOAD8(rows + stride + d) * qv;
        a2 += SLOSERVE_T_LOAD8(rows + 2 * stride + d) * qv;
        a3 += SLOSERVE_T_LOAD8(rows + 3 * stride + d) * qv;
    }
    return sloserve_fold4(a0, a1, a2, a3);
}

/* The products past the last multiple of 8 go to lane 0, as sloserve_dot sums them. */
SLOSERVE_INLINE sloserve_v8 SLOSERVE_T_NAME(sloserve_tail)(sloserve_v8 acc, const SLOSERVE_T *w, const float *x,
                                                           ptrdiff_t d, ptrdiff_t k) {
    for (; d < k; d++) acc[0] += SLOSERVE_T_AT(w, d) * x[d];
    return acc;
}

/* Four rows (rows, rows + stride, ...) against two vectors q0, q1 of `dim` floats: each row load
 * serves both (eight independent sums, where one vector's four wait on the adder's latency);
 * out0[r] is sloserve_dot(q0, row r, dim), the same bits. The attention's K rows (stride: a page
 * row) and the decode step's weight rows (stride: their length) both go through here. */
SLOSERVE_INLINE void SLOSERVE_T_NAME(sloserve_dot4x2_strided)(const float *q0, const float *q1,
                                                              const SLOSERVE_T *rows, ptrdiff_t stride,
                                                              ptrdiff_t dim, sloserve_v4 *out0, sloserve_v4 *out1) {
    sloserve_v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    ptrdiff_t d = 0;
    for (; d + 8 <= dim; d += 8) {
        const sloserve_v8 u = sloserve_load8(q0 + d), v = sloserve_load8(q1 + d);
        sloserve_v8 r = SLOSERVE_T_LOAD8(rows + d);
        a0 += r * u;
        b0 += r * v;
        r = SLOSERVE_T_LOAD8(rows + stride + d);
        a1 += r * u;
        b1 += r * v;
        r = SLOSERVE_T_LOAD8(rows + 2 * stride + d);
        a2 += r * u;
        b2 += r * v;
        r = SLOSERVE_T_LOAD8(rows + 3 * stride + d);
        a3 += r * u;
        b3 += r * v;
    }
    const SLOSERVE_T *r1 = rows + stride, *r2 = rows + 2 * stride, *r3 = rows + 3 * stride;
    *out0 = sloserve_fold4(SLOSERVE_T_NAME(sloserve_tail)(a0, rows, q0, d, dim),
                           SLOSERVE_T_NAME(sloserve_tail)(a1, r1, q0, d, dim),
                           SLOSERVE_T_NAME(sloserve_tail)(a2, r2, q0, d, dim),
                           SLOSERVE_T_NAME(sloserve_tail)(a3, r3, q0, d, dim));
    *out1 = sloserve_fold4(SLOSERVE_T_NAME(sloserve_tail)(b0, rows, q1, d, dim),
                           SLOSERVE_T_NAME(sloserve_tail)(b1, r1, q1, d, dim),
                           SLOSERVE_T_NAME(sloserve_tail)(b2, r2, q1, d, dim),
                           SLOSERVE_T_NAME(sloserve_tail)(b3, r3, q1, d, dim));
}

/* out[0:64] += sum over j < n, in order, of w[j] * rows[j * stride : j * stride + 64]: the output
 * held in eight registers across the positions instead of loaded and stored at each one; every
 * element sums in the order the one-position-at-a-time loop gives it. */
SLOSERVE_INLINE void SLOSERVE_T_NAME(sloserve_weighted_rows64)(const float *w, const SLOSERVE_T *rows,
                                                               ptrdiff_t stride, ptrdiff_t n, float *out) {
    sloserve_v8 o0 = sloserve_load8(out), o1 = sloserve_load8(out + 8), o2 = sloserve_load8(out + 16);
    sloserve_v8 o3 = sloserve_load8(out + 24), o4 = sloserve_load8(out + 32), o5 = sloserve_load8(out + 40);
    sloserve_v8 o6 = sloserve_load8(out + 48), o7 = sloserve_load8(out + 56);
    for (ptrdiff_t j = 0; j < n; j++) {
        const SLOSERVE_T *row = rows + j * stride;
        const float wj = w[j];
        o0 += wj * SLOSERVE_T_LOAD8(row);
        o1 += wj * SLOSERVE_T_LOAD8(row + 8);
        o2 += wj * SLOSERVE_T_LOAD8(row + 16);
        o3 += wj * SLOSERVE_T_LOAD8(row + 24);
        o4 += wj * SLOSERVE_T_LOAD8(row + 32);
        o5 += wj * SLOSERVE_T_LOAD8(row + 40);
        o6 += wj * SLOSERVE_T_LOAD8(row + 48);
        o7 += wj * SLOSERVE_T_LOAD8(row + 56);
    }
    memcpy(out, &o0, sizeof o0);
    memcpy(out + 8, &o1, sizeof o1);
    memcpy(out + 16, &o2, sizeof o2);
    memcpy(out + 24, &o3, sizeof o3);
    memcpy(out + 32, &o4, sizeof o4);
    memcpy(out + 40, &o5, sizeof o5);
    memcpy(out + 48, &o6, sizeof o6);
    memcpy(out + 56, &o7, sizeof o7);
}

/* The same for `width` (< 64, a multiple of 8) floats, one vector at a time. */
SLOSERVE_INLINE void SLOSERVE_T_NAME(sloserve_weighted_rows8)(const float *w, const SLOSERVE_T *rows,
                                                              ptrdiff_t stride, ptrdiff_t n, ptrdiff_t width,
                                                              float *out) {
    for (ptrdiff_t c = 0; c < width; c += 8) {
        sloserve_v8 o = sloserve_load8(out + c);
        for (ptrdiff_t j = 0; j < n; j++) o += w[j] * SLOSERVE_T_LOAD8(rows + j * stride + c);
        memcpy(out + c, &o, sizeof o);
    }
}

/* Ask for the next page's rows of the item's KV heads (n rows of `width` elements, stride apart),
 * one request per 64-byte line, while this page computes: pages are scattered through the pool,
 * so the hardware's stream prefetch starts over at every one of them. */
SLOSERVE_INLINE void SLOSERVE_T_NAME(sloserve_prefetch_rows)(const SLOSERVE_T *rows, ptrdiff_t stride, ptrdiff_t n,
                                                             ptrdiff_t width) {
    for (ptrdiff_t j = 0; j < n; j++)
        for (ptrdiff_t d = 0; d < width; d += 64 / (ptrdiff_t)sizeof(SLOSERVE_T))
            __builtin_prefetch(rows + j * stride + d, 0, 0);
}

/* Scores s[j] = dot(q, row j) * scale of positions [j, n) of a page (four at a time where dim is a
 * multiple of 8, the rest one by one: the same bits either way). */
SLOSERVE_INLINE void SLOSERVE_T_NAME(sloserve_scores1)(const float *q, const SLOSERVE_T *rows, ptrdiff_t stride,
                                                       ptrdiff_t dim, ptrdiff_t j, ptrdiff_t n, float scale,
                                                       float *s) {
    if (dim % 8 == 0)
        for (; j + 4 <= n; j += 4) {
            const sloserve_v4 v = SLOSERVE_T_NAME(sloserve_dot4_strided)(q, rows + j * stride, stride, dim) * scale;
            memcpy(s + j, &v, sizeof v);
        }
    for (; j < n; j++) s[j] = SLOSERVE_T_NAME(sloserve_dot)(q, rows + j * stride, dim) * scale;
}

/* The scores of two queries at once over the first multiple of four of n positions (each K row
 * load serves both); returns where they stopped, for sloserve_scores1 to go on from. */
SLOSERVE_INLINE ptrdiff_t SLOSERVE_T_NAME(sloserve_scores2)(const float *q0, const float *q1, const SLOSERVE_T *rows,
                                                            ptrdiff_t stride, ptrdiff_t dim, ptrdiff_t n, float scale,
                                                            float *s0, float *s1) {
    ptrdiff_t j = 0;
    if (dim % 8 == 0)
        for (; j + 4 <= n; j += 4) {
            sloserve_v4 a, b;
            SLOSERVE_T_NAME(sloserve_dot4x2_strided)(q0, q1, rows + j * stride, stride, dim, &a, &b);
            a *= scale;
            b *= scale;
            memcpy(s0 + j, &a, sizeof a);
            memcpy(s1 + j, &b, sizeof b);
        }
    return j;
}

/* One work item: KV heads [kv_head, kv_head + kv_count) of one sequence for `rows` query rows,
 * row r attending to positions 0 .. seq_len + r - 1 (a decode token is one row; a verify step's
 * k + 1 rows or a prefill chunk's tokens are several), page by page (a page's rows of those heads
 * are adjacent, so an item of every KV head reads whole rows). Each page is read once for every
 * row: a K row load serves two queries (two heads, or two rows), and a V page is summed into
 * every row's output while it is in L1.
 *
 * q, out: row r's first query head at q + r * q_stride ([kv_count * group, dim] float32,
 * contiguous), out + r * out_stride; scores: rows * kv_count * group * (seq_len + rows - 1)
 * floats. Every query's scores, softmax and sums are the operations, in the order, of that row
 * alone (rows = 1), so a row's result is the same bits whatever rows and kv_count are.
 * Returns 0, or -1 when a block id is outside [0, num_pages) (then nothing is read from it).
 * Rows with a scale (SLOSERVE_T_ROW_SCALE): a score is the dot product with the row's values times
 * its scale, and a V row's weight is its probability times its scale. */
SLOSERVE_CLONES
static int SLOSERVE_T_NAME(sloserve_paged_item)(const float *q, ptrdiff_t q_stride, ptrdiff_t rows,
                                                const SLOSERVE_T *k_cache, const SLOSERVE_T *v_cache,
                                                const int32_t *table, ptrdiff_t seq_len, ptrdiff_t kv_head,
                                                ptrdiff_t kv_count, ptrdiff_t group, ptrdiff_t hkv, ptrdiff_t dim,
                                                ptrdiff_t page, ptrdiff_t num_pages, float scale, float *scores,
                                                float *out, ptrdiff_t out_stride) {
    const ptrdiff_t pitch = SLOSERVE_T_PITCH(dim); /* elements between one KV head's row and the next */
    const ptrdiff_t stride = hkv * pitch; /* elements between consecutive positions of one page */
    const ptrdiff_t heads = kv_count * group, width = kv_count * pitch; /* the item's query heads; its row elements */
    /* every query of the item (row-major: row r's heads), each with a score row of `longest` floats */
    const ptrdiff_t queries = rows * heads, longest = seq_len + rows - 1;
    const ptrdiff_t page_elems = page * stride, head_offset = kv_head * pitch, num_blocks = (longest + page - 1) / page;
    for (ptrdiff_t b = 0; b < num_blocks; b++)
        if (table[b] < 0 || table[b] >= num_pages) return -1;
    for (ptrdiff_t b = 0; b < num_blocks; b++) { /* one pass over K, page by page: every query */
        const SLOSERVE_T *page_rows = k_cache + table[b] * page_elems + head_offset;
        const ptrdiff_t first = b * page;
        if (b + 1 < num_blocks)
            SLOSERVE_T_NAME(sloserve_prefetch_rows)(k_cache + table[b + 1] * page_elems + head_offset, stride,
                                                    sloserve_page_len(longest, b + 1, page), width);
        for (ptrdiff_t kk = 0; kk < kv_count; kk++) {
            const SLOSERVE_T *krows = page_rows + kk * pitch;
            /* this KV head's (row, head) queries in order, two at a time; a later row sees as many
             * of the page's positions as an earlier one, or more */
            for (ptrdiff_t v = 0; v < rows * group; v += 2) {
                const ptrdiff_t r0 = v / group, g0 = kk * group + v % group;
                const ptrdiff_t n0 = sloserve_page_len(seq_len + r0, b, page);
                const float *q0 = q + r0 * q_stride + g0 * dim;
                float *s0 = scores + (r0 * heads + g0) * longest + first;
                ptrdiff_t j = 0;
                if (v + 1 < rows * group) {
                    const ptrdiff_t r1 = (v + 1) / group, g1 = kk * group + (v + 1) % group;
                    const ptrdiff_t n1 = sloserve_page_len(seq_len + r1, b, page);
                    const float *q1 = q + r1 * q_stride + g1 * dim;
                    float *s1 = scores + (r1 * heads + g1) * longest + first;
                    if (n0 > 0) j = SLOSERVE_T_NAME(sloserve_scores2)(q0, q1, krows, stride, dim, n0, scale, s0, s1);
                    SLOSERVE_T_NAME(sloserve_scores1)(q1, krows, stride, dim, j, n1, scale, s1);
                }
                SLOSERVE_T_NAME(sloserve_scores1)(q0, krows, stride, dim, j, n0, scale, s0);
            }
#ifdef SLOSERVE_T_ROW_SCALE
            for (ptrdiff_t j = 0; j < sloserve_page_len(longest, b, page); j++) {
                const float row_scale = SLOSERVE_T_ROW_SCALE(krows + j * stride, dim);
                for (ptrdiff_t r = 0; r < rows; r++)
                    if (j < sloserve_page_len(seq_len + r, b, page))
                        for (ptrdiff_t g = kk * group; g < (kk + 1) * group; g++)
                            scores[(r * heads + g) * longest + first + j] *= row_scale;
            }
#endif
        }
    }
    for (ptrdiff_t v = 0; v < queries; v++) { /* softmax, running maximum subtracted */
        const ptrdiff_t len = seq_len + v / heads;
        float *s = scores + v * longest, m = s[0], acc[SLOSERVE_LANES] = {0};
        for (ptrdiff_t p = 1; p < len; p++) m = s[p] > m ? s[p] : m;
        for (ptrdiff_t p = 0; p < len; p++) s[p] = sloserve_exp_nonpositive(s[p] - m);
        ptrdiff_t p = 0;
        for (; p + SLOSERVE_LANES <= len; p += SLOSERVE_LANES)
            for (int j = 0; j < SLOSERVE_LANES; j++) acc[j] += s[p + j];
        for (; p < len; p++) acc[0] += s[p];
        for (int lanes = SLOSERVE_LANES / 2; lanes > 0; lanes /= 2)
            for (int j = 0; j < lanes; j++) acc[j] += acc[j + lanes];
        const float inv = 1.0f / acc[0];
        for (ptrdiff_t p = 0; p < len; p++) s[p] *= inv;
        float *o = out + (v / heads) * out_stride + (v % heads) * dim;
        for (ptrdiff_t d = 0; d < dim; d++) o[d] = 0.0f;
    }
    for (ptrdiff_t b = 0; b < num_blocks; b++) { /* one pass over V, in the same position order */
        const SLOSERVE_T *page_rows = v_cache + table[b] * page_elems + head_offset;
        const ptrdiff_t first = b * page;
        if (b + 1 < num_blocks)
            SLOSERVE_T_NAME(sloserve_prefetch_rows)(v_cache + table[b + 1] * page_elems + head_offset, stride,
                                                    sloserve_page_len(longest, b + 1, page), width);
        for (ptrdiff_t v = 0; v < queries; v++) { /* out[d] sums its positions in order, for every d */
            const ptrdiff_t g = v % heads, n = sloserve_page_len(seq_len + v / heads, b, page);
            if (n <= 0) continue;
            float *w = scores + v * longest + first;
            const SLOSERVE_T *vrows = page_rows + (g / group) * pitch;
#ifdef SLOSERVE_T_ROW_SCALE
            for (ptrdiff_t j = 0; j < n; j++) w[j] *= SLOSERVE_T_ROW_SCALE(vrows + j * stride, dim);
#endif
            float *o = out + (v / heads) * out_stride + g * dim;
            ptrdiff_t c = 0;
            for (; c + 64 <= dim; c += 64) SLOSERVE_T_NAME(sloserve_weighted_rows64)(w, vrows + c, stride, n, o + c);
            if (dim % 8 == 0)
                SLOSERVE_T_NAME(sloserve_weighted_rows8)(w, vrows + c, stride, n, dim - c, o + c);
            else
                for (ptrdiff_t j = 0; j < n; j++)
                    for (ptrdiff_t d = c; d < dim; d++) o[d] += w[j] * SLOSERVE_T_AT(vrows, j * stride + d);
        }
    }
    return 0;
}

#undef SLOSERVE_T
#undef SLOSERVE_T_NAME
#undef SLOSERVE_T_LOAD8
#undef SLOSERVE_T_AT
#undef SLOSERVE_T_PITCH
#ifdef SLOSERVE_T_ROW_SCALE
#undef SLOSERVE_T_ROW_SCALE
#endif
