/* The decode step's matrix-vector products over int4 weights (W4A16), read in the one layout
 * Int4Linear holds them in: torch's CPU int4 layout (`_convert_weight_to_int4pack_for_cpu`, the
 * same bytes `_weight_int4pack_mm_for_cpu` reads) and its scales_and_zeros.
 *
 * The layout: each block of 64 output rows is [in, 32] bytes; byte j of input d holds row j's
 * value (low 4 bits) and row j + 32's (high 4 bits), v in 0..15. Scales and zeros are
 * [groups, out, 2] (float32 or bf16, the model's dtype), w = (v - 8) * scale + zero for the
 * inputs of group g = d / group. So a block is read input by input: 32 bytes give 64 rows'
 * weights, unpacked in registers into four vectors of 16 floats, each multiplied by the
 * activation broadcast (float32, not rounded) and summed in float32 lanes, one per row, in input
 * order within a group. A group's sums S_g = sum(v x) close with
 *
 *     y += scale_g * S_g + (zero_g - 8 scale_g) * sum_g(x)
 *
 * in group order, so a row's result does not depend on the batch, the rows beside it or the
 * threads; it differs from torch's kernel (which sums bf16 products in its own order) within
 * rounding. Up to four sequences share each unpacked block of weights. Work is split by blocks of
 * 64 rows (the caller's row range is rounded down to them, so threads still cover each row once),
 * which needs the weight's rows, and a gate_up's gate rows, to be multiples of 64 (fused.py
 * checks). Compiled with a target attribute (AVX-512F), so the module builds and runs on any
 * x86-64; elsewhere a scalar loop computes the same sums in the same order.
 */
#ifndef SLOSERVE_DECODE_STEP_INT4_H
#define SLOSERVE_DECODE_STEP_INT4_H

#define SLOSERVE_I4_BLOCK 64 /* rows of a block of the layout */
#define SLOSERVE_I4_TILE 4   /* sequences sharing one unpacking of a block */

/* Whether int4 products take AVX-512 (set once by sloserve_int4_set; the scalar loop otherwise). */
static int sloserve_int4_avx512 = 0;

/* Scale and zero of row `row`, group `g` of an int4 weight (scales_zeros float32 or bf16). */
static inline void sloserve_i4_scale_zero(const sloserve_weight *w, ptrdiff_t g, ptrdiff_t row, float *scale,
                                          float *zero) {
    const ptrdiff_t at = (g * w->rows + row) * 2;
    if (w->scale_bf16) {
        const uint16_t *sz = (const uint16_t *)w->scales_zeros;
        *scale = sloserve_bf16_float(sz[at]);
        *zero = sloserve_bf16_float(sz[at + 1]);
    } else {
        *scale = ((const float *)w->scales_zeros)[at];
        *zero = ((const float *)w->scales_zeros)[at + 1];
    }
}

/* Each group's sum of each activation row: xsum[b * groups + g] (float32, in input order). */
static void sloserve_i4_group_sums(const float *x, ptrdiff_t batch, ptrdiff_t k, ptrdiff_t group, float *xsum) {
    for (ptrdiff_t b = 0; b < batch; b++)
        for (ptrdiff_t g = 0; g < k / group; g++) {
            float sum = 0.0f;
            for (ptrdiff_t d = g * group; d < (g + 1) * group; d++) sum += x[b * k + d];
            xsum[b * (k / group) + g] = sum;
        }
}

/* The scalar loop: out[b * 64 + r] = x[b] . w[j + r] for the block at row j (r < 64, b < nb),
 * xsum the rows' group sums. */
static void sloserve_i4_block_scalar(const sloserve_weight *w, const float *x, const float *xsum, ptrdiff_t nb,
                                     ptrdiff_t k, ptrdiff_t j, float *out) {
    const uint8_t *blk = (const uint8_t *)w->data + j * k / 2;
    const ptrdiff_t group = w->group, groups = k / group;
    for (ptrdiff_t b = 0; b < nb; b++)
        for (ptrdiff_t r = 0; r < SLOSERVE_I4_BLOCK; r++) {
            const int shift = r < 32 ? 0 : 4;
            const ptrdiff_t col = r % 32;
            float y = 0.0f;
            for (ptrdiff_t g = 0; g < groups; g++) {
                float s = 0.0f, scale, zero;
                for (ptrdiff_t d = g * group; d < (g + 1) * group; d++)
                    s += (float)((blk[d * 32 + col] >> shift) & 15) * x[b * k + d];
                sloserve_i4_scale_zero(w, g, j + r, &scale, &zero);
                y += scale * s + (zero - 8.0f * scale) * xsum[b * groups + g];
            }
            out[b * SLOSERVE_I4_BLOCK + r] = y;
        }
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && __GNUC__ >= 10
#include <immintrin.h>

#define SLOSERVE_I4_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
#define SLOSERVE_I4_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl")))

static int sloserve_int4_set(int on) {
    __builtin_cpu_init();
    sloserve_int4_avx512 = on && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    return sloserve_int4_avx512;
}

/* Scales and zeros of 16 rows from `row`, group g, as two vectors. */
SLOSERVE_I4_INLINE void sloserve_i4_sz16(const sloserve_weight *w, ptrdiff_t g, ptrdiff_t row, __m512 *scale,
                                         __m512 *zero) {
    const ptrdiff_t at = (g * w->rows + row) * 2;
    __m512 lo, hi;
    if (w->scale_bf16) {
        const uint16_t *sz = (const uint16_t *)w->scales_zeros + at;
        lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)sz)), 16));
        hi = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(sz + 16))), 16));
    } else {
        lo = _mm512_loadu_ps((const float *)w->scales_zeros + at);
        hi = _mm512_loadu_ps((const float *)w->scales_zeros + at + 16);
    }
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    *scale = _mm512_permutex2var_ps(lo, even, hi);
    *zero = _mm512_permutex2var_ps(lo, odd, hi);
}

/* sloserve_i4_block_scalar's sums on AVX-512, NB sequences (1..4) sharing each unpacked input. */
#define SLOSERVE_I4_DEFINE_BLOCK(NB)                                                                              \
    SLOSERVE_I4_INLINE void sloserve_i4_block##NB(const sloserve_weight *w, const float *x, const float *xsum,   \
                                                  ptrdiff_t k, ptrdiff_t j, float *out) {                         \
        const uint8_t *blk = (const uint8_t *)w->data + j * k / 2;                                                \
        const ptrdiff_t group = w->group, groups = k / group;                                                     \
        const __m512i nibble = _mm512_set1_epi32(15);                                                             \
        for (int i = 0; i < NB * 4; i++) _mm512_storeu_ps(out + 16 * i, _mm512_setzero_ps());                     \
        for (ptrdiff_t g = 0; g < groups; g++) {                                                                  \
            __m512 acc[NB][4];                                                                                    \
            for (int b = 0; b < NB; b++)                                                                          \
                for (int q = 0; q < 4; q++) acc[b][q] = _mm512_setzero_ps();                                      \
            for (ptrdiff_t d = g * group; d < (g + 1) * group; d++) {                                             \
                const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + d * 32)));        \
                const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + d * 32 + 16)));   \
                const __m512 w0 = _mm512_cvtepi32_ps(_mm512_and_si512(b0, nibble));                               \
                const __m512 w1 = _mm512_cvtepi32_ps(_mm512_and_si512(b1, nibble));                               \
                const __m512 w2 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4));                                   \
                const __m512 w3 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4));                                   \
                for (int b = 0; b < NB; b++) {                                                                    \
                    const __m512 xv = _mm512_set1_ps(x[b * k + d]);                                               \
                    acc[b][0] = _mm512_fmadd_ps(w0, xv, acc[b][0]);                                               \
                    acc[b][1] = _mm512_fmadd_ps(w1, xv, acc[b][1]);                                               \
                    acc[b][2] = _mm512_fmadd_ps(w2, xv, acc[b][2]);                                               \
                    acc[b][3] = _mm512_fmadd_ps(w3, xv, acc[b][3]);                                               \
                }                                                                                                 \
            }                                                                                                     \
            for (int q = 0; q < 4; q++) {                                                                         \
                __m512 scale, zero;                                                                               \
                sloserve_i4_sz16(w, g, j + 16 * q, &scale, &zero);                                                \
                const __m512 shift = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);                         \
                for (int b = 0; b < NB; b++) {                                                                    \
                    float *at = out + b * SLOSERVE_I4_BLOCK + 16 * q;                                             \
                    const __m512 xs = _mm512_set1_ps(xsum[b * groups + g]);                                       \
                    const __m512 v = _mm512_add_ps(_mm512_mul_ps(scale, acc[b][q]), _mm512_mul_ps(shift, xs));    \
                    _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), v));                                  \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    }

SLOSERVE_I4_DEFINE_BLOCK(1)
SLOSERVE_I4_DEFINE_BLOCK(2)
SLOSERVE_I4_DEFINE_BLOCK(3)
SLOSERVE_I4_DEFINE_BLOCK(4)

/* out[b * 64 + r] = x[b] . w[j + r] for the block at row j, nb (<= 4) sequences. */
SLOSERVE_I4_TARGET
static void sloserve_i4_block_avx512(const sloserve_weight *w, const float *x, const float *xsum, ptrdiff_t nb,
                                     ptrdiff_t k, ptrdiff_t j, float *out) {
    switch (nb) {
    case 1: sloserve_i4_block1(w, x, xsum, k, j, out); break;
    case 2: sloserve_i4_block2(w, x, xsum, k, j, out); break;
    case 3: sloserve_i4_block3(w, x, xsum, k, j, out); break;
    default: sloserve_i4_block4(w, x, xsum, k, j, out); break;
    }
}

#ifdef SLOSERVE_HAVE_DPBF16
#define SLOSERVE_I4_DP_INLINE \
    static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* Two inputs' bytes (d, d + 1) of 16 rows as bf16 pairs: lane i holds row i's (128 + v) at d and
 * d + 1, for the low nibbles (*lo) and the high ones (*hi). 0x4300 | v is the bf16 of 128 + v. */
SLOSERVE_I4_DP_INLINE void sloserve_i4_pairs(const uint8_t *p, __m512i *lo, __m512i *hi) {
    const __m512i mask = _mm512_set1_epi32(0x000F000F), base = _mm512_set1_epi32(0x43004300);
    const __m512i c = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)),
                                      _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 32))), 16));
    /* (c & mask) | base */
    *lo = _mm512_ternarylogic_epi32(c, mask, base, 0xEA);
    *hi = _mm512_ternarylogic_epi32(_mm512_srli_epi32(c, 4), mask, base, 0xEA);
}

/* The block's sums on AVX512-BF16 dot products, NB sequences of activations rounded to bf16 (xb,
 * row stride kp; xsum their group sums): each pair of inputs in one instruction, summing
 * (128 + v) x, the 128 x taken back with the group's sum. */
#define SLOSERVE_I4_DEFINE_DP(NB)                                                                                 \
    SLOSERVE_I4_DP_INLINE void sloserve_i4_dp##NB(const sloserve_weight *w, const uint16_t *xb, ptrdiff_t kp,   \
                                                  const float *xsum, ptrdiff_t k, ptrdiff_t j, float *out) {      \
        const uint8_t *blk = (const uint8_t *)w->data + j * k / 2;                                                \
        const ptrdiff_t group = w->group, groups = k / group;                                                     \
        for (int i = 0; i < NB * 4; i++) _mm512_storeu_ps(out + 16 * i, _mm512_setzero_ps());                     \
        for (ptrdiff_t g = 0; g < groups; g++) {                                                                  \
            __m512 acc[NB][4];                                                                                    \
            for (int b = 0; b < NB; b++)                                                                          \
                for (int q = 0; q < 4; q++) acc[b][q] = _mm512_setzero_ps();                                      \
            for (ptrdiff_t d = g * group; d < (g + 1) * group; d += 2) {                                          \
                __m512i w0, w1, w2, w3;                                                                           \
                sloserve_i4_pairs(blk + d * 32, &w0, &w2);                                                        \
                sloserve_i4_pairs(blk + d * 32 + 16, &w1, &w3);                                                   \
                for (int b = 0; b < NB; b++) {                                                                    \
                    uint32_t pair;                                                                                \
                    memcpy(&pair, xb + b * kp + d, sizeof(pair));                                                 \
                    const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);                                   \
                    acc[b][0] = _mm512_dpbf16_ps(acc[b][0], (__m512bh)w0, xv);                                    \
                    acc[b][1] = _mm512_dpbf16_ps(acc[b][1], (__m512bh)w1, xv);                                    \
                    acc[b][2] = _mm512_dpbf16_ps(acc[b][2], (__m512bh)w2, xv);                                    \
                    acc[b][3] = _mm512_dpbf16_ps(acc[b][3], (__m512bh)w3, xv);                                    \
                }                                                                                                 \
            }                                                                                                     \
            for (int q = 0; q < 4; q++) {                                                                         \
                __m512 scale, zero;                                                                               \
                sloserve_i4_sz16(w, g, j + 16 * q, &scale, &zero);                                                \
                const __m512 shift = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), scale, zero);                       \
                for (int b = 0; b < NB; b++) {                                                                    \
                    float *at = out + b * SLOSERVE_I4_BLOCK + 16 * q;                                             \
                    const __m512 xs = _mm512_set1_ps(xsum[b * groups + g]);                                       \
                    const __m512 v = _mm512_add_ps(_mm512_mul_ps(scale, acc[b][q]), _mm512_mul_ps(shift, xs));    \
                    _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), v));                                  \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    }

SLOSERVE_I4_DEFINE_DP(1)
SLOSERVE_I4_DEFINE_DP(2)
SLOSERVE_I4_DEFINE_DP(3)
SLOSERVE_I4_DEFINE_DP(4)

/* The block at row j against nb (<= 4) rounded sequences. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static void sloserve_i4_block_dp(const sloserve_weight *w, const uint16_t *xb, ptrdiff_t kp, const float *xsum,
                                 ptrdiff_t nb, ptrdiff_t k, ptrdiff_t j, float *out) {
    switch (nb) {
    case 1: sloserve_i4_dp1(w, xb, kp, xsum, k, j, out); break;
    case 2: sloserve_i4_dp2(w, xb, kp, xsum, k, j, out); break;
    case 3: sloserve_i4_dp3(w, xb, kp, xsum, k, j, out); break;
    default: sloserve_i4_dp4(w, xb, kp, xsum, k, j, out); break;
    }
}

/* x rounded to bf16 into xb ([batch, kp]) and the rounded rows' group sums: NULL when this
 * thread's buffer cannot grow (the caller then takes the float32 path). */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static uint16_t *sloserve_i4_round(const float *x, ptrdiff_t batch, ptrdiff_t k, ptrdiff_t kp, ptrdiff_t group,
                                   float *xsum) {
    uint16_t *xb = sloserve_rounded_buffer(batch * kp);
    if (xb == NULL) return NULL;
    sloserve_round_rows(x, batch, k, kp, xb);
    for (ptrdiff_t b = 0; b < batch; b++)
        for (ptrdiff_t g = 0; g < k / group; g++) {
            float sum = 0.0f;
            for (ptrdiff_t d = g * group; d < (g + 1) * group; d++) sum += sloserve_bf16_float(xb[b * kp + d]);
            xsum[b * (k / group) + g] = sum;
        }
    return xb;
}
#endif
#else
static int sloserve_int4_set(int on) {
    (void)on;
    return 0;
}
static void sloserve_i4_block_avx512(const sloserve_weight *w, const float *x, const float *xsum, ptrdiff_t nb,
                                     ptrdiff_t k, ptrdiff_t j, float *out) {
    sloserve_i4_block_scalar(w, x, xsum, nb, k, j, out);
}
#endif

/* The block at row j against nb sequences of x (their group sums xsum). */
static void sloserve_i4_block(const sloserve_weight *w, const float *x, const float *xsum, ptrdiff_t nb,
                              ptrdiff_t k, ptrdiff_t j, float *out) {
    if (sloserve_int4_avx512)
        sloserve_i4_block_avx512(w, x, xsum, nb, k, j, out);
    else
        sloserve_i4_block_scalar(w, x, xsum, nb, k, j, out);
}

/* y[b, j] = (accumulate ? y[b, j] + : ) (x[b] . w[j] + bias[j]) for the blocks of 64 rows in
 * [j0, j1) rounded down to blocks (gate_up: act[b, j] = silu(gate) * up, `inter` the gate rows'
 * count, y and ldy unused). */
static void sloserve_rows_i4(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                             ptrdiff_t k, ptrdiff_t inter, ptrdiff_t j0, ptrdiff_t j1, float *y, ptrdiff_t ldy,
                             int accumulate) {
    float gates[SLOSERVE_I4_TILE * SLOSERVE_I4_BLOCK], ups[SLOSERVE_I4_TILE * SLOSERVE_I4_BLOCK];
    const ptrdiff_t groups = k / w->group;
    j0 = j0 / SLOSERVE_I4_BLOCK * SLOSERVE_I4_BLOCK;
    j1 = j1 / SLOSERVE_I4_BLOCK * SLOSERVE_I4_BLOCK;
    if (j0 >= j1) return;
    /* NOTE: a few KiB (64 sequences of a 7B-shape row of 11008 inputs in groups of 32: 86 KiB) */
    float xsum[batch * groups];
    const uint16_t *xb = NULL;
    const ptrdiff_t kp = (k + 31) / 32 * 32;
#ifdef SLOSERVE_HAVE_DPBF16
    if (w->scale_bf16 && sloserve_dpbf16_enabled && sloserve_int4_avx512)
        xb = sloserve_i4_round(x, batch, k, kp, w->group, xsum);
#endif
    if (xb == NULL) sloserve_i4_group_sums(x, batch, k, w->group, xsum);
    for (ptrdiff_t j = j0; j < j1; j += SLOSERVE_I4_BLOCK)
        for (ptrdiff_t b0 = 0; b0 < batch; b0 += SLOSERVE_I4_TILE) {
            const ptrdiff_t nb = batch - b0 < SLOSERVE_I4_TILE ? batch - b0 : SLOSERVE_I4_TILE;
            const float *sums = xsum + b0 * groups;
#ifdef SLOSERVE_HAVE_DPBF16
            if (xb) {
                sloserve_i4_block_dp(w, xb + b0 * kp, kp, sums, nb, k, j, gates);
                if (inter) sloserve_i4_block_dp(w, xb + b0 * kp, kp, sums, nb, k, inter + j, ups);
            }
#endif
            if (xb == NULL) {
                sloserve_i4_block(w, x + b0 * k, sums, nb, k, j, gates);
                if (inter) sloserve_i4_block(w, x + b0 * k, sums, nb, k, inter + j, ups);
            }
            for (ptrdiff_t b = 0; b < nb; b++)
                for (ptrdiff_t r = 0; r < SLOSERVE_I4_BLOCK; r++) {
                    float v = gates[b * SLOSERVE_I4_BLOCK + r];
                    if (inter) {
                        float up = ups[b * SLOSERVE_I4_BLOCK + r];
                        if (bias) {
                            v = v + bias[j + r];
                            up = up + bias[inter + j + r];
                        }
                        y[(b0 + b) * inter + j + r] = (v / (1.0f + expf(-v))) * up;
                        continue;
                    }
                    if (bias) v = v + bias[j + r];
                    float *at = y + (b0 + b) * ldy + j + r;
                    *at = accumulate ? *at + v : v;
                }
        }
}

/* sloserve_gemv_rows on int4 weights. */
static void sloserve_gemv_rows_i4(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                                  ptrdiff_t k, ptrdiff_t j0, ptrdiff_t j1, float *y, ptrdiff_t ldy, int accumulate) {
    sloserve_rows_i4(w, bias, x, batch, k, 0, j0, j1, y, ldy, accumulate);
}

/* sloserve_swiglu_rows on int4 weights. */
static void sloserve_swiglu_rows_i4(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                                    ptrdiff_t k, ptrdiff_t inter, ptrdiff_t j0, ptrdiff_t j1, float *act) {
    sloserve_rows_i4(w, bias, x, batch, k, inter, j0, j1, act, inter, 0);
}

#endif
