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

/* y[b, j] = (accumulate ? y[b, j] + : ) (x[b] . w[j] + bias[j]) for rows j in [j0, j1) (gate_up:
 * act[b, j] = silu(gate) * up, `inter` the gate rows' count, y and ldy unused), the activations
 * quantized into xq ([batch, kp]). */
static void sloserve_rows_i8(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                             ptrdiff_t k, ptrdiff_t kp, ptrdiff_t inter, ptrdiff_t j0, ptrdiff_t j1, float *y,
                             ptrdiff_t ldy, int accumulate, uint8_t *xq) {
    float xs[SLOSERVE_MAX_BATCH], gates[4 * SLOSERVE_MAX_BATCH], ups[4 * SLOSERVE_MAX_BATCH];
    for (ptrdiff_t b = 0; b < batch; b++) xs[b] = sloserve_quantize_row(x + b * k, k, kp, 128, xq + b * kp);
    for (ptrdiff_t j = j0; j < j1; j += 4) {
        const ptrdiff_t n = j1 - j < 4 ? j1 - j : 4;
        sloserve_dots_i8(w, xq, xs, batch, k, kp, j, n, gates);
        if (inter) sloserve_dots_i8(w, xq, xs, batch, k, kp, inter + j, n, ups);
        for (ptrdiff_t b = 0; b < batch; b++)
            for (ptrdiff_t r = 0; r < n; r++) {
                float v = gates[4 * b + r];
                if (inter) {
                    float up = ups[4 * b + r];
                    if (bias) {
                        v = v + bias[j + r];
                        up = up + bias[inter + j + r];
                    }
                    y[b * inter + j + r] = (v / (1.0f + expf(-v))) * up;
                    continue;
                }
                if (bias) v = v + bias[j + r];
                y[b * ldy + j + r] = accumulate ? y[b * ldy + j + r] + v : v;
            }
    }
}

/* sloserve_rows_i8 with this thread's buffer, or, where it finds no memory, one row at a time
 * through the stack (the same bits: a row's result does not depend on the rows beside it). */
static void sloserve_rows_i8_buffered(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                                      ptrdiff_t k, ptrdiff_t inter, ptrdiff_t j0, ptrdiff_t j1, float *y,
                                      ptrdiff_t ldy, int accumulate) {
    const ptrdiff_t kp = (k + 63) / 64 * 64;
    uint8_t *xq = sloserve_quantized_buffer(batch * kp);
    if (xq) {
        sloserve_rows_i8(w, bias, x, batch, k, kp, inter, j0, j1, y, ldy, accumulate, xq);
        return;
    }
    uint8_t row[kp];
    for (ptrdiff_t b = 0; b < batch; b++)
        sloserve_rows_i8(w, bias, x + b * k, 1, k, kp, inter, j0, j1, y + b * (inter ? inter : ldy), ldy,
                         accumulate, row);
}

/* sloserve_gemv_rows on int8 weights. */
static void sloserve_gemv_rows_i8(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                                  ptrdiff_t k, ptrdiff_t j0, ptrdiff_t j1, float *y, ptrdiff_t ldy, int accumulate) {
    sloserve_rows_i8_buffered(w, bias, x, batch, k, 0, j0, j1, y, ldy, accumulate);
}

/* sloserve_swiglu_rows on int8 weights. */
static void sloserve_swiglu_rows_i8(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                                    ptrdiff_t k, ptrdiff_t inter, ptrdiff_t j0, ptrdiff_t j1, float *act) {
    sloserve_rows_i8_buffered(w, bias, x, batch, k, inter, j0, j1, act, inter, 0);
}

#endif
