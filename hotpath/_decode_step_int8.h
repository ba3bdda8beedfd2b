/* The decode step's matrix-vector products over int8 weights (Int8Linear's layout: plain [out, in]
 * int8 rows, a float32 scale per row), W8A8 as layers/quant.py computes a product of one row:
 *
 *     s_b = max(absmax(x[b]), 1e-12) / 127      (float32)
 *     q_b = clamp(round_half_even(x[b] / s_b), -127, 127)
 *     y[b, j] = (float)(q_b . w[j]) * (s_b * scale[j])   (+ bias[j])
 *
 * The integer sums are exact, so a row's result is the same bits on every path, batch position
 * and thread count, and equals torch's (`torch._int_mm` then the float32 rescale) before its
 * rounding to the activation dtype. Where the CPU has AVX512-VNNI, `vpdpbusd` takes 64 weights an
 * instruction: it multiplies unsigned by signed bytes, so the activations go in offset by 128
 * and each row's sum loses 128 x (its weights' sum), which the caller precomputes (`rowsum`);
 * elsewhere a widened int32 loop sums q . w directly. Compiled with a target attribute, so the
 * module builds and runs on any x86-64.
 */
#ifndef SLOSERVE_DECODE_STEP_INT8_H
#define SLOSERVE_DECODE_STEP_INT8_H

#include <stdlib.h>

/* Whether int8 products take VNNI (sloserve_vnni_set; the widened loop otherwise). */
static int sloserve_vnni_enabled = 0;

/* This thread's buffer for the quantized activations, grown as needed (NULL when it cannot be). */
static uint8_t *sloserve_quantized_buffer(ptrdiff_t bytes) {
    static __thread uint8_t *buffer;
    static __thread ptrdiff_t capacity;
    if (bytes > capacity) {
        free(buffer);
        buffer = (uint8_t *)aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        capacity = buffer ? bytes : 0;
    }
    return buffer;
}

/* Row x of k floats quantized as quant.py's quantize_rows: q + offset into out (kp bytes, the
 * padding past k filled with offset); returns the row's scale. */
static float sloserve_quantize_row(const float *x, ptrdiff_t k, ptrdiff_t kp, int offset, uint8_t *out) {
    float absmax = 0.0f;
    for (ptrdiff_t d = 0; d < k; d++) absmax = fabsf(x[d]) > absmax ? fabsf(x[d]) : absmax;
    const float scale = (absmax > 1e-12f ? absmax : 1e-12f) / 127.0f;
    for (ptrdiff_t d = 0; d < k; d++) {
        float q = nearbyintf(x[d] / scale);
        q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
        out[d] = (uint8_t)((int)q + offset);
    }
    for (ptrdiff_t d = k; d < kp; d++) out[d] = (uint8_t)offset;
    return scale;
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && __GNUC__ >= 10
#include <immintrin.h>

#define SLOSERVE_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define SLOSERVE_VNNI_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512vnni")))

static int sloserve_vnni_set(int on) {
    __builtin_cpu_init();
    sloserve_vnni_enabled = on && __builtin_cpu_supports("avx512vnni");
    return sloserve_vnni_enabled;
}

/* A weight row's 64 bytes at d, masked to the row's length k. */
SLOSERVE_VNNI_INLINE __m512i sloserve_load_w8(const int8_t *w, ptrdiff_t d, ptrdiff_t k) {
    if (d + 64 <= k) return _mm512_loadu_si512(w + d);
    const ptrdiff_t n = k - d;
    return _mm512_maskz_loadu_epi8(n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1), w + d);
}

/* Four weight rows (w, w + k, ...) against one offset activation row: sums of (q + 128) . w. */
SLOSERVE_VNNI_INLINE void sloserve_vnni4(const int8_t *w, const uint8_t *x, ptrdiff_t k, int32_t *out) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (ptrdiff_t d = 0; d < k; d += 64) {
        const __m512i u = _mm512_loadu_si512(x + d);
        a0 = _mm512_dpbusd_epi32(a0, u, sloserve_load_w8(w, d, k));
        a1 = _mm512_dpbusd_epi32(a1, u, sloserve_load_w8(w + k, d, k));
        a2 = _mm512_dpbusd_epi32(a2, u, sloserve_load_w8(w + 2 * k, d, k));
        a3 = _mm512_dpbusd_epi32(a3, u, sloserve_load_w8(w + 3 * k, d, k));
    }
    out[0] = _mm512_reduce_add_epi32(a0);
    out[1] = _mm512_reduce_add_epi32(a1);
    out[2] = _mm512_reduce_add_epi32(a2);
    out[3] = _mm512_reduce_add_epi32(a3);
}

/* The same against two activation rows: each weight load serves both sequences. */
SLOSERVE_VNNI_INLINE void sloserve_vnni4x2(const int8_t *w, const uint8_t *x0, const uint8_t *x1, ptrdiff_t k,
                                           int32_t *out0, int32_t *out1) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (ptrdiff_t d = 0; d < k; d += 64) {
        const __m512i u = _mm512_loadu_si512(x0 + d), v = _mm512_loadu_si512(x1 + d);
        __m512i r = sloserve_load_w8(w, d, k);
        a0 = _mm512_dpbusd_epi32(a0, u, r);
        b0 = _mm512_dpbusd_epi32(b0, v, r);
        r = sloserve_load_w8(w + k, d, k);
        a1 = _mm512_dpbusd_epi32(a1, u, r);
        b1 = _mm512_dpbusd_epi32(b1, v, r);
        r = sloserve_load_w8(w + 2 * k, d, k);
        a2 = _mm512_dpbusd_epi32(a2, u, r);
        b2 = _mm512_dpbusd_epi32(b2, v, r);
        r = sloserve_load_w8(w + 3 * k, d, k);
        a3 = _mm512_dpbusd_epi32(a3, u, r);
        b3 = _mm512_dpbusd_epi32(b3, v, r);
    }
    out0[0] = _mm512_reduce_add_epi32(a0);
    out0[1] = _mm512_reduce_add_epi32(a1);
    out0[2] = _mm512_reduce_add_epi32(a2);
    out0[3] = _mm512_reduce_add_epi32(a3);
    out1[0] = _mm512_reduce_add_epi32(b0);
    out1[1] = _mm512_reduce_add_epi32(b1);
    out1[2] = _mm512_reduce_add_epi32(b2);
    out1[3] = _mm512_reduce_add_epi32(b3);
}

/* One weight row against one offset activation row. */
SLOSERVE_VNNI_INLINE int32_t sloserve_vnni1(const int8_t *w, const uint8_t *x, ptrdiff_t k) {
    __m512i a = _mm512_setzero_si512();
    for (ptrdiff_t d = 0; d < k; d += 64) a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(x + d), sloserve_load_w8(w, d, k));
    return _mm512_reduce_add_epi32(a);
}

/* sums[4 b + r] = q_b . w[r] for r < n (n <= 4) and every b: rows [n, k] int8, xq [batch, kp]
 * offset by 128, rowsum[r] each row's weight sum. */
SLOSERVE_VNNI_TARGET
static void sloserve_sums_vnni(const int8_t *rows, const int32_t *rowsum, const uint8_t *xq, ptrdiff_t batch,
                               ptrdiff_t k, ptrdiff_t kp, ptrdiff_t n, int32_t *sums) {
    ptrdiff_t b = 0;
    if (n == 4) {
        for (; b + 2 <= batch; b += 2)
            sloserve_vnni4x2(rows, xq + b * kp, xq + (b + 1) * kp, k, sums + 4 * b, sums + 4 * (b + 1));
        if (b < batch) sloserve_vnni4(rows, xq + b * kp, k, sums + 4 * b);
    } else {
        for (; b < batch; b++)
            for (ptrdiff_t r = 0; r < n; r++) sums[4 * b + r] = sloserve_vnni1(rows + r * k, xq + b * kp, k);
    }
    for (b = 0; b < batch; b++)
        for (ptrdiff_t r = 0; r < n; r++) sums[4 * b + r] -= 128 * rowsum[r];
}
#else
static int sloserve_vnni_set(int on) {
    (void)on;
    return 0;
}
static void sloserve_sums_vnni(const int8_t *rows, const int32_t *rowsum, const uint8_t *xq, ptrdiff_t batch,
                               ptrdiff_t k, ptrdiff_t kp, ptrdiff_t n, int32_t *sums) {
    (void)rows, (void)rowsum, (void)xq, (void)batch, (void)k, (void)kp, (void)n, (void)sums;
}
#endif

/* The widened path's sums: q_b . w[j + r] in int32 (exact, so the same as VNNI's). */
SLOSERVE_CLONES
static void sloserve_sums_widened(const int8_t *rows, const uint8_t *xq, ptrdiff_t batch, ptrdiff_t k, ptrdiff_t kp,
                                  ptrdiff_t n, int32_t *sums) {
    for (ptrdiff_t b = 0; b < batch; b++)
        for (ptrdiff_t r = 0; r < n; r++) {
            const int8_t *w = rows + r * k;
            const uint8_t *x = xq + b * kp;
            int32_t acc = 0;
            for (ptrdiff_t d = 0; d < k; d++) acc += ((int32_t)x[d] - 128) * (int32_t)w[d];
            sums[4 * b + r] = acc;
        }
}

/* The rows' activations quantized into this thread's buffer (offset by 128, kp a multiple of 64)
 * and their scales; NULL when the buffer finds no memory. */
static uint8_t *sloserve_quantize_rows(const float *x, ptrdiff_t batch, ptrdiff_t k, ptrdiff_t kp, float *scales) {
    uint8_t *xq = sloserve_quantized_buffer(batch * kp);
    if (xq == NULL) return NULL;
    for (ptrdiff_t b = 0; b < batch; b++) scales[b] = sloserve_quantize_row(x + b * k, k, kp, 128, xq + b * kp);
    return xq;
}

/* v[4 b + r] = x[b] . w[j + r] for r < n, each scaled as quant.py scales: (float)sum * (s_b * scale). */
static void sloserve_dots_i8(const sloserve_weight *w, const uint8_t *xq, const float *xs, ptrdiff_t batch,
                             ptrdiff_t k, ptrdiff_t kp, ptrdiff_t j, ptrdiff_t n, float *v) {
    int32_t sums[4 * SLOSERVE_MAX_BATCH];
    const int8_t *rows = (const int8_t *)w->data + j * k;
    if (sloserve_vnni_enabled)
        sloserve_sums_vnni(rows, w->rowsum + j, xq, batch, k, kp, n, sums);
    else
        sloserve_sums_widened(rows, xq, batch, k, kp, n, sums);
    for (ptrdiff_t b = 0; b < batch; b++)
        for (ptrdiff_t r = 0; r < n; r++) v[4 * b + r] = (float)sums[4 * b + r] * (xs[b] * w->scale[j + r]);
}

/* sloserve_gemv_rows on int8 weights; 0, or -1 (nothing written) when the quantized activations
 * find no memory. */
static int sloserve_gemv_rows_i8(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                                 ptrdiff_t k, ptrdiff_t j0, ptrdiff_t j1, float *y, ptrdiff_t ldy, int accumulate) {
    const ptrdiff_t kp = (k + 63) / 64 * 64;
    float xs[SLOSERVE_MAX_BATCH], dots[4 * SLOSERVE_MAX_BATCH];
    const uint8_t *xq = sloserve_quantize_rows(x, batch, k, kp, xs);
    if (xq == NULL) return -1;
    for (ptrdiff_t j = j0; j < j1; j += 4) {
        const ptrdiff_t n = j1 - j < 4 ? j1 - j : 4;
        sloserve_dots_i8(w, xq, xs, batch, k, kp, j, n, dots);
        for (ptrdiff_t b = 0; b < batch; b++)
            for (ptrdiff_t r = 0; r < n; r++) {
                float v = dots[4 * b + r];
                if (bias) v = v + bias[j + r];
                y[b * ldy + j + r] = accumulate ? y[b * ldy + j + r] + v : v;
            }
    }
    return 0;
}

/* sloserve_swiglu_rows on int8 weights; 0, or -1 as above. */
static int sloserve_swiglu_rows_i8(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                                   ptrdiff_t k, ptrdiff_t inter, ptrdiff_t j0, ptrdiff_t j1, float *act) {
    const ptrdiff_t kp = (k + 63) / 64 * 64;
    float xs[SLOSERVE_MAX_BATCH], gates[4 * SLOSERVE_MAX_BATCH], ups[4 * SLOSERVE_MAX_BATCH];
    const uint8_t *xq = sloserve_quantize_rows(x, batch, k, kp, xs);
    if (xq == NULL) return -1;
    for (ptrdiff_t j = j0; j < j1; j += 4) {
        const ptrdiff_t n = j1 - j < 4 ? j1 - j : 4;
        sloserve_dots_i8(w, xq, xs, batch, k, kp, j, n, gates);
        sloserve_dots_i8(w, xq, xs, batch, k, kp, inter + j, n, ups);
        for (ptrdiff_t b = 0; b < batch; b++)
            for (ptrdiff_t r = 0; r < n; r++) {
                float gate = gates[4 * b + r], up = ups[4 * b + r];
                if (bias) {
                    gate = gate + bias[j + r];
                    up = up + bias[inter + j + r];
                }
                act[b * inter + j + r] = (gate / (1.0f + expf(-gate))) * up;
            }
    }
    return 0;
}

#endif
