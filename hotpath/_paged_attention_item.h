/* One work item (a sequence's KV heads, or one of them) of the in-place paged decode kernel (_paged_attention.pyx).
 *
 * Plain C so that GCC can build it for several instruction sets (target_clones: AVX-512, AVX2,
 * AVX, baseline x86-64) and pick one at load time: the wheel stays portable, a modern CPU gets wide
 * vectors. The loops are written with LANES independent accumulators, so they vectorise without
 * reassociation flags and give the same sums on every instruction set and thread count.
 */
#ifndef SLOSERVE_PAGED_ATTENTION_ITEM_H
#define SLOSERVE_PAGED_ATTENTION_ITEM_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define SLOSERVE_CLONES __attribute__((target_clones("avx512f", "avx2", "avx", "default")))
#else
#define SLOSERVE_CLONES
#endif

#define SLOSERVE_LANES 8

/* Helpers of the cloned kernels are always inlined, so each clone compiles them for its instruction set. */
#define SLOSERVE_INLINE static inline __attribute__((always_inline))

/* Eight float lanes as a GCC vector (one AVX register, two SSE ones on the baseline clone), and
 * four. Vector arithmetic rounds lane by lane, so every clone gives the same sums. */
#pragma GCC diagnostic ignored "-Wpsabi" /* inlined helpers: no vector crosses a call boundary */
typedef float sloserve_v8 __attribute__((vector_size(32)));
typedef float sloserve_v8u __attribute__((vector_size(32), aligned(4)));
typedef float sloserve_v4 __attribute__((vector_size(16)));

SLOSERVE_INLINE sloserve_v8 sloserve_load8(const float *p) { return *(const sloserve_v8u *)p; }

static inline float sloserve_dot(const float *a, const float *b, ptrdiff_t n) {
    float acc[SLOSERVE_LANES] = {0};
    ptrdiff_t d = 0;
    for (; d + SLOSERVE_LANES <= n; d += SLOSERVE_LANES)
        for (int j = 0; j < SLOSERVE_LANES; j++) acc[j] += a[d + j] * b[d + j];
    for (; d < n; d++) acc[0] += a[d] * b[d];
    for (int width = SLOSERVE_LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) acc[j] += acc[j + width];
    return acc[0];
}

/* The four sums sloserve_dot's fold gives of four 8-lane accumulators, in one vector:
 * lanes i + (i + 4) first, then (0 + 2) + (1 + 3), computed for the four at once by a transpose. */
SLOSERVE_INLINE sloserve_v4 sloserve_fold4(sloserve_v8 a0, sloserve_v8 a1, sloserve_v8 a2, sloserve_v8 a3) {
    const sloserve_v4 t0 = __builtin_shufflevector(a0, a0, 0, 1, 2, 3) + __builtin_shufflevector(a0, a0, 4, 5, 6, 7);
    const sloserve_v4 t1 = __builtin_shufflevector(a1, a1, 0, 1, 2, 3) + __builtin_shufflevector(a1, a1, 4, 5, 6, 7);
    const sloserve_v4 t2 = __builtin_shufflevector(a2, a2, 0, 1, 2, 3) + __builtin_shufflevector(a2, a2, 4, 5, 6, 7);
    const sloserve_v4 t3 = __builtin_shufflevector(a3, a3, 0, 1, 2, 3) + __builtin_shufflevector(a3, a3, 4, 5, 6, 7);
    const sloserve_v4 x0 = __builtin_shufflevector(t0, t1, 0, 4, 1, 5), x1 = __builtin_shufflevector(t0, t1, 2, 6, 3, 7);
    const sloserve_v4 y0 = __builtin_shufflevector(t2, t3, 0, 4, 1, 5), y1 = __builtin_shufflevector(t2, t3, 2, 6, 3, 7);
    const sloserve_v4 lane0 = __builtin_shufflevector(x0, y0, 0, 1, 4, 5), lane1 = __builtin_shufflevector(x0, y0, 2, 3, 6, 7);
    const sloserve_v4 lane2 = __builtin_shufflevector(x1, y1, 0, 1, 4, 5), lane3 = __builtin_shufflevector(x1, y1, 2, 3, 6, 7);
    return (lane0 + lane2) + (lane1 + lane3);
}

/* out[r] = sloserve_dot(q, rows + r * stride, dim) for r < 4, the same bits; dim a multiple of 8. */
SLOSERVE_INLINE sloserve_v4 sloserve_dot4_strided(const float *q, const float *rows, ptrdiff_t stride, ptrdiff_t dim) {
    sloserve_v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (ptrdiff_t d = 0; d < dim; d += 8) {
        const sloserve_v8 qv = sloserve_load8(q + d);
        a0 += sloserve_load8(rows + d) * qv;
        a1 += sloserve_load8(rows + stride + d) * qv;
        a2 += sloserve_load8(rows + 2 * stride + d) * qv;
        a3 += sloserve_load8(rows + 3 * stride + d) * qv;
    }
    return sloserve_fold4(a0, a1, a2, a3);
}

/* The products past the last multiple of 8 go to lane 0, as sloserve_dot sums them. */
SLOSERVE_INLINE sloserve_v8 sloserve_tail(sloserve_v8 acc, const float *w, const float *x, ptrdiff_t d, ptrdiff_t k) {
    for (; d < k; d++) acc[0] += w[d] * x[d];
    return acc;
}

/* Four rows (rows, rows + stride, ...) against two vectors q0, q1 of `dim` floats: each row load
 * serves both (eight independent sums, where one vector's four wait on the adder's latency);
 * out0[r] is sloserve_dot(q0, row r, dim), the same bits. The attention's K rows (stride: a page
 * row) and the decode step's weight rows (stride: their length) both go through here. */
SLOSERVE_INLINE void sloserve_dot4x2_strided(const float *q0, const float *q1, const float *rows, ptrdiff_t stride,
                                             ptrdiff_t dim, sloserve_v4 *out0, sloserve_v4 *out1) {
    sloserve_v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    ptrdiff_t d = 0;
    for (; d + 8 <= dim; d += 8) {
        const sloserve_v8 u = sloserve_load8(q0 + d), v = sloserve_load8(q1 + d);
        sloserve_v8 r = sloserve_load8(rows + d);
        a0 += r * u;
        b0 += r * v;
        r = sloserve_load8(rows + stride + d);
        a1 += r * u;
        b1 += r * v;
        r = sloserve_load8(rows + 2 * stride + d);
        a2 += r * u;
        b2 += r * v;
        r = sloserve_load8(rows + 3 * stride + d);
        a3 += r * u;
        b3 += r * v;
    }
    const float *r1 = rows + stride, *r2 = rows + 2 * stride, *r3 = rows + 3 * stride;
    *out0 = sloserve_fold4(sloserve_tail(a0, rows, q0, d, dim), sloserve_tail(a1, r1, q0, d, dim),
                           sloserve_tail(a2, r2, q0, d, dim), sloserve_tail(a3, r3, q0, d, dim));
    *out1 = sloserve_fold4(sloserve_tail(b0, rows, q1, d, dim), sloserve_tail(b1, r1, q1, d, dim),
                           sloserve_tail(b2, r2, q1, d, dim), sloserve_tail(b3, r3, q1, d, dim));
}

/* out[0:64] += sum over j < n, in order, of w[j] * rows[j * stride : j * stride + 64]: the output
 * held in eight registers across the positions instead of loaded and stored at each one; every
 * element sums in the order the one-position-at-a-time loop gives it. */
SLOSERVE_INLINE void sloserve_weighted_rows64(const float *w, const float *rows, ptrdiff_t stride, ptrdiff_t n,
                                              float *out) {
    sloserve_v8 o0 = sloserve_load8(out), o1 = sloserve_load8(out + 8), o2 = sloserve_load8(out + 16);
    sloserve_v8 o3 = sloserve_load8(out + 24), o4 = sloserve_load8(out + 32), o5 = sloserve_load8(out + 40);
    sloserve_v8 o6 = sloserve_load8(out + 48), o7 = sloserve_load8(out + 56);
    for (ptrdiff_t j = 0; j < n; j++) {
        const float *row = rows + j * stride, wj = w[j];
        o0 += wj * sloserve_load8(row);
        o1 += wj * sloserve_load8(row + 8);
        o2 += wj * sloserve_load8(row + 16);
        o3 += wj * sloserve_load8(row + 24);
        o4 += wj * sloserve_load8(row + 32);
        o5 += wj * sloserve_load8(row + 40);
        o6 += wj * sloserve_load8(row + 48);
        o7 += wj * sloserve_load8(row + 56);
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
SLOSERVE_INLINE void sloserve_weighted_rows8(const float *w, const float *rows, ptrdiff_t stride, ptrdiff_t n,
                                             ptrdiff_t width, float *out) {
    for (ptrdiff_t c = 0; c < width; c += 8) {
        sloserve_v8 o = sloserve_load8(out + c);
        for (ptrdiff_t j = 0; j < n; j++) o += w[j] * sloserve_load8(rows + j * stride + c);
        memcpy(out + c, &o, sizeof o);
    }
}

/* Ask for the next page's rows of the item's KV heads (n rows of `width` floats, stride apart)
 * while this page computes: pages are scattered through the pool, so the hardware's stream
 * prefetch starts over at every one of them. */
SLOSERVE_INLINE void sloserve_prefetch_rows(const float *rows, ptrdiff_t stride, ptrdiff_t n, ptrdiff_t width) {
    for (ptrdiff_t j = 0; j < n; j++)
        for (ptrdiff_t d = 0; d < width; d += 16) __builtin_prefetch(rows + j * stride + d, 0, 0);
}

/* Positions of page b that a sequence of seq_len positions fills. */
SLOSERVE_INLINE ptrdiff_t sloserve_page_len(ptrdiff_t seq_len, ptrdiff_t b, ptrdiff_t page) {
    return seq_len - b * page < page ? seq_len - b * page : page;
}

/* KV heads per work item for `seqs` sequences on `threads` threads: all of a sequence's (whole
 * rows, one stream per page) once there are sequences enough to keep every thread busy, else
 * one (a sequence's heads spread over the threads). */
static inline ptrdiff_t sloserve_item_kv_heads(ptrdiff_t seqs, ptrdiff_t hkv, int threads) {
    return seqs >= 2 * (ptrdiff_t)threads ? hkv : 1;
}

/* exp(x) for x <= 0 (a softmax of scores minus their maximum), in plain float arithmetic that
 * vectorises (libm's expf does not, and dominated the kernel): Cephes' expf reduction and
 * polynomial, ~1 ulp; exp(x) below -87.3 (under 2^-126) is flushed to 0. */
static inline float sloserve_exp_nonpositive(float x) {
    union { float f; int32_t i; } scale;
    x = x < -87.3f ? -87.3f : x;
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to the nearest integer */
    const float n = (x * 1.44269504088896341f + magic) - magic;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    const float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    scale.i = ((int32_t)n + 127) << 23;
    return x <= -87.3f ? 0.0f : y * scale.f;
}

/* One work item: KV heads [kv_head, kv_head + kv_count) of one sequence, page by page (a page's
 * rows of those heads are adjacent, so an item of every KV head reads whole rows). q, out: the
 * item's first query head row ([kv_count * group, dim], contiguous); scores: kv_count * group *
 * seq_len floats. Each query head's result is the same bits whatever kv_count is.
 * Returns 0, or -1 when a block id is outside [0, num_pages) (then nothing is read from it). */
SLOSERVE_CLONES
static int sloserve_paged_item(const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
                               ptrdiff_t seq_len, ptrdiff_t kv_head, ptrdiff_t kv_count, ptrdiff_t group,
                               ptrdiff_t hkv, ptrdiff_t dim, ptrdiff_t page, ptrdiff_t num_pages, float scale,
                               float *scores, float *out) {
    const ptrdiff_t stride = hkv * dim; /* floats between consecutive positions of one page */
    const ptrdiff_t heads = kv_count * group, width = kv_count * dim; /* the item's query heads; its row floats */
    const ptrdiff_t page_floats = page * stride, head_offset = kv_head * dim, num_blocks = (seq_len + page - 1) / page;
    for (ptrdiff_t b = 0; b < num_blocks; b++)
        if (table[b] < 0 || table[b] >= num_pages) return -1;
    for (ptrdiff_t b = 0; b < num_blocks; b++) { /* one pass over K, page by page: every query head */
        const float *page_rows = k_cache + table[b] * page_floats + head_offset;
        const ptrdiff_t first = b * page, n = sloserve_page_len(seq_len, b, page);
        if (b + 1 < num_blocks)
            sloserve_prefetch_rows(k_cache + table[b + 1] * page_floats + head_offset, stride,
                                   sloserve_page_len(seq_len, b + 1, page), width);
        for (ptrdiff_t kk = 0; kk < kv_count; kk++) {
            const float *rows = page_rows + kk * dim, *qk = q + kk * group * dim;
            float *sk = scores + kk * group * seq_len;
            ptrdiff_t j = 0;
            if (dim % 8 == 0) /* four positions (of two query heads) at a time, the same sums as one at a time */
                for (; j + 4 <= n; j += 4) {
                    ptrdiff_t g = 0;
                    for (; g + 2 <= group; g += 2) {
                        sloserve_v4 s0, s1;
                        sloserve_dot4x2_strided(qk + g * dim, qk + (g + 1) * dim, rows + j * stride, stride, dim,
                                                &s0, &s1);
                        s0 *= scale;
                        s1 *= scale;
                        memcpy(sk + g * seq_len + first + j, &s0, sizeof s0);
                        memcpy(sk + (g + 1) * seq_len + first + j, &s1, sizeof s1);
                    }
                    for (; g < group; g++) {
                        const sloserve_v4 s = sloserve_dot4_strided(qk + g * dim, rows + j * stride, stride, dim) * scale;
                        memcpy(sk + g * seq_len + first + j, &s, sizeof s);
                    }
                }
            for (; j < n; j++)
                for (ptrdiff_t g = 0; g < group; g++)
                    sk[g * seq_len + first + j] = sloserve_dot(qk + g * dim, rows + j * stride, dim) * scale;
        }
    }
    for (ptrdiff_t g = 0; g < heads; g++) { /* softmax, running maximum subtracted */
        float *s = scores + g * seq_len, m = s[0], acc[SLOSERVE_LANES] = {0};
        for (ptrdiff_t p = 1; p < seq_len; p++) m = s[p] > m ? s[p] : m;
        for (ptrdiff_t p = 0; p < seq_len; p++) s[p] = sloserve_exp_nonpositive(s[p] - m);
        ptrdiff_t p = 0;
        for (; p + SLOSERVE_LANES <= seq_len; p += SLOSERVE_LANES)
            for (int j = 0; j < SLOSERVE_LANES; j++) acc[j] += s[p + j];
        for (; p < seq_len; p++) acc[0] += s[p];
        for (int lanes = SLOSERVE_LANES / 2; lanes > 0; lanes /= 2)
            for (int j = 0; j < lanes; j++) acc[j] += acc[j + lanes];
        const float inv = 1.0f / acc[0];
        for (ptrdiff_t p = 0; p < seq_len; p++) s[p] *= inv;
        for (ptrdiff_t d = 0; d < dim; d++) out[g * dim + d] = 0.0f;
    }
    for (ptrdiff_t b = 0; b < num_blocks; b++) { /* one pass over V, in the same position order */
        const float *page_rows = v_cache + table[b] * page_floats + head_offset;
        const ptrdiff_t first = b * page, n = sloserve_page_len(seq_len, b, page);
        if (b + 1 < num_blocks)
            sloserve_prefetch_rows(v_cache + table[b + 1] * page_floats + head_offset, stride,
                                   sloserve_page_len(seq_len, b + 1, page), width);
        for (ptrdiff_t g = 0; g < heads; g++) { /* out[d] sums its positions in order, for every d */
            const float *w = scores + g * seq_len + first, *rows = page_rows + (g / group) * dim;
            float *o = out + g * dim;
            ptrdiff_t c = 0;
            for (; c + 64 <= dim; c += 64) sloserve_weighted_rows64(w, rows + c, stride, n, o + c);
            if (dim % 8 == 0)
                sloserve_weighted_rows8(w, rows + c, stride, n, dim - c, o + c);
            else
                for (ptrdiff_t j = 0; j < n; j++)
                    for (ptrdiff_t d = c; d < dim; d++) o[d] += w[j] * rows[j * stride + d];
        }
    }
    return 0;
}

#endif
