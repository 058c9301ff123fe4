/* How every kernel shares its work between threads: its work is cut into tasks, the threads
 * of one OpenMP region (torch's thread pool: one OpenMP runtime in the process) claim them
 * one after another from a single counter, and the call returns at the region's closing
 * barrier. A thread the system takes away holds up only the task it holds; a fast thread
 * takes more. The kernel chooses its tasks: contiguous ranges of weight rows for the GEMV
 * (a stream the prefetchers follow), weight panels for the GEMMs, (row, KV head) pairs for
 * decode attention. */
#ifndef SPRUCE_CPU_PARALLEL_H
#define SPRUCE_CPU_PARALLEL_H

#include <stdint.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

/* Runs task [first, end) of a call's work: `ctx` the call's arguments, `thread` the running
 * thread's number (for its own scratch memory). */
typedef void (*task_fn)(const void *ctx, int64_t first, int64_t end, int thread);

/* Threads the next region gets (torch's count). */
static inline int task_threads(void) {
#if defined(_OPENMP)
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Tasks of `grain` items each over [0, items), claimed by `threads` threads from one counter
 * (fewer threads where there are fewer tasks); returns once all have run. */
static inline void share_tasks(int64_t items, int64_t grain, int threads, task_fn fn, const void *ctx) {
    int64_t tasks = (items + grain - 1) / grain;
    if (threads > tasks) threads = (int)tasks;
    if (threads <= 1) {
        if (items > 0) fn(ctx, 0, items, 0);
        return;
    }
    int64_t next = 0;
#pragma omp parallel num_threads(threads)
    {
        int thread = 0;
#if defined(_OPENMP)
        thread = omp_get_thread_num();
#endif
        for (int64_t t; (t = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED)) < tasks;) {
            int64_t end = (t + 1) * grain;
            fn(ctx, t * grain, end < items ? end : items, thread);
        }
    }
}

#endif
