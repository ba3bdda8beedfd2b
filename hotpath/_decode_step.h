/* A whole decode step of a dense decoder in one call (_decode_step.pyx): no per-op dispatch.
 *
 * A small batch's decode step spends more time dispatching ~20 torch ops per layer than doing
 * their arithmetic (a 3M-parameter model: ~0.8 ms per step, ~0.3 ms of it matmuls). Here the
 * same step is plain C run by a persistent team of threads (_team.h): matrix-vector products split
 * by output rows between the threads, the small per-row work (norms, rotary, KV writes) on one thread,
 * attention in work items as in _paged_attention.pyx, a spinning barrier between
 * stages (sloserve_barrier_wait).
 *
 * Per layer, exactly as DecoderModel.decode computes it (its pure-torch twin):
 *     x = rms_norm(h, ln1);  qkv = x W_qkv^T + b;  q, k = rope(q, k);  cache[slot] = k, v
 *     h = h + (attend(q, cache) W_o^T + b_o)
 *     x = rms_norm(h, ln2);  h = h + ((silu(x W_g^T + b_g) * (x W_u^T + b_u)) W_d^T + b_d)
 * then logits = rms_norm(h, norm) W_lm^T. Norms and rotary round as _cpu_ops does; the dot
 * products sum in 8 independent lanes (four weight rows per load of x), so they differ from a
 * BLAS in the last bits (as any two BLAS do) but not between thread counts or instruction sets.
 *
 * The weight matrices (embed, lm_head, each layer's four) are float32 or bf16 (sloserve_weight;
 * _decode_step_gemv.h is instantiated once per type), or int8 rows with a scale each
 * (_decode_step_int8.h: W8A8, exact integer sums; an int8 embedding row is read as its weights
 * times its scale), and the KV pages float32
 * or bf16 (K/V rounded to bf16 when written, as torch rounds). bf16 products run on AVX512-BF16
 * dot products where the CPU has them (_decode_step_dpbf16.h: each product's activation rows
 * rounded to bf16, sums in a fixed order of their own, so those bits depend on the instruction
 * set), else the weight is widened to float32 in registers and the step computes the float32
 * step's arithmetic on the widened weights, in the same lanes. Either way the activations, norms,
 * rotary, softmax and the residual stream stay float32, and the weights are read in half the bytes.
 */
#ifndef SLOSERVE_DECODE_STEP_H
#define SLOSERVE_DECODE_STEP_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_paged_attention_item.h"
#include "_team.h"

#define SLOSERVE_MAX_BATCH 64 /* rows (query tokens) per call, at most (the caller checks) */



/* Element types of the weight matrices and the KV pages; activations and sums are float32 always. */
enum { SLOSERVE_F32 = 0, SLOSERVE_BF16 = 1, SLOSERVE_I8 = 2, SLOSERVE_I4 = 3 };

/* A weight matrix [out, in], read in place: `data` of `type` (SLOSERVE_F32: float; SLOSERVE_BF16:
 * uint16_t; SLOSERVE_I8: int8_t, with a float scale and the int32 sum of its weights per row;
 * NULL for the others). The embedding's rowsum stays NULL (only a product reads it). SLOSERVE_I4:
 * torch's CPU int4 layout with its scales_zeros ([groups, rows, 2], bf16 when scale_bf16, else
 * float32), `group` inputs to a group (_decode_step_int4.h). */
typedef struct {
    const void *data;
    const float *scale;
    const int32_t *rowsum;
    int type;
    const void *scales_zeros;
    ptrdiff_t rows;
    int group, scale_bf16;
} sloserve_weight;

typedef struct {
    const float *ln1, *ln2;          /* [H] */
    sloserve_weight qkv_w;           /* [(Hq + 2 Hkv) D, H] */
    const float *qkv_b;              /* bias or NULL */
    sloserve_weight o_w;             /* [H, Hq D] */
    const float *o_b;
    sloserve_weight gate_up_w;       /* [2I, H]: gate rows, then up rows */
    const float *gate_up_b;
    sloserve_weight down_w;          /* [H, I] */
    const float *down_b;
    void *k_cache, *v_cache;         /* [P, page, Hkv, D] of the decoder's kv_type ([.., D + 2] bytes: I8) */
} sloserve_layer;

typedef struct {
    ptrdiff_t hidden, heads, kv_heads, head_dim, inter, vocab, num_layers, page, num_pages;
    float eps, scale;
    int kv_type;                /* SLOSERVE_F32, SLOSERVE_BF16, or SLOSERVE_I8: int8 rows and their scales */
    sloserve_weight embed;      /* [V, H] */
    const float *norm;          /* [H] */
    sloserve_weight lm_head;    /* [V, H]; a tied head is the embedding */
    const float *cos, *sin;     /* [max positions, D] */
    const sloserve_layer *layers;
} sloserve_decoder;

/* Query rows one attention work item takes at most in a step of `batch` rows. */
static inline ptrdiff_t sloserve_item_rows(ptrdiff_t batch) {
    return batch < SLOSERVE_ROWS_PER_ITEM ? batch : SLOSERVE_ROWS_PER_ITEM;
}

/* Floats of workspace a step of `batch` sequences, the longest `max_len` long, needs on `threads` threads. */
static ptrdiff_t sloserve_decode_workspace(const sloserve_decoder *m, ptrdiff_t batch, ptrdiff_t max_len,
                                           int threads) {
    const ptrdiff_t qkv = (m->heads + 2 * m->kv_heads) * m->head_dim;
    return batch * (2 * m->hidden + qkv + m->heads * m->head_dim + m->inter) +
           (ptrdiff_t)threads * sloserve_item_rows(batch) * m->heads * max_len;
}

/* The matrix-vector products, once per weight type (_decode_step_gemv.h), and their dispatch. */
#define SLOSERVE_T float
#define SLOSERVE_T_NAME(name) name##_f32
#define SLOSERVE_T_LOAD8(p) sloserve_load8(p)
#define SLOSERVE_T_AT(p, i) ((p)[i])
#define SLOSERVE_T_SCALE(v, w, row) (v)
#include "_decode_step_gemv.h"

#define SLOSERVE_T uint16_t
#define SLOSERVE_T_NAME(name) name##_bf16
#define SLOSERVE_T_LOAD8(p) sloserve_load8_bf16(p)
#define SLOSERVE_T_AT(p, i) sloserve_bf16_float((p)[i])
#define SLOSERVE_T_SCALE(v, w, row) (v)
#include "_decode_step_gemv.h"

/* bf16 products on AVX512-BF16 dot products, where the CPU has them (sloserve_dpbf16_set). */
#include "_decode_step_dpbf16.h"

/* int8 products (W8A8, per-token activation scales) on VNNI where the CPU has it (sloserve_vnni_set). */
#include "_decode_step_int8.h"

/* int4 products (W4A16, torch's int4 layout read in place) on AVX-512 where the CPU has it. */
#include "_decode_step_int4.h"

/* y[b, j] = (accumulate ? y[b, j] + : ) (x[b] . w[j] + bias[j]) for rows j in [j0, j1) and every b
 * (x: [batch, k] contiguous, batch <= SLOSERVE_MAX_BATCH; y: row stride ldy). */
static void sloserve_gemv_rows(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                               ptrdiff_t k, ptrdiff_t j0, ptrdiff_t j1, float *y, ptrdiff_t ldy, int accumulate) {
    if (w->type == SLOSERVE_I4)
        sloserve_gemv_rows_i4(w, bias, x, batch, k, j0, j1, y, ldy, accumulate);
    else if (w->type == SLOSERVE_I8)
        sloserve_gemv_rows_i8(w, bias, x, batch, k, j0, j1, y, ldy, accumulate);
    else if (w->type == SLOSERVE_BF16 && sloserve_dpbf16_enabled)
        sloserve_gemv_rows_dpbf16(w, bias, x, batch, k, j0, j1, y, ldy, accumulate);
    else if (w->type == SLOSERVE_BF16)
        sloserve_gemv_rows_bf16(w, bias, x, batch, k, j0, j1, y, ldy, accumulate);
    else
        sloserve_gemv_rows_f32(w, bias, x, batch, k, j0, j1, y, ldy, accumulate);
}

/* act[b, j] = silu(x[b] . w[j] + bg[j]) * (x[b] . w[inter + j] + bu[j]) for j in [j0, j1). */
static void sloserve_swiglu_rows(const sloserve_weight *w, const float *bias, const float *x, ptrdiff_t batch,
                                 ptrdiff_t k, ptrdiff_t inter, ptrdiff_t j0, ptrdiff_t j1, float *act) {
    if (w->type == SLOSERVE_I4)
        sloserve_swiglu_rows_i4(w, bias, x, batch, k, inter, j0, j1, act);
    else if (w->type == SLOSERVE_I8)
        sloserve_swiglu_rows_i8(w, bias, x, batch, k, inter, j0, j1, act);
    else if (w->type == SLOSERVE_BF16 && sloserve_dpbf16_enabled)
        sloserve_swiglu_rows_dpbf16(w, bias, x, batch, k, inter, j0, j1, act);
    else if (w->type == SLOSERVE_BF16)
        sloserve_swiglu_rows_bf16(w, bias, x, batch, k, inter, j0, j1, act);
    else
        sloserve_swiglu_rows_f32(w, bias, x, batch, k, inter, j0, j1, act);
}

/* Row `row` of an [rows, n] weight as n floats (exact: bf16 widens by a shift; int8 is each weight
 * times its row's scale in float32, as Int8Linear.lookup computes it). */
static void sloserve_row_float(const sloserve_weight *w, ptrdiff_t row, ptrdiff_t n, float *out) {
    if (w->type == SLOSERVE_I8) {
        const int8_t *q = (const int8_t *)w->data + row * n;
        const float scale = w->scale[row];
        for (ptrdiff_t d = 0; d < n; d++) out[d] = (float)q[d] * scale;
    } else if (w->type == SLOSERVE_BF16)
        for (ptrdiff_t d = 0; d < n; d++) out[d] = sloserve_bf16_float(((const uint16_t *)w->data)[row * n + d]);
    else
        memcpy(out, (const float *)w->data + row * n, n * sizeof(float));
}

/* heads * dim floats into slot `slot` of a cache of `type` ([slots, heads, dim]): bf16 rounds as
 * torch's `.to` does; int8 quantizes each head's row as kv_int8.quantize_rows does ([slots, heads,
 * dim + 2] bytes). */
static void sloserve_store_row(void *cache, int type, ptrdiff_t slot, const float *v, ptrdiff_t heads,
                               ptrdiff_t dim) {
    const ptrdiff_t n = heads * dim;
    if (type == SLOSERVE_I8) {
        const ptrdiff_t row = dim + SLOSERVE_KV8_SCALE_BYTES;
        for (ptrdiff_t h = 0; h < heads; h++)
            sloserve_kv8_store((int8_t *)cache + (slot * heads + h) * row, v + h * dim, dim);
    } else if (type == SLOSERVE_BF16)
        for (ptrdiff_t d = 0; d < n; d++) ((uint16_t *)cache)[slot * n + d] = sloserve_float_bf16(v[d]);
    else
        memcpy((float *)cache + slot * n, v, n * sizeof(float));
}

/* out[b] = weight * (x[b] * (1 / sqrt(mean(x[b]^2) + eps))); the sum of squares in 8 lanes, the
 * order _cpu_ops.rms_norm sums in. */
static void sloserve_rms_norm_rows(const float *x, const float *weight, ptrdiff_t rows, ptrdiff_t dim, float eps,
                                   float *out) {
    for (ptrdiff_t r = 0; r < rows; r++) {
        const float *row = x + r * dim;
        const float inv = 1.0f / sqrtf(sloserve_dot(row, row, dim) / dim + eps);
        for (ptrdiff_t d = 0; d < dim; d++) out[r * dim + d] = weight[d] * (row[d] * inv);
    }
}

/* v = v * cos + rotate_half(v) * sin for one head of `dim` floats, in place (as _cpu_ops.rope). */
static void sloserve_rope_head(float *v, const float *cos, const float *sin, ptrdiff_t dim) {
    float tmp[dim];
    const ptrdiff_t half = dim / 2;
    for (ptrdiff_t d = 0; d < half; d++) tmp[d] = v[d] * cos[d] + (-v[d + half]) * sin[d];
    for (ptrdiff_t d = half; d < dim; d++) tmp[d] = v[d] * cos[d] + v[d - half] * sin[d];
    memcpy(v, tmp, dim * sizeof(float));
}

/* A barrier between the threads of one step. Waiting threads spin (then yield) instead of
 * sleeping: a sleeping barrier (OpenMP's under OMP_WAIT_POLICY=PASSIVE, the CLI's default) costs
 * ~40 us to wake, and a step has ~8 barriers per layer. Phases count up; the
 * last thread to arrive resets the count before it publishes the next phase.
 *
 * A thread that passes `stalled_ns` (the caller's) adds to it every wait that outlasted the pause
 * phase: its partner was late, descheduled by another process more often than slower, and a step
 * that loses half its time this way runs no slower on one thread (see sloserve.executor.team). */
typedef struct {
    int arrived, phase;
} sloserve_barrier;

#define SLOSERVE_SPINS_BEFORE_YIELD 4000 /* ~0.1 ms of pause instructions */

static void sloserve_barrier_wait(sloserve_barrier *bar, int threads, int *phase, long *stalled_ns) {
    if (threads == 1) return;
    const int next = ++*phase;
    if (__atomic_add_fetch(&bar->arrived, 1, __ATOMIC_ACQ_REL) == threads) {
        __atomic_store_n(&bar->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&bar->phase, next, __ATOMIC_RELEASE);
        return;
    }
    const long since = stalled_ns ? sloserve_now_ns() : 0;
    long spins = 0;
    for (; __atomic_load_n(&bar->phase, __ATOMIC_ACQUIRE) != next; spins++)
        sloserve_pause(spins, SLOSERVE_SPINS_BEFORE_YIELD);
    if (stalled_ns && spins > SLOSERVE_SPINS_BEFORE_YIELD) *stalled_ns += sloserve_now_ns() - since;
}

/* Rows [first, last) of `rows` split evenly between `threads`: this thread's share, in chunks of 4. */
static inline void sloserve_share(ptrdiff_t rows, int thread, int threads, ptrdiff_t *first, ptrdiff_t *last) {
    const ptrdiff_t quads = (rows + 3) / 4, per = quads / threads, extra = quads % threads;
    const ptrdiff_t begin = thread * per + (thread < extra ? thread : extra);
    const ptrdiff_t end = begin + per + (thread < extra);
    *first = begin * 4 < rows ? begin * 4 : rows;
    *last = end * 4 < rows ? end * 4 : rows;
}

/* One decode step's inputs and shared state, for the threads of its team. */
typedef struct {
    const sloserve_decoder *m;
    const int64_t *ids, *positions, *slots;
    const int32_t *tables, *lens;
    ptrdiff_t width, batch, max_len;
    const int64_t *out_rows; /* the rows whose logits are computed, or NULL: every row */
    ptrdiff_t num_out;
    float *work, *logits;
    sloserve_barrier bar;
    int bad;
    long stalled_ns; /* thread 0's waits past the pause phase (sloserve_barrier_wait) */
    ptrdiff_t runs, run_first[SLOSERVE_MAX_BATCH + 1]; /* rows that attend together (sloserve_row_runs) */
} sloserve_decode_args;

/* Thread `me` of `team` runs its share of the step (sloserve_job): each matrix-vector product is
 * split by output rows (thread t takes the t-th share), thread 0 does the per-row work (norms,
 * rotary, KV writes), attention items (a run of rows' KV heads, or one of them while there are
 * fewer runs than two per thread) go round-robin; a barrier separates
 * every stage from the next. */
static void sloserve_decode_job(void *raw, int me, int team) {
    sloserve_decode_args *a = (sloserve_decode_args *)raw;
    const sloserve_decoder *m = a->m;
    const int64_t *ids = a->ids, *positions = a->positions, *slots = a->slots;
    const int32_t *tables = a->tables, *lens = a->lens;
    const ptrdiff_t width = a->width, batch = a->batch, max_len = a->max_len;
    const ptrdiff_t H = m->hidden, D = m->head_dim, Hq = m->heads, Hkv = m->kv_heads, I = m->inter;
    const ptrdiff_t group = Hq / Hkv, q_size = Hq * D, qkv_size = (Hq + 2 * Hkv) * D, row_kv = Hkv * D;
    float *h = a->work, *x = h + batch * H, *qkv = x + batch * H, *attn = qkv + batch * qkv_size;
    float *act = attn + batch * q_size, *scores = act + batch * I, *logits = a->logits;
    sloserve_barrier *bar = &a->bar;
    long *stalled = me == 0 ? &a->stalled_ns : NULL;
    int phase = 0;
    ptrdiff_t first, last;
    float *my_scores = scores + (ptrdiff_t)me * sloserve_item_rows(batch) * Hq * max_len;
    const ptrdiff_t runs = a->runs, *run_first = a->run_first;
    const ptrdiff_t per_item = sloserve_item_kv_heads(runs, Hkv, team); /* KV heads per attention item */
    if (me == 0)
        for (ptrdiff_t b = 0; b < batch; b++) sloserve_row_float(&m->embed, ids[b], H, h + b * H);
    for (ptrdiff_t l = 0; l < m->num_layers; l++) {
        const sloserve_layer *L = m->layers + l;
        if (me == 0) sloserve_rms_norm_rows(h, L->ln1, batch, H, m->eps, x);
        sloserve_barrier_wait(bar, team, &phase, stalled);
        sloserve_share(qkv_size, me, team, &first, &last);
        sloserve_gemv_rows(&L->qkv_w, L->qkv_b, x, batch, H, first, last, qkv, qkv_size, 0);
        sloserve_barrier_wait(bar, team, &phase, stalled);
        if (me == 0)
            for (ptrdiff_t b = 0; b < batch; b++) { /* rotate q and k, then write k and v to the slot */
                float *row = qkv + b * qkv_size;
                const float *cos = m->cos + positions[b] * D, *sin = m->sin + positions[b] * D;
                for (ptrdiff_t head = 0; head < Hq + Hkv; head++) sloserve_rope_head(row + head * D, cos, sin, D);
                sloserve_store_row(L->k_cache, m->kv_type, slots[b], row + q_size, Hkv, D);
                sloserve_store_row(L->v_cache, m->kv_type, slots[b], row + q_size + row_kv, Hkv, D);
            }
        sloserve_barrier_wait(bar, team, &phase, stalled);
        for (ptrdiff_t item = me; item < runs * (Hkv / per_item); item += team) {
            const ptrdiff_t run = item * per_item / Hkv, kv_head = item * per_item % Hkv;
            const ptrdiff_t b = run_first[run], n = run_first[run + 1] - b;
            const float *q = qkv + b * qkv_size + kv_head * group * D;
            float *out = attn + b * q_size + kv_head * group * D;
            const int32_t *table = tables + b * width;
            const int rc =
                m->kv_type == SLOSERVE_I8
                    ? sloserve_paged_item_kv8(q, qkv_size, n, L->k_cache, L->v_cache, table, lens[b], kv_head, per_item,
                                              group, Hkv, D, m->page, m->num_pages, m->scale, my_scores, out, q_size)
                : m->kv_type == SLOSERVE_BF16
                    ? sloserve_paged_item_bf16(q, qkv_size, n, L->k_cache, L->v_cache, table, lens[b], kv_head,
                                               per_item, group, Hkv, D, m->page, m->num_pages, m->scale, my_scores,
                                               out, q_size)
                    : sloserve_paged_item_f32(q, qkv_size, n, L->k_cache, L->v_cache, table, lens[b], kv_head, per_item,
                                              group, Hkv, D, m->page, m->num_pages, m->scale, my_scores, out, q_size);
            if (rc) __atomic_store_n(&a->bad, 1, __ATOMIC_RELAXED);
        }
        sloserve_barrier_wait(bar, team, &phase, stalled);
        sloserve_share(H, me, team, &first, &last);
        sloserve_gemv_rows(&L->o_w, L->o_b, attn, batch, q_size, first, last, h, H, 1);
        sloserve_barrier_wait(bar, team, &phase, stalled);
        if (me == 0) sloserve_rms_norm_rows(h, L->ln2, batch, H, m->eps, x);
        sloserve_barrier_wait(bar, team, &phase, stalled);
        sloserve_share(I, me, team, &first, &last);
        sloserve_swiglu_rows(&L->gate_up_w, L->gate_up_b, x, batch, H, I, first, last, act);
        sloserve_barrier_wait(bar, team, &phase, stalled);
        sloserve_share(H, me, team, &first, &last);
        sloserve_gemv_rows(&L->down_w, L->down_b, act, batch, I, first, last, h, H, 1);
        sloserve_barrier_wait(bar, team, &phase, stalled);
    }
    if (me == 0 && a->out_rows == NULL)
        sloserve_rms_norm_rows(h, m->norm, batch, H, m->eps, x);
    else if (me == 0) /* the rows asked for, gathered into the first num_out rows of x */
        for (ptrdiff_t r = 0; r < a->num_out; r++)
            sloserve_rms_norm_rows(h + a->out_rows[r] * H, m->norm, 1, H, m->eps, x + r * H);
    sloserve_barrier_wait(bar, team, &phase, stalled);
    sloserve_share(m->vocab, me, team, &first, &last);
    sloserve_gemv_rows(&m->lm_head, NULL, x, a->num_out, H, first, last, logits, m->vocab, 0);
}

/* One decode step of `batch` rows: ids, positions, KV slots [batch] int64; tables [batch, width]
 * int32; lens [batch] int32 (position + 1, at most max_len); logits [num_out, V] out, of the rows
 * out_rows names (int64, in [0, batch)), or of every row when out_rows is NULL (num_out = batch).
 *
 * A row is one query token, so several rows may be one sequence's consecutive tokens (a prefill
 * chunk or a verify step's k + 1 rows, each row with its own position and the sequence's table):
 * every row's K and V are written before any row attends, and a row attends to lens = position + 1
 * tokens, so each token sees exactly its causal prefix; such rows attend in one work item, which
 * reads each of the sequence's pages once for all of them (sloserve_row_runs). `work` holds
 * sloserve_decode_workspace(m, batch, max_len, threads) floats, threads being the team's size (1
 * when `team` is NULL: the caller alone). *stalled_ns is set to the caller's waits for late team
 * threads (0 alone). Returns 0, or -1 when a block table names a page outside the pool (then the
 * logits are undefined). */
static int sloserve_decode_step(const sloserve_decoder *m, const int64_t *ids, const int64_t *positions,
                                const int64_t *slots, const int32_t *tables, ptrdiff_t width, const int32_t *lens,
                                ptrdiff_t batch, ptrdiff_t max_len, const int64_t *out_rows, ptrdiff_t num_out,
                                sloserve_team *team, float *work, float *logits, long *stalled_ns) {
    sloserve_decode_args a = {m, ids, positions, slots, tables, lens, width, batch, max_len, out_rows,
                              out_rows ? num_out : batch, work, logits, {0, 0}, 0, 0, 0, {0}};
    a.runs = sloserve_row_runs(tables, width, lens, m->page, batch, a.run_first);
    if (team == NULL)
        sloserve_decode_job(&a, 0, 1);
    else
        sloserve_team_run(team, sloserve_decode_job, &a, &a.stalled_ns);
    *stalled_ns = a.stalled_ns;
    return a.bad ? -1 : 0;
}

#endif
