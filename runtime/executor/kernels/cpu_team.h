/* A team of threads that share the tasks of one kernel call (cpu_team.c).
 *
 * In a decode step run in parts of rows (cpu_decode_step.c), each thread goes through the
 * layers with its own part and runs the kernels alone. A thread with no part to take (its
 * own finished first, the others held) would only wait; through the team it takes tasks
 * (weight panels) of the GEMM another part's thread is running instead. */
#ifndef SPRUCE_CPU_TEAM_H
#define SPRUCE_CPU_TEAM_H

#include <stddef.h>
#include <stdint.h>

#define TEAM_JOBS 16 /* one job slot per part of rows */

/* Runs task `task` of a kernel call `ctx` with `scratch` (the call's scratch_bytes, 64-byte
 * aligned, the running thread's own). */
typedef void (*team_task_fn)(const void *ctx, int64_t task, void *scratch);

/* A slot's current job. `state` is the job's generation (high 32 bits) and its next task
 * to hand out (low 32 bits): a helper claims a task by advancing it, and the generation
 * keeps a late helper from claiming in a later job what it read of an earlier one. */
typedef struct {
    uint64_t state;
    int64_t count, done; /* tasks; tasks the helpers finished */
    team_task_fn fn;
    const void *ctx;
    size_t scratch_bytes;
    char pad[16]; /* a cache line each */
} team_job;

typedef struct {
    team_job jobs[TEAM_JOBS];
} spruce_team;

/* The calling thread, owner of `slot`, runs tasks [0, count) of fn (with its own scratch),
 * while idle threads of the team take some of them (spruce_team_help); it returns once
 * every task has finished. */
void spruce_team_run(spruce_team *team, int64_t slot, int64_t count, team_task_fn fn, const void *ctx,
                     void *scratch, size_t scratch_bytes);

/* An idle thread: runs one task of a job of the team's first `slots` slots with tasks left,
 * in *scratch (grown to the job's need; *size its bytes; free() it when done). Returns 1
 * when it ran one, 0 when it found none (or no memory for it). */
int spruce_team_help(spruce_team *team, int64_t slots, void **scratch, size_t *size);

extern int64_t spruce_team_helped; /* tasks helpers have run since the library loaded */

#endif
