/* A team of worker threads that outlives the calls it serves (_decode_step.h uses it).
 *
 * A decode step of a small batch takes ~0.2 ms on two threads, and the engine calls it again
 * ~0.05-0.3 ms later (sampling, the next run's schedule). An OpenMP parallel region per call
 * under OMP_WAIT_POLICY=PASSIVE (the CLI's default, so that torch's idle workers never burn a
 * core) puts its worker to sleep after every call and pays a futex wake-up at the next one
 * (docs/design/cpu-decode.md: it made small steps far slower). This team's
 * workers spin for SLOSERVE_TEAM_SPIN_NS after a job (yielding the core to anything runnable
 * after the first few thousand pauses), and only then sleep on a futex: back-to-back steps never
 * wait for a wake-up, and an idle engine costs nothing after that window.
 *
 * Protocol: the caller publishes (job, ctx), bumps `generation` and wakes sleepers; each worker
 * runs job(ctx, me, size) for me in 1..size-1 while the caller runs me = 0, then counts itself in
 * `done`; the caller returns once all have. A worker about to sleep announces itself in
 * `sleepers` and re-reads `generation` (both sequentially consistent, as the caller's bump and
 * read of `sleepers` are), so a bump is never missed. Linux only (futex).
 */
#ifndef SLOSERVE_TEAM_H
#define SLOSERVE_TEAM_H

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SLOSERVE_TEAM_SPIN_NS 500000L /* how long an idle worker spins before it sleeps */
#define SLOSERVE_TEAM_PAUSES 2000 /* pause instructions before spinning turns to sched_yield */

typedef void (*sloserve_job)(void *ctx, int me, int size);

typedef struct sloserve_team sloserve_team;

typedef struct {
    sloserve_team *team;
    int me;
} sloserve_worker_arg;

struct sloserve_team {
    int size;        /* threads of a job, the caller's included */
    int generation;  /* bumped once per job (and at shutdown): the futex word */
    int sleepers;    /* workers blocked in the futex */
    int done;        /* workers finished with the current job */
    int quit;
    pid_t owner;     /* the process that started the workers (a forked child has none) */
    sloserve_job job;
    void *ctx;
    pthread_t *threads;
    sloserve_worker_arg *args;
};

/* One wait of a spin loop on its `spins`-th turn: a pause instruction, or sched_yield once the
 * loop has paused `pauses` times (the step barrier in _decode_step.h waits the same way). */
static inline void sloserve_pause(long spins, long pauses) {
    if (spins >= pauses) sched_yield();
#if defined(__x86_64__) || defined(__i386__)
    else __builtin_ia32_pause();
#endif
}

static inline long sloserve_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void *sloserve_team_worker(void *raw) {
    sloserve_worker_arg *arg = (sloserve_worker_arg *)raw;
    sloserve_team *t = arg->team;
    int seen = 0;
    for (;;) {
        long deadline = sloserve_now_ns() + SLOSERVE_TEAM_SPIN_NS, spins = 0;
        int gen;
        while ((gen = __atomic_load_n(&t->generation, __ATOMIC_ACQUIRE)) == seen) {
            if ((++spins & 255) == 0 && sloserve_now_ns() > deadline) {
                __atomic_add_fetch(&t->sleepers, 1, __ATOMIC_SEQ_CST);
                if (__atomic_load_n(&t->generation, __ATOMIC_SEQ_CST) == seen)
                    syscall(SYS_futex, &t->generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                __atomic_sub_fetch(&t->sleepers, 1, __ATOMIC_SEQ_CST);
                deadline = sloserve_now_ns() + SLOSERVE_TEAM_SPIN_NS;
                spins = 0;
            } else {
                sloserve_pause(spins, SLOSERVE_TEAM_PAUSES);
            }
        }
        seen = gen;
        if (__atomic_load_n(&t->quit, __ATOMIC_ACQUIRE)) return NULL;
        t->job(t->ctx, arg->me, t->size);
        __atomic_add_fetch(&t->done, 1, __ATOMIC_ACQ_REL);
    }
}

/* A team of `size` threads (the caller and size - 1 workers); NULL when a thread cannot start. */
static sloserve_team *sloserve_team_start(int size) {
    sloserve_team *t = (sloserve_team *)calloc(1, sizeof(sloserve_team));
    if (t == NULL) return NULL;
    t->size = size;
    t->owner = getpid();
    t->threads = (pthread_t *)calloc(size, sizeof(pthread_t));
    t->args = (sloserve_worker_arg *)calloc(size, sizeof(sloserve_worker_arg));
    if (t->threads == NULL || t->args == NULL) {
        free(t->threads), free(t->args), free(t);
        return NULL;
    }
    for (int i = 1; i < size; i++) {
        t->args[i].team = t, t->args[i].me = i;
        if (pthread_create(&t->threads[i], NULL, sloserve_team_worker, &t->args[i]) != 0) {
            t->size = i; /* stop the ones started */
            __atomic_store_n(&t->quit, 1, __ATOMIC_RELEASE);
            __atomic_add_fetch(&t->generation, 1, __ATOMIC_SEQ_CST);
            syscall(SYS_futex, &t->generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
            for (int j = 1; j < i; j++) pthread_join(t->threads[j], NULL);
            free(t->threads), free(t->args), free(t);
            return NULL;
        }
    }
    return t;
}

/* Runs job(ctx, me, size) on every thread of the team (me = 0 here) and returns when all are done;
 * adds to *stalled_ns the caller's wait for the last worker when it outlasted the pause phase. */
static void sloserve_team_run(sloserve_team *t, sloserve_job job, void *ctx, long *stalled_ns) {
    t->job = job, t->ctx = ctx;
    __atomic_store_n(&t->done, 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&t->generation, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&t->sleepers, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &t->generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    job(ctx, 0, t->size);
    const long since = sloserve_now_ns();
    long spins = 0;
    for (; __atomic_load_n(&t->done, __ATOMIC_ACQUIRE) != t->size - 1; spins++)
        sloserve_pause(spins, SLOSERVE_TEAM_PAUSES);
    if (spins > SLOSERVE_TEAM_PAUSES) *stalled_ns += sloserve_now_ns() - since;
}

/* Stops and joins the workers and frees the team (in a forked child, whose copy has no workers,
 * it only frees). */
static void sloserve_team_stop(sloserve_team *t) {
    if (t == NULL) return;
    if (t->owner == getpid()) {
        __atomic_store_n(&t->quit, 1, __ATOMIC_RELEASE);
        __atomic_add_fetch(&t->generation, 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, &t->generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
        for (int i = 1; i < t->size; i++) pthread_join(t->threads[i], NULL);
    }
    free(t->threads), free(t->args), free(t);
}

#endif
