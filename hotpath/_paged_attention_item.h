/* One work item (a sequence's KV heads, or one of them) of the in-place paged decode kernel (_paged_attention.pyx).
 *
 * Plain C so that GCC can build it for several instruction sets (target_clones: AVX-512, AVX2,
 * AVX, baseline x86-64) and pick one at load time: the wheel stays portable, a modern CPU gets wide
 * vectors. The loops are written with LANES independent accumulators, so they vectorise without
 * reassociation flags and give the same sums on every instruction set and thread count.
 *
 * The pages are float32, bf16 (uint16, widened to float32 in registers) or int8 rows each followed
 * by its bf16 scale (sloserve/layers/attention/kv_int8.py): the kernels that read them are
 * written once, in _paged_attention_rows.h, and instantiated per type below.
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

/* bf16 values as uint16: a bf16 is the high half of a float32, so widening is exact (a shift). */
typedef uint32_t sloserve_u32x8 __attribute__((vector_size(32)));

/* NOTE: built element by element, GCC 12 makes this one zero-extending load and a shift (AVX2);
 * __builtin_convertvector of a 16-byte vector made it five instructions. */
SLOSERVE_INLINE sloserve_v8 sloserve_load8_bf16(const uint16_t *p) {
    sloserve_u32x8 bits = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
    bits <<= 16;
    sloserve_v8 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

SLOSERVE_INLINE float sloserve_bf16_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* f rounded to bf16 to nearest, ties to even, as torch's `.to(torch.bfloat16)` rounds a CPU
 * tensor (every NaN becomes 0xffff there, a quiet NaN; measured on torch 2.13). */
static inline uint16_t sloserve_float_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f != f) return 0xffff;
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* Eight int8 values as float lanes (exact): each 4-byte half broadcast to four lanes, its byte
 * shifted to the top and arithmetic-shifted back down (a sign extension), then converted.
 * NOTE: GCC 12 made a lane-by-lane build (or __builtin_convertvector) eight scalar conversions and
 * inserts; this is variable shifts and one conversion on AVX2 and AVX-512. */
typedef int32_t sloserve_i32x8 __attribute__((vector_size(32)));
SLOSERVE_INLINE sloserve_v8 sloserve_load8_i8(const int8_t *p) {
    int32_t lo, hi;
    memcpy(&lo, p, sizeof lo);
    memcpy(&hi, p + 4, sizeof hi);
    const sloserve_i32x8 up = {24, 16, 8, 0, 24, 16, 8, 0};
    sloserve_i32x8 v = {lo, lo, lo, lo, hi, hi, hi, hi};
    v = (v << up) >> 24;
    return __builtin_convertvector(v, sloserve_v8);
}

/* The bf16 scale stored after the `dim` values of an int8 KV row (unaligned), as a float. */
SLOSERVE_INLINE float sloserve_kv8_scale(const int8_t *row, ptrdiff_t dim) {
    uint16_t s;
    memcpy(&s, row + dim, sizeof s);
    return sloserve_bf16_float(s);
}

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

/* Rows per work item at most (a sequence's verify rows or chunk tokens attend together in tiles of
 * this many): the scores of one item are this many rows' (sloserve_paged_item). */
#define SLOSERVE_ROWS_PER_ITEM 16

/* Cuts `batch` query rows into runs that one work item attends together: rows b .. b + n - 1 whose
 * lengths count up by one and whose block tables agree with the run's first over every page the
 * row reads (one sequence's consecutive tokens; rows of other sequences that share those pages
 * give the same result either way), at most SLOSERVE_ROWS_PER_ITEM each. first[i] is run i's
 * first row, first[runs] = batch (first holds batch + 1). Returns the number of runs. */
static inline ptrdiff_t sloserve_row_runs(const int32_t *tables, ptrdiff_t width, const int32_t *lens,
                                          ptrdiff_t page, ptrdiff_t batch, ptrdiff_t *first) {
    ptrdiff_t runs = 0;
    for (ptrdiff_t b = 0; b < batch; b++) {
        const ptrdiff_t head = runs ? first[runs - 1] : 0, blocks = (lens[b] + page - 1) / page;
        if (runs == 0 || b - head >= SLOSERVE_ROWS_PER_ITEM || lens[b] != lens[b - 1] + 1 ||
            memcmp(tables + head * width, tables + b * width, blocks * sizeof(int32_t)) != 0)
            first[runs++] = b;
    }
    first[runs] = batch;
    return runs;
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

/* The kernels that read rows of one element type (K/V pages, weights), once per type: float32,
 * and bf16 (uint16, the high half of a float32, widened in registers). Everything they sum is
 * float32, in the same lanes and order whatever the type. */
#define SLOSERVE_T float
#define SLOSERVE_T_NAME(name) name##_f32
#define SLOSERVE_T_LOAD8(p) sloserve_load8(p)
#define SLOSERVE_T_AT(p, i) ((p)[i])
#include "_paged_attention_rows.h"

#define SLOSERVE_T uint16_t
#define SLOSERVE_T_NAME(name) name##_bf16
#define SLOSERVE_T_LOAD8(p) sloserve_load8_bf16(p)
#define SLOSERVE_T_AT(p, i) sloserve_bf16_float((p)[i])
#include "_paged_attention_rows.h"

/* An int8 KV row of `n` floats: absmax / 127 rounded to bf16 is the scale, round(v / scale) the
 * values (clamped to +-127), then the scale's bytes, as kv_int8.quantize_rows writes it (a row of
 * zeros has scale 0). */
static inline void sloserve_kv8_store(int8_t *row, const float *v, ptrdiff_t n) {
    float absmax = 0.0f;
    for (ptrdiff_t d = 0; d < n; d++) absmax = fabsf(v[d]) > absmax ? fabsf(v[d]) : absmax;
    const uint16_t bits = sloserve_float_bf16(absmax / 127.0f);
    const float scale = sloserve_bf16_float(bits), divisor = scale > 0.0f ? scale : 1.0f;
    for (ptrdiff_t d = 0; d < n; d++) {
        float r = nearbyintf(v[d] / divisor);
        row[d] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
    memcpy(row + n, &bits, sizeof bits);
}

#define SLOSERVE_KV8_SCALE_BYTES 2
#define SLOSERVE_T int8_t
#define SLOSERVE_T_NAME(name) name##_kv8
#define SLOSERVE_T_LOAD8(p) sloserve_load8_i8(p)
#define SLOSERVE_T_AT(p, i) ((float)(p)[i])
#define SLOSERVE_T_PITCH(dim) ((dim) + SLOSERVE_KV8_SCALE_BYTES)
#define SLOSERVE_T_ROW_SCALE(row, dim) sloserve_kv8_scale(row, dim)
#include "_paged_attention_rows.h"

#endif
