/* The decode step's matrix-vector products over weights of one element type: included by
 * _decode_step.h once per type (no include guard), with the macros _paged_attention_rows.h takes
 * (SLOSERVE_T, SLOSERVE_T_NAME, SLOSERVE_T_LOAD8, SLOSERVE_T_AT: its kernels of the same type
 * are the ones these call) and
 *
 *     SLOSERVE_T_SCALE(v, w, row)   the dot product v of weight row `row` of w (a
 *                                   sloserve_weight) as the row's value: v itself for float32
 *                                   and bf16; a type with per-row scales multiplies here
 *
 * which it undefines. x and y are float32 and every value is summed as sloserve_dot sums it
 * (lane i adds the products at d = i mod 8 in order, the tail past the last multiple of 8 goes to
 * lane 0, then the lanes fold), whichever kernel below computes it: a row's result does not
 * depend on the batch it is in, the rows beside it, the thread or the instruction set.
 */

SLOSERVE_INLINE float SLOSERVE_T_NAME(sloserve_dot1)(const SLOSERVE_T *w, const float *x, ptrdiff_t k) {
    sloserve_v8 acc = {0};
    ptrdiff_t d = 0;
    for (; d + 8 <= k; d += 8) acc += SLOSERVE_T_LOAD8(w + d) * sloserve_load8(x + d);
    acc = SLOSERVE_T_NAME(sloserve_tail)(acc, w, x, d, k);
    const sloserve_v8 zero = {0};
    return sloserve_fold4(acc, zero, zero, zero)[0];
}

/* Four weight rows (w, w + k, ...) against one x: one load of x serves four rows. */
SLOSERVE_INLINE sloserve_v4 SLOSERVE_T_NAME(sloserve_dot4)(const SLOSERVE_T *w, const float *x, ptrdiff_t k) {
    sloserve_v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    ptrdiff_t d = 0;
    for (; d + 8 <= k; d += 8) {
        const sloserve_v8 xv = sloserve_load8(x + d);
        a0 += SLOSERVE_T_LOAD8(w + d) * xv;
        a1 += SLOSERVE_T_LOAD8(w + k + d) * xv;
        a2 += SLOSERVE_T_LOAD8(w + 2 * k + d) * xv;
        a3 += SLOSERVE_T_LOAD8(w + 3 * k + d) * xv;
    }
    return sloserve_fold4(SLOSERVE_T_NAME(sloserve_tail)(a0, w, x, d, k),
                          SLOSERVE_T_NAME(sloserve_tail)(a1, w + k, x, d, k),
                          SLOSERVE_T_NAME(sloserve_tail)(a2, w + 2 * k, x, d, k),
                          SLOSERVE_T_NAME(sloserve_tail)(a3, w + 3 * k, x, d, k));
}

/* dots[4 b + r] = x[b] . w[j + r] for r < n (n <= 4) and every b, each row's value as
 * SLOSERVE_T_SCALE gives it. */
SLOSERVE_INLINE void SLOSERVE_T_NAME(sloserve_dots)(const sloserve_weight *weight, const float *x, ptrdiff_t batch,
                                                    ptrdiff_t k, ptrdiff_t j, ptrdiff_t n, float *dots) {
    const SLOSERVE_T *rows = (const SLOSERVE_T *)weight->data + j * k;
    if (n < 4) {
        for (ptrdiff_t b = 0; b < batch; b++)
            for (ptrdiff_t r = 0; r < n; r++)
                dots[4 * b + r] = SLOSERVE_T_SCALE(SLOSERVE_T_NAME(sloserve_dot1)(rows + r * k, x + b * k, k), weight, j + r);
        return;
    }
    ptrdiff_t b = 0;
    for (; b + 2 <= batch; b += 2) {
        sloserve_v4 s0, s1;
        /* each weight load: two sequences */
        SLOSERVE_T_NAME(sloserve_dot4x2_strided)(x + b * k, x + (b + 1) * k, rows, k, k, &s0, &s1);
        memcpy(dots + 4 * b, &s0, sizeof s0);
        memcpy(dots + 4 * (b + 1), &s1, sizeof s1);
    }
    if (b < batch) {
        const sloserve_v4 s0 = SLOSERVE_T_NAME(sloserve_dot4)(rows, x + b * k, k);
        memcpy(dots + 4 * b, &s0, sizeof s0);
    }
    for (b = 0; b < batch; b++)
        for (ptrdiff_t r = 0; r < 4; r++) dots[4 * b + r] = SLOSERVE_T_SCALE(dots[4 * b + r], weight, j + r);
}

/* y[b, j] = (accumulate ? y[b, j] + : ) (x[b] . w[j] + bias[j]) for rows j in [j0, j1) and every b
 * (x: [batch, k] contiguous, batch <= SLOSERVE_MAX_BATCH; y: row stride ldy). */
SLOSERVE_CLONES
static void SLOSERVE_T_NAME(sloserve_gemv_rows)(const sloserve_weight *w, const float *bias, const float *x,
                                                ptrdiff_t batch, ptrdiff_t k, ptrdiff_t j0, ptrdiff_t j1, float *y,
                                                ptrdiff_t ldy, int accumulate) {
    float dots[4 * SLOSERVE_MAX_BATCH];
    for (ptrdiff_t j = j0; j < j1; j += 4) {
        const ptrdiff_t n = j1 - j < 4 ? j1 - j : 4;
        SLOSERVE_T_NAME(sloserve_dots)(w, x, batch, k, j, n, dots);
        for (ptrdiff_t b = 0; b < batch; b++)
            for (ptrdiff_t r = 0; r < n; r++) {
                float v = dots[4 * b + r];
                if (bias) v = v + bias[j + r];
                y[b * ldy + j + r] = accumulate ? y[b * ldy + j + r] + v : v;
            }
    }
}

/* act[b, j] = silu(x[b] . w[j] + bg[j]) * (x[b] . w[inter + j] + bu[j]) for j in [j0, j1). */
SLOSERVE_CLONES
static void SLOSERVE_T_NAME(sloserve_swiglu_rows)(const sloserve_weight *w, const float *bias, const float *x,
                                                  ptrdiff_t batch, ptrdiff_t k, ptrdiff_t inter, ptrdiff_t j0,
                                                  ptrdiff_t j1, float *act) {
    float gates[4 * SLOSERVE_MAX_BATCH], ups[4 * SLOSERVE_MAX_BATCH];
    for (ptrdiff_t j = j0; j < j1; j += 4) {
        const ptrdiff_t n = j1 - j < 4 ? j1 - j : 4;
        SLOSERVE_T_NAME(sloserve_dots)(w, x, batch, k, j, n, gates);
        SLOSERVE_T_NAME(sloserve_dots)(w, x, batch, k, inter + j, n, ups);
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

#undef SLOSERVE_T
#undef SLOSERVE_T_NAME
#undef SLOSERVE_T_LOAD8
#undef SLOSERVE_T_AT
#undef SLOSERVE_T_SCALE
