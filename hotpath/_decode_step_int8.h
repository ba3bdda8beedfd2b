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

/* Bytes ahead of a row's loads that the memory is asked for (one prefetch per 64-byte line). */
#define SLOSERVE_I8_PREFETCH 4096

/* A weight row's 64 bytes at d, masked to the row's length k. */
SLOSERVE_VNNI_INLINE __m512i sloserve_load_w8(const int8_t *w, ptrdiff_t d, ptrdiff_t k) {
    if (d + 64 <= k) return _mm512_loadu_si512(w + d);
    const ptrdiff_t n = k - d;
    return _mm512_maskz_loadu_epi8(n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1), w + d);
}

/* The four accumulators' sums, one int32 each (exact: integer sums in any order), folded together
 * instead of one horizontal reduction each. */
SLOSERVE_VNNI_INLINE __m128i sloserve_fold4_i32(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
    const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* One weight row against one offset activation row: the 16 lanes of (q + 128) . w. The row is
 * read front to back, two chunks a turn into two accumulators, asking for the line
 * SLOSERVE_I8_PREFETCH bytes ahead of each. */
SLOSERVE_VNNI_INLINE __m512i sloserve_vnni1(const int8_t *w, const uint8_t *x, ptrdiff_t k) {
    __m512i a = _mm512_setzero_si512(), b = a;
    ptrdiff_t d = 0;
    for (; d + 128 <= k; d += 128) {
        _mm_prefetch((const char *)w + d + SLOSERVE_I8_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)w + d + 64 + SLOSERVE_I8_PREFETCH, _MM_HINT_T0);
        a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(x + d), _mm512_loadu_si512(w + d));
        b = _mm512_dpbusd_epi32(b, _mm512_loadu_si512(x + d + 64), _mm512_loadu_si512(w + d + 64));
    }
    for (; d < k; d += 64) a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(x + d), sloserve_load_w8(w, d, k));
    return _mm512_add_epi32(a, b);
}

/* The same against two activation rows: each weight load serves both sequences. */
SLOSERVE_VNNI_INLINE void sloserve_vnni2(const int8_t *w, const uint8_t *x0, const uint8_t *x1, ptrdiff_t k,
                                         __m512i *s0, __m512i *s1) {
    __m512i a0 = _mm512_setzero_si512(), b0 = a0, a1 = a0, b1 = a0;
    ptrdiff_t d = 0;
    for (; d + 128 <= k; d += 128) {
        _mm_prefetch((const char *)w + d + SLOSERVE_I8_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)w + d + 64 + SLOSERVE_I8_PREFETCH, _MM_HINT_T0);
        const __m512i r = _mm512_loadu_si512(w + d), t = _mm512_loadu_si512(w + d + 64);
        a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(x0 + d), r);
        a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(x1 + d), r);
        b0 = _mm512_dpbusd_epi32(b0, _mm512_loadu_si512(x0 + d + 64), t);
        b1 = _mm512_dpbusd_epi32(b1, _mm512_loadu_si512(x1 + d + 64), t);
    }
    for (; d < k; d += 64) {
        const __m512i r = sloserve_load_w8(w, d, k);
        a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(x0 + d), r);
        a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(x1 + d), r);
    }
    *s0 = _mm512_add_epi32(a0, b0);
    *s1 = _mm512_add_epi32(a1, b1);
}

/* sums[4 b + r] = q_b . w[r] for r < n (n <= 4) and every b: rows [n, k] int8, xq [batch, kp]
 * offset by 128, rowsum[r] each row's weight sum. Each row is summed whole before the next, so
 * the weights are read in memory order (four rows read a chunk of each at a time streamed at
 * about half the rate on a Zen 4; docs/design/cpu-decode.md), against two sequences a pass (the
 * first pair reads a row from memory, the others from the cache); the four rows' lanes are
 * folded together at the end. */
SLOSERVE_VNNI_TARGET
static void sloserve_sums_vnni(const int8_t *rows, const int32_t *rowsum, const uint8_t *xq, ptrdiff_t batch,
                               ptrdiff_t k, ptrdiff_t kp, ptrdiff_t n, int32_t *sums) {
    __m512i lanes[2][4];
    for (ptrdiff_t b = 0; b < batch; b += 2) {
        const int pair = b + 1 < batch;
        for (ptrdiff_t r = 0; r < n; r++) {
            if (pair)
                sloserve_vnni2(rows + r * k, xq + b * kp, xq + (b + 1) * kp, k, &lanes[0][r], &lanes[1][r]);
            else
                lanes[0][r] = sloserve_vnni1(rows + r * k, xq + b * kp, k);
        }
        for (ptrdiff_t r = n; r < 4; r++) lanes[0][r] = lanes[1][r] = _mm512_setzero_si512();
        int32_t folded[4];
        for (int i = 0; i <= pair; i++) {
            const __m128i sum = sloserve_fold4_i32(lanes[i][0], lanes[i][1], lanes[i][2], lanes[i][3]);
            _mm_storeu_si128((__m128i *)folded, sum);
            for (ptrdiff_t r = 0; r < n; r++) sums[4 * (b + i) + r] = folded[r] - 128 * rowsum[r];
        }
    }
}

/* Row x of k floats quantized as sloserve_quantize_row does, 16 at a time (the same bits:
 * division and rounding to nearest even are exact operations, the maximum is order-free, and a
 * NaN goes through both the same way). */
SLOSERVE_VNNI_TARGET
static float sloserve_quantize_row_avx512(const float *x, ptrdiff_t k, ptrdiff_t kp, int offset, uint8_t *out) {
    __m512 top = _mm512_setzero_ps();
    for (ptrdiff_t d = 0; d < k; d += 16) {
        const __mmask16 m = k - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - d)) - 1u);
        /* NOTE: a NaN operand first, so that max keeps the running maximum, as the scalar loop does */
        top = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + d)), top);
    }
    const float absmax = _mm512_reduce_max_ps(top);
    const float scale = (absmax > 1e-12f ? absmax : 1e-12f) / 127.0f;
    const __m512 s = _mm512_set1_ps(scale), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    const __m512i off = _mm512_set1_epi32(offset);
    for (ptrdiff_t d = 0; d < kp; d += 16) {
        const ptrdiff_t left = k - d;
        const __mmask16 m = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + d), s),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        /* NOTE: NaN second in min and max, so that it stays NaN and converts as (int) does */
        q = _mm512_max_ps(lo, _mm512_min_ps(hi, q));
        _mm_storeu_si128((__m128i *)(out + d), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(q), off)));
    }
    return scale;
}
#else
static int sloserve_vnni_set(int on) {
    (void)on;
    return 0;
}
static float sloserve_quantize_row_avx512(const float *x, ptrdiff_t k, ptrdiff_t kp, int offset, uint8_t *out) {
    return sloserve_quantize_row(x, k, kp, offset, out);
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
    for (ptrdiff_t b = 0; b < batch; b++)
        xs[b] = sloserve_vnni_enabled ? sloserve_quantize_row_avx512(x + b * k, k, kp, 128, xq + b * kp)
                                      : sloserve_quantize_row(x + b * k, k, kp, 128, xq + b * kp);
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
