/* One (sequence, KV head) work item of the in-place paged decode kernel (_paged_attention.pyx).
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

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define SLOSERVE_CLONES __attribute__((target_clones("avx512f", "avx2", "avx", "default")))
#else
#define SLOSERVE_CLONES
#endif

#define SLOSERVE_LANES 8

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

/* q, out: the item's first query head row ([group, dim], contiguous); scores: group * seq_len floats.
 * Returns 0, or -1 when a block id is outside [0, num_pages) (then nothing is read from it). */
SLOSERVE_CLONES
static int sloserve_paged_item(const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
                               ptrdiff_t seq_len, ptrdiff_t kv_head, ptrdiff_t group, ptrdiff_t hkv, ptrdiff_t dim,
                               ptrdiff_t page, ptrdiff_t num_pages, float scale, float *scores, float *out) {
    const ptrdiff_t stride = hkv * dim; /* floats between consecutive positions of one page */
    for (ptrdiff_t b = 0; b < (seq_len + page - 1) / page; b++)
        if (table[b] < 0 || table[b] >= num_pages) return -1;
    const ptrdiff_t num_blocks = (seq_len + page - 1) / page;
    for (ptrdiff_t b = 0; b < num_blocks; b++) { /* one pass over K, page by page: every query head */
        const float *rows = k_cache + (ptrdiff_t)table[b] * page * stride + kv_head * dim;
        const ptrdiff_t first = b * page, n = seq_len - first < page ? seq_len - first : page;
        for (ptrdiff_t j = 0; j < n; j++)
            for (ptrdiff_t g = 0; g < group; g++)
                scores[g * seq_len + first + j] = sloserve_dot(q + g * dim, rows + j * stride, dim) * scale;
    }
    for (ptrdiff_t g = 0; g < group; g++) { /* softmax, running maximum subtracted */
        float *s = scores + g * seq_len, m = s[0], acc[SLOSERVE_LANES] = {0};
        for (ptrdiff_t p = 1; p < seq_len; p++) m = s[p] > m ? s[p] : m;
        for (ptrdiff_t p = 0; p < seq_len; p++) s[p] = sloserve_exp_nonpositive(s[p] - m);
        ptrdiff_t p = 0;
        for (; p + SLOSERVE_LANES <= seq_len; p += SLOSERVE_LANES)
            for (int j = 0; j < SLOSERVE_LANES; j++) acc[j] += s[p + j];
        for (; p < seq_len; p++) acc[0] += s[p];
        for (int width = SLOSERVE_LANES / 2; width > 0; width /= 2)
            for (int j = 0; j < width; j++) acc[j] += acc[j + width];
        const float inv = 1.0f / acc[0];
        for (ptrdiff_t p = 0; p < seq_len; p++) s[p] *= inv;
        for (ptrdiff_t d = 0; d < dim; d++) out[g * dim + d] = 0.0f;
    }
    for (ptrdiff_t b = 0; b < num_blocks; b++) { /* one pass over V, in the same position order */
        const float *rows = v_cache + (ptrdiff_t)table[b] * page * stride + kv_head * dim;
        const ptrdiff_t first = b * page, n = seq_len - first < page ? seq_len - first : page;
        for (ptrdiff_t j = 0; j < n; j++)
            for (ptrdiff_t g = 0; g < group; g++) {
                const float w = scores[g * seq_len + first + j], *row = rows + j * stride;
                float *o = out + g * dim;
                for (ptrdiff_t d = 0; d < dim; d++) o[d] += w * row[d];
            }
    }
    return 0;
}

#endif
