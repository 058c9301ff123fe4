/* A team of threads sharing one kernel call's tasks (cpu_team.h). */
#include <stdlib.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_team.h"

#define TASK_MASK 0xffffffffull /* a job's tasks: far fewer (weight panels) */

int64_t spruce_team_helped = 0; /* tasks helpers have run, for the tests */

static inline void team_relax(void) {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

/* The next task of generation `gen` of job j, or -1 when all are handed out (or the job is
 * another generation's). */
static int64_t claim(team_job *j, uint64_t gen, int64_t count) {
    uint64_t v = __atomic_load_n(&j->state, __ATOMIC_ACQUIRE);
    while (v >> 32 == gen && (int64_t)(v & TASK_MASK) < count)
        if (__atomic_compare_exchange_n(&j->state, &v, v + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return (int64_t)(v & TASK_MASK);
    return -1;
}

void spruce_team_run(spruce_team *team, int64_t slot, int64_t count, team_task_fn fn, const void *ctx,
                     void *scratch, size_t scratch_bytes) {
    team_job *j = &team->jobs[slot];
    uint64_t gen = (__atomic_load_n(&j->state, __ATOMIC_RELAXED) >> 32) + 1;
    /* the last job's tasks have all finished: no helper reads these now */
    __atomic_store_n(&j->count, count, __ATOMIC_RELAXED);
    __atomic_store_n(&j->fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&j->ctx, ctx, __ATOMIC_RELAXED);
    __atomic_store_n(&j->scratch_bytes, scratch_bytes, __ATOMIC_RELAXED);
    __atomic_store_n(&j->done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&j->state, gen << 32, __ATOMIC_RELEASE);
    int64_t task, mine = 0;
    while ((task = claim(j, gen, count)) >= 0) fn(ctx, task, scratch), mine++;
    /* every task is handed out; the helpers' last ones may still run. No sched_yield here:
     * beside a busy process the owner gave its core's turn to it (busy step 1.52-1.56x the
     * quiet one against 1.45-1.46x, alternated) */
    while (__atomic_load_n(&j->done, __ATOMIC_ACQUIRE) < count - mine) team_relax();
    /* closed before the next job's fields change: a helper that read the next job's count
     * cannot then claim "task `count`" of this one (help_claim's fence pairs with this) */
    __atomic_store_n(&j->state, gen << 32 | TASK_MASK, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

/* Job j's task for a helper with room for the job's scratch; -1 when there is none. The
 * job's fields are read before the claim: a claim that succeeds shows the job was still
 * open, so its owner had not closed it and moved on to write the next job's fields. */
static int64_t help_claim(team_job *j, void **scratch, size_t *size, team_task_fn *fn, const void **ctx) {
    uint64_t v = __atomic_load_n(&j->state, __ATOMIC_ACQUIRE);
    int64_t count = __atomic_load_n(&j->count, __ATOMIC_RELAXED);
    if ((int64_t)(v & TASK_MASK) >= count) return -1;
    *fn = __atomic_load_n(&j->fn, __ATOMIC_RELAXED);
    *ctx = __atomic_load_n(&j->ctx, __ATOMIC_RELAXED);
    size_t bytes = __atomic_load_n(&j->scratch_bytes, __ATOMIC_RELAXED);
    if (bytes > *size) { /* grown before the claim: a claimed task must run */
        void *grown = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (grown == NULL) return -1;
        free(*scratch);
        *scratch = grown, *size = bytes;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* fields of a later job: the claim sees it closed */
    if (!__atomic_compare_exchange_n(&j->state, &v, v + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) return -1;
    return (int64_t)(v & TASK_MASK);
}

int spruce_team_help(spruce_team *team, int64_t slots, void **scratch, size_t *size) {
    for (int64_t s = 0; s < slots && s < TEAM_JOBS; s++) {
        team_job *j = &team->jobs[s];
        team_task_fn fn;
        const void *ctx;
        int64_t task = help_claim(j, scratch, size, &fn, &ctx);
        if (task < 0) continue;
        fn(ctx, task, *scratch);
        __atomic_add_fetch(&j->done, 1, __ATOMIC_RELEASE);
        __atomic_add_fetch(&spruce_team_helped, 1, __ATOMIC_RELAXED);
        return 1;
    }
    return 0;
}
