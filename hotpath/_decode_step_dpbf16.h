/* The decode step's bf16 matrix-vector products on AVX512-BF16 dot products (_decode_step.h picks
 * them at run time where the CPU has the instructions and sloserve_dpbf16_enabled is set).
 *
 * The widened path (_decode_step_gemv.h) multiplies and adds 8 widened weights per instruction
 * pair and was compute-bound at one sequence; here `vdpbf16ps` takes 32 bf16 weights against 32
 * bf16 activations per instruction, summing pairs into 16 float32 lanes, so the product streams
 * the weights at the memory's rate. Each product rounds its activation rows to bf16 once (to
 * nearest, ties to even, as torch's `.to(torch.bfloat16)` does; they are a few KiB), zero-padded
 * to a multiple of 32; the norms, rotary, attention and residual stream stay float32.
 *
 * The summation order is fixed: lane i of a row's accumulator takes the pairs (32 c + 2 i,
 * 32 c + 2 i + 1) of chunk c = 0, 1, ... in order (the last chunk masked to the row's length),
 * then _mm512_reduce_add_ps folds the lanes. A row's result therefore does not depend on the
 * batch, the rows beside it or the thread count; it does depend on the instruction set (the
 * widened path sums float32 products of unrounded activations in 8 lanes), so a CPU without
 * AVX512-BF16 gives other bits, within bf16 rounding.
 *
 * Compiled with a target attribute, so the module builds and runs on any x86-64 (and the widened
 * path serves elsewhere).
 */
#ifndef SLOSERVE_DECODE_STEP_DPBF16_H
#define SLOSERVE_DECODE_STEP_DPBF16_H

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && __GNUC__ >= 10
#define SLOSERVE_HAVE_DPBF16 1
#include <immintrin.h>
#include <stdlib.h>

#define SLOSERVE_DPBF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define SLOSERVE_DPBF16_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* Whether bf16 products take this path: set where the CPU has AVX512-BF16 (sloserve_dpbf16_set). */
static int sloserve_dpbf16_enabled = 0;

/* Turns the dot-product path on (where the CPU has AVX512-BF16) or off (the widened path, which
 * tests force); returns whether it is on. Called between steps, never during one. */
static int sloserve_dpbf16_set(int on) {
    __builtin_cpu_init();
    sloserve_dpbf16_enabled = on && __builtin_cpu_supports("avx512bf16");
    return sloserve_dpbf16_enabled;
}

/* Elements 0..n-1 of a 32-element chunk (n <= 32). */
SLOSERVE_DPBF16_INLINE __mmask32 sloserve_mask32(ptrdiff_t n) {
    return n >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1u);
}

/* rows x k floats rounded to bf16 into out ([rows, kp], kp a multiple of 32, zeros past k). */
SLOSERVE_DPBF16_INLINE void sloserve_round_rows(const float *x, ptrdiff_t rows, ptrdiff_t k, ptrdiff_t kp,
                                                uint16_t *out) {
    for (ptrdiff_t r = 0; r < rows; r++)
        for (ptrdiff_t d = 0; d < kp; d += 32) {
            const ptrdiff_t left = k - d;
            const __mmask16 lo = (__mmask16)(left >= 16 ? 0xffff : left > 0 ? (1u << left) - 1u : 0);
            const __mmask16 hi = (__mmask16)(left >= 32 ? 0xffff : left > 16 ? (1u << (left - 16)) - 1u : 0);
            const __m512 a = _mm512_maskz_loadu_ps(lo, x + r * k + d);
            const __m512 b = _mm512_maskz_loadu_ps(hi, x + r * k + d + 16);
            _mm512_storeu_si512((void *)(out + r * kp + d), (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
}

SLOSERVE_DPBF16_INLINE __m512bh sloserve_load_bh(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }

/* A weight row's chunk at d, masked to the row's length k. */
SLOSERVE_DPBF16_INLINE __m512bh sloserve_load_w(const uint16_t *w, ptrdiff_t d, ptrdiff_t k) {
    if (d + 32 <= k) return sloserve_load_bh(w + d);
    return (__m512bh)_mm512_maskz_loadu_epi16(sloserve_mask32(k - d), w + d);
}

/* Bytes ahead of a row's loads that the memory is asked for (one prefetch per 64-byte line). */
#define SLOSERVE_BF16_PREFETCH 4096

/* One weight row against one rounded x row (kp elements, zero-padded), read front to back: the
 * 16 lanes of its accumulator, each chunk added in order (the header's summation order). */
SLOSERVE_DPBF16_INLINE __m512 sloserve_dp_row(const uint16_t *w, const uint16_t *x, ptrdiff_t k) {
    __m512 a = _mm512_setzero_ps();
    ptrdiff_t d = 0;
    for (; d + 32 <= k; d += 32) {
        _mm_prefetch((const char *)(w + d) + SLOSERVE_BF16_PREFETCH, _MM_HINT_T0);
        a = _mm512_dpbf16_ps(a, sloserve_load_bh(w + d), sloserve_load_bh(x + d));
    }
    if (d < k) a = _mm512_dpbf16_ps(a, sloserve_load_w(w, d, k), sloserve_load_bh(x + d));
    return a;
}

/* The same against two rounded x rows: each weight load serves both sequences. */
SLOSERVE_DPBF16_INLINE void sloserve_dp_row2(const uint16_t *w, const uint16_t *x0, const uint16_t *x1, ptrdiff_t k,
                                             __m512 *s0, __m512 *s1) {
    __m512 a = _mm512_setzero_ps(), b = a;
    ptrdiff_t d = 0;
    for (; d + 32 <= k; d += 32) {
        _mm_prefetch((const char *)(w + d) + SLOSERVE_BF16_PREFETCH, _MM_HINT_T0);
        const __m512bh r = sloserve_load_bh(w + d);
        a = _mm512_dpbf16_ps(a, r, sloserve_load_bh(x0 + d));
        b = _mm512_dpbf16_ps(b, r, sloserve_load_bh(x1 + d));
    }
    if (d < k) {
        const __m512bh r = sloserve_load_w(w, d, k);
        a = _mm512_dpbf16_ps(a, r, sloserve_load_bh(x0 + d));
        b = _mm512_dpbf16_ps(b, r, sloserve_load_bh(x1 + d));
    }
    *s0 = a, *s1 = b;
}

/* dots[4 b + r] = xb[b] . w[j + r] for r < n (n <= 4) and every b (xb: [batch, kp] rounded). Each
 * row is summed whole before the next, so the weights are read in memory order (four rows read a
 * chunk of each at a time streamed at about two thirds of the rate on a Zen 4), against two
 * sequences a pass (the first pair reads a row from memory, the others from the cache). */
SLOSERVE_DPBF16_INLINE void sloserve_dots_dpbf16(const uint16_t *w, const uint16_t *xb, ptrdiff_t batch,
                                                 ptrdiff_t k, ptrdiff_t kp, ptrdiff_t j, ptrdiff_t n, float *dots) {
    const uint16_t *rows = w + j * k;
    for (ptrdiff_t b = 0; b < batch; b += 2) {
        const int pair = b + 1 < batch;
        for (ptrdiff_t r = 0; r < n; r++) {
            __m512 s0, s1;
            if (pair) {
                sloserve_dp_row2(rows + r * k, xb + b * kp, xb + (b + 1) * kp, k, &s0, &s1);
                dots[4 * (b + 1) + r] = _mm512_reduce_add_ps(s1);
            } else
                s0 = sloserve_dp_row(rows + r * k, xb + b * kp, k);
            dots[4 * b + r] = _mm512_reduce_add_ps(s0);
        }
    }
}

/* This thread's buffer for the rounded activations, grown as needed (NULL when it cannot be). */
static uint16_t *sloserve_rounded_buffer(ptrdiff_t elements) {
    static __thread uint16_t *buffer;
    static __thread ptrdiff_t capacity;
    if (elements > capacity) {
        free(buffer);
        buffer = (uint16_t *)aligned_alloc(64, (size_t)((elements + 31) / 32 * 64));
        capacity = buffer ? elements : 0;
    }
    return buffer;
}

/* sloserve_gemv_rows_bf16's result on dot products, the rounded activations in xb ([batch, kp]). */
SLOSERVE_DPBF16_TARGET
static void sloserve_gemv_rows_dpbf16_in(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                                         ptrdiff_t k, ptrdiff_t kp, ptrdiff_t j0, ptrdiff_t j1, float *y,
                                         ptrdiff_t ldy, int accumulate, uint16_t *xb) {
    sloserve_round_rows(x, batch, k, kp, xb);
    float dots[4 * SLOSERVE_MAX_BATCH];
    for (ptrdiff_t j = j0; j < j1; j += 4) {
        const ptrdiff_t n = j1 - j < 4 ? j1 - j : 4;
        sloserve_dots_dpbf16((const uint16_t *)w->data, xb, batch, k, kp, j, n, dots);
        for (ptrdiff_t b = 0; b < batch; b++)
            for (ptrdiff_t r = 0; r < n; r++) {
                float v = dots[4 * b + r];
                if (bias) v = v + bias[j + r];
                y[b * ldy + j + r] = accumulate ? y[b * ldy + j + r] + v : v;
            }
    }
}

/* sloserve_swiglu_rows_bf16's result on dot products, the rounded activations in xb. */
SLOSERVE_DPBF16_TARGET
static void sloserve_swiglu_rows_dpbf16_in(const sloserve_weight *w, const float *bias, const float *x,
                                           ptrdiff_t batch, ptrdiff_t k, ptrdiff_t kp, ptrdiff_t inter, ptrdiff_t j0,
                                           ptrdiff_t j1, float *act, uint16_t *xb) {
    sloserve_round_rows(x, batch, k, kp, xb);
    float gates[4 * SLOSERVE_MAX_BATCH], ups[4 * SLOSERVE_MAX_BATCH];
    const uint16_t *data = (const uint16_t *)w->data;
    for (ptrdiff_t j = j0; j < j1; j += 4) {
        const ptrdiff_t n = j1 - j < 4 ? j1 - j : 4;
        sloserve_dots_dpbf16(data, xb, batch, k, kp, j, n, gates);
        sloserve_dots_dpbf16(data, xb, batch, k, kp, inter + j, n, ups);
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
}

/* The two with this thread's buffer for the rounded activations, or, where it finds no memory,
 * one row at a time through the stack (the same bits: a row's result does not depend on the
 * rows beside it). */
static void sloserve_gemv_rows_dpbf16(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                                      ptrdiff_t k, ptrdiff_t j0, ptrdiff_t j1, float *y, ptrdiff_t ldy, int accumulate) {
    const ptrdiff_t kp = (k + 31) / 32 * 32;
    uint16_t *xb = sloserve_rounded_buffer(batch * kp);
    if (xb) {
        sloserve_gemv_rows_dpbf16_in(w, bias, x, batch, k, kp, j0, j1, y, ldy, accumulate, xb);
        return;
    }
    uint16_t row[kp];
    for (ptrdiff_t b = 0; b < batch; b++)
        sloserve_gemv_rows_dpbf16_in(w, bias, x + b * k, 1, k, kp, j0, j1, y + b * ldy, ldy, accumulate, row);
}

static void sloserve_swiglu_rows_dpbf16(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                                        ptrdiff_t k, ptrdiff_t inter, ptrdiff_t j0, ptrdiff_t j1, float *act) {
    const ptrdiff_t kp = (k + 31) / 32 * 32;
    uint16_t *xb = sloserve_rounded_buffer(batch * kp);
    if (xb) {
        sloserve_swiglu_rows_dpbf16_in(w, bias, x, batch, k, kp, inter, j0, j1, act, xb);
        return;
    }
    uint16_t row[kp];
    for (ptrdiff_t b = 0; b < batch; b++)
        sloserve_swiglu_rows_dpbf16_in(w, bias, x + b * k, 1, k, kp, inter, j0, j1, act + b * inter, row);
}

#else
#define SLOSERVE_HAVE_DPBF16 0
static int sloserve_dpbf16_enabled = 0;
static int sloserve_dpbf16_set(int on) {
    (void)on;
    return 0;
}
/* never called: sloserve_dpbf16_enabled stays 0 */
static void sloserve_gemv_rows_dpbf16(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                                      ptrdiff_t k, ptrdiff_t j0, ptrdiff_t j1, float *y, ptrdiff_t ldy, int accumulate) {
    (void)w, (void)bias, (void)x, (void)batch, (void)k, (void)j0, (void)j1, (void)y, (void)ldy, (void)accumulate;
}
static void sloserve_swiglu_rows_dpbf16(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                                        ptrdiff_t k, ptrdiff_t inter, ptrdiff_t j0, ptrdiff_t j1, float *act) {
    (void)w, (void)bias, (void)x, (void)batch, (void)k, (void)inter, (void)j0, (void)j1, (void)act;
}
#endif

#endif
