/* A decode step's layers in one call: the loop of models/decode_plan.py in C.
 *
 * Per layer the plan makes nine kernel calls (norm, QKV, rotary, attention, O, norm,
 * gate/up, SiLU * up, down). From Python each call cost a ctypes call and its argument
 * conversions, about 1-3 microseconds, while the other threads waited: 270 calls a step on
 * a 30-layer model. Here the same calls, with the same arguments and in the same order,
 * run from C, so the results are the Python loop's bit for bit.
 *
 * Compiled once per instruction set like the float kernels, so each variant calls its own
 * instruction set's norm, rotary, SiLU, attention and float GEMM; the quantized GEMV and
 * integer GEMM take the ISA as data (cpu_quant_ops.c). `spruce_decode_layers_split` runs the
 * same calls on parts of the rows, a part per thread, the threads pinned apart (the thread
 * governor's choice beside another busy process: engine/threads.py). `spruce_decode_steps`
 * runs several greedy decode steps in one call, each step's chosen tokens the next one's
 * input. */
#define _GNU_SOURCE /* sched_getcpu, CPU_SET */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <sched.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_team.h"
#include "cpu_vector.h"

/* the kernels it calls (cpu_layer_ops.c, cpu_decode_attention.c, cpu_quant_*.c) */
void PER_ISA(spruce_rms_norm)(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                              int64_t dim, float eps);
void PER_ISA(spruce_silu_mul)(const float *gate_up, float *out, int64_t rows, int64_t inter);
void PER_ISA(spruce_rotary)(float *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t dim,
                            const int64_t *positions, const float *cos, const float *sin);
int PER_ISA(spruce_quant_gemm_team)(int64_t type, const uint8_t *w, int64_t n, int64_t k, const float *x,
                                    int64_t rows, const float *bias, float *y, spruce_team *team, int64_t slot);
int spruce_quant_linear(int64_t type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows,
                        const float *bias, float *y, int64_t isa);
int spruce_quant_igemm_team(int64_t type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows,
                            const float *bias, float *y, spruce_team *team, int64_t slot);
void PER_ISA(spruce_argmax_rows)(const float *x, int64_t rows, int64_t n, int64_t *ids, float *values);
void spruce_dequantize_rows(int64_t type, const uint8_t *w, int64_t k, const int64_t *ids, int64_t count,
                            float *out);
#define ATTENTION_ARGS(CACHE_T)                                                                                   \
    const float *q, int64_t q_stride, const float *k_new, const float *v_new, int64_t new_stride,                 \
        const int64_t *new_slots, CACHE_T *k_cache, CACHE_T *v_cache, float *k_scale, float *v_scale,             \
        const int32_t *req_to_token, int64_t table_stride, const int64_t *rows, const int64_t *seq_lens, float *out, \
        int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, float scale, int64_t window
int PER_ISA(spruce_decode_attention_f32)(ATTENTION_ARGS(float));
int PER_ISA(spruce_decode_attention_f16)(ATTENTION_ARGS(_Float16));
int PER_ISA(spruce_decode_attention_i8)(ATTENTION_ARGS(int8_t));

/* One layer's weights and cache (decode_plan.StepLayer mirrors it). The linear layers are
 * QKV, O, gate/up, down, each `type` (ggml id) blocks of n x k. */
typedef struct {
    const float *norm[2];
    float eps[2];
    int64_t type[4];
    const uint8_t *weight[4];
    int64_t n[4], k[4];
    const float *qkv_bias;
    const float *cos, *sin;
    void *k_cache, *v_cache;
    float *k_scale, *v_scale;
    int64_t window; /* 0: none */
} step_layer;

#define KERNEL_TYPES 32 /* ggml type ids below this */
enum { KERNEL_INTEGER, KERNEL_IGEMM, KERNEL_GEMM };

/* The step: its buffers, shapes and batch (decode_plan.StepArgs mirrors it). */
typedef struct {
    float *residual, *h, *out, *qkv, *attn, *gate_up, *act;
    int64_t rows, hidden, q_size, kv_size, heads, kv_heads, head_dim, inter, isa;
    const int64_t *positions, *slots, *table_rows, *seq_lens;
    const int32_t *table;
    int64_t table_stride;
    float scale;
    int64_t cache_kind;                 /* 0 float32, 1 float16, 2 int8 */
    int8_t kernel[KERNEL_TYPES];        /* by weight type: KERNEL_* for this many rows */
    /* the final norm and the output projection (`type` blocks of vocab x hidden) into
     * logits [rows, vocab]; head NULL: the step ends with the last layer */
    const float *final_norm;
    float final_eps;
    int64_t head_type, vocab;
    const uint8_t *head;
    float *logits;
    /* a part's team and slot in a step run in parts (spruce_decode_layers_split); else NULL */
    spruce_team *team;
    int64_t slot;
} step_args;

/* y [rows, n] = x [rows, k] @ W^T (+ bias) through the kernel the table gives W's type. */
static int linear(const step_args *s, int64_t type, const uint8_t *w, int64_t n, int64_t k, const float *x,
                  const float *bias, float *y) {
    switch (type >= 0 && type < KERNEL_TYPES ? s->kernel[type] : KERNEL_GEMM) {
    case KERNEL_INTEGER: return spruce_quant_linear(type, w, n, k, x, s->rows, bias, y, s->isa);
    case KERNEL_IGEMM: return spruce_quant_igemm_team(type, w, n, k, x, s->rows, bias, y, s->team, s->slot);
    default: return PER_ISA(spruce_quant_gemm_team)(type, w, n, k, x, s->rows, bias, y, s->team, s->slot);
    }
}

static int layer_linear(const step_args *s, const step_layer *l, int i, const float *x, const float *bias, float *y) {
    return linear(s, l->type[i], l->weight[i], l->n[i], l->k[i], x, bias, y);
}

static int attention(const step_args *s, const step_layer *l) {
    int64_t width = s->q_size + 2 * s->kv_size;
    const float *k_new = s->qkv + s->q_size, *v_new = k_new + s->kv_size;
#define CALL(SUFFIX, CACHE_T)                                                                                   \
    PER_ISA(spruce_decode_attention_##SUFFIX)(s->qkv, width, k_new, v_new, width, s->slots, (CACHE_T *)l->k_cache, \
                                              (CACHE_T *)l->v_cache, l->k_scale, l->v_scale, s->table,          \
                                              s->table_stride, s->table_rows, s->seq_lens, s->attn, s->rows,    \
                                              s->heads, s->kv_heads, s->head_dim, s->scale, l->window)
    switch (s->cache_kind) {
    case 0: return CALL(f32, float);
    case 1: return CALL(f16, _Float16);
    case 2: return CALL(i8, int8_t);
    default: return 1;
    }
#undef CALL
}

/* Layer i on the step's rows: the module path's nine calls. Returns as spruce_decode_layers. */
static int run_layer(const step_args *s, const step_layer *l, int64_t i) {
    int64_t rows = s->rows, hidden = s->hidden, width = s->q_size + 2 * s->kv_size;
    /* the residual stream starts as the embeddings */
    PER_ISA(spruce_rms_norm)(i == 0 ? s->residual : s->out, i == 0 ? NULL : s->residual, l->norm[0], s->h, rows,
                             hidden, l->eps[0]);
    if (layer_linear(s, l, 0, s->h, l->qkv_bias, s->qkv)) return 1;
    PER_ISA(spruce_rotary)(s->qkv, width, rows, s->heads + s->kv_heads, s->head_dim, s->positions, l->cos, l->sin);
    if (attention(s, l)) return 2;
    if (layer_linear(s, l, 1, s->attn, NULL, s->out)) return 1;
    PER_ISA(spruce_rms_norm)(s->out, s->residual, l->norm[1], s->h, rows, hidden, l->eps[1]);
    if (layer_linear(s, l, 2, s->h, NULL, s->gate_up)) return 1;
    PER_ISA(spruce_silu_mul)(s->gate_up, s->act, rows, s->inter);
    return layer_linear(s, l, 3, s->act, NULL, s->out);
}

/* The final norm and the logits (the module path's calls after the layers). */
static int run_head(const step_args *s) {
    PER_ISA(spruce_rms_norm)(s->out, s->residual, s->final_norm, s->h, s->rows, s->hidden, s->final_eps);
    return linear(s, s->head_type, s->head, s->vocab, s->hidden, s->h, NULL, s->logits);
}

/* Every layer on s->residual (the embeddings, [rows, hidden]): the last MLP output in
 * s->out, the residual stream in s->residual; with a head, then the final norm and the
 * logits. Returns 0, 1 when a linear layer found no memory for its activations, 2 when
 * attention refused the shape. */
int PER_ISA(spruce_decode_layers)(const step_layer *layers, int64_t count, const step_args *s) {
    for (int64_t i = 0; i < count; i++) {
        int failed = run_layer(s, &layers[i], i);
        if (failed) return failed;
    }
    return s->head == NULL ? 0 : run_head(s);
}

/* s's rows [first, first + rows): each buffer and per-row array from its row `first`. */
static step_args part_of(const step_args *s, int64_t first, int64_t rows) {
    step_args p = *s;
    int64_t width = s->q_size + 2 * s->kv_size;
    p.rows = rows;
    p.residual += first * s->hidden, p.h += first * s->hidden, p.out += first * s->hidden;
    p.qkv += first * width, p.attn += first * s->q_size;
    p.gate_up += first * 2 * s->inter, p.act += first * s->inter;
    p.positions += first, p.slots += first, p.table_rows += first, p.seq_lens += first;
    if (p.logits != NULL) p.logits += first * s->vocab;
    return p;
}

#define MAX_PARTS 16

static inline void relax(void) {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

/* Takes the least advanced part that no thread holds and that has a task left: its index,
 * its next task in *task; -1 when there is none now. */
static int64_t take_part(int64_t parts, int64_t tasks, int64_t *next, int *held, int64_t *task) {
    int64_t best = -1;
    for (int64_t p = 0; p < parts; p++) {
        int64_t t = __atomic_load_n(&next[p], __ATOMIC_RELAXED);
        if (!__atomic_load_n(&held[p], __ATOMIC_RELAXED) && t < tasks && (best < 0 || t < *task)) best = p, *task = t;
    }
    int expected = 0;
    if (best < 0 || !__atomic_compare_exchange_n(&held[best], &expected, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
        return -1;
    *task = __atomic_load_n(&next[best], __ATOMIC_RELAXED);
    if (*task < tasks) return best;
    __atomic_store_n(&held[best], 0, __ATOMIC_RELEASE); /* finished between the look and the take */
    return -1;
}

/* Where a split's thread runs: pinned to one CPU for the call (pin_apart), its mask before. */
typedef struct {
    int pinned;
#if defined(__linux__)
    cpu_set_t saved;
#endif
} pin;

/* Pins the calling thread to one CPU no other thread of the split holds (`taken`, its
 * `count` entries so far): the CPU it runs on, or else the first other one it may run on.
 * Beside one busy process two threads left free often share one core while the busy
 * process has the other alone (1.0 cores between them); pinned apart, the busy process
 * shares a core with one of them (1.5). Not pinned where there is no such CPU (or not on
 * Linux). */
static pin pin_apart(int *taken, int *count) {
    pin p = {0};
#if defined(__linux__)
    if (sched_getaffinity(0, sizeof p.saved, &p.saved)) return p;
    int chosen = -1, here = sched_getcpu();
#pragma omp critical(spruce_split_pin)
    {
        for (int c = -1; c < CPU_SETSIZE && chosen < 0; c++) {
            int cpu = c < 0 ? here : c, free = cpu >= 0 && CPU_ISSET(cpu, &p.saved);
            for (int i = 0; i < *count && free; i++) free = taken[i] != cpu;
            if (free) chosen = cpu, taken[(*count)++] = cpu;
        }
    }
    if (chosen < 0) return p;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(chosen, &one);
    p.pinned = sched_setaffinity(0, sizeof one, &one) == 0;
#else
    (void)taken, (void)count;
#endif
    return p;
}

static void unpin(const pin *p) {
#if defined(__linux__)
    if (p->pinned) sched_setaffinity(0, sizeof p->saved, &p->saved);
#else
    (void)p;
#endif
}

/* Threads for a split into `parts`: a thread a part, and more (helpers) where torch's
 * count is higher; at most MAX_PARTS. */
static int64_t split_threads(int64_t parts) {
    int64_t threads = 1;
#if defined(_OPENMP)
    threads = omp_get_max_threads();
#endif
    threads = threads < MAX_PARTS ? threads : MAX_PARTS;
    return threads > parts ? threads : parts;
}

/* spruce_decode_layers with the rows cut into `parts` parts (at most MAX_PARTS), each going
 * through the layers (and the head) on its own: a thread takes one task (a layer, or the
 * head) of the least advanced part no other thread holds, runs its kernels alone, and gives
 * the part back. Beside another busy process the kernels' own threads wait at the end of
 * every kernel for a thread the system has taken away; here such a thread holds up only
 * its part, while the other threads go on with theirs. A thread with no part to take (its
 * own done first, the others held) helps with the GEMMs the parts' threads are running
 * (their weight panels: cpu_team.h) rather than wait. The threads are pinned apart for the
 * call (pin_apart). A row's calls are the same and no kernel's result for a row depends on
 * the other rows or on the thread that made it, so the results are identical. Returns as
 * spruce_decode_layers (a part that fails stops there; the others finish). */
int PER_ISA(spruce_decode_layers_split)(const step_layer *layers, int64_t count, const step_args *s,
                                        int64_t parts) {
    parts = parts < 1 ? 1 : parts > MAX_PARTS ? MAX_PARTS : parts > s->rows ? s->rows : parts;
    int64_t tasks = count + (s->head != NULL), next[MAX_PARTS], left = parts * tasks;
    step_args part[MAX_PARTS];
    int held[MAX_PARTS], failed = 0, cpus[MAX_PARTS], pinned = 0;
    spruce_team team = {0};
    for (int64_t p = 0; p < parts; p++) {
        int64_t first = s->rows * p / parts;
        part[p] = part_of(s, first, s->rows * (p + 1) / parts - first);
        part[p].team = &team, part[p].slot = p;
        next[p] = 0, held[p] = 0;
    }
#pragma omp parallel num_threads(split_threads(parts))
    {
#if defined(_OPENMP)
        omp_set_num_threads(1); /* the kernels run on this thread alone (this region only) */
#endif
        pin where = pin_apart(cpus, &pinned);
        void *scratch = NULL; /* for the tasks it helps with */
        size_t scratch_size = 0;
        unsigned idle = 0;
        while (__atomic_load_n(&left, __ATOMIC_ACQUIRE) > 0) {
            int64_t task = 0, p = take_part(parts, tasks, next, held, &task);
            if (p < 0) { /* every part left is held: the step's end, or a thread taken away */
                if (spruce_team_help(&team, parts, &scratch, &scratch_size)) idle = 0;
                else if (++idle % 64 == 0) sched_yield();
                else relax();
                continue;
            }
            idle = 0;
            int r = task < count ? run_layer(&part[p], &layers[task], task) : run_head(&part[p]);
            int64_t done = 1;
            if (r) { /* the part stops here */
                __atomic_store_n(&failed, r, __ATOMIC_RELAXED);
                done = tasks - task;
                task = tasks - 1;
            }
            __atomic_store_n(&next[p], task + 1, __ATOMIC_RELAXED);
            __atomic_store_n(&held[p], 0, __ATOMIC_RELEASE);
            __atomic_sub_fetch(&left, done, __ATOMIC_RELEASE);
        }
        unpin(&where);
        free(scratch);
    }
    return failed;
}

/* One step, whole or (parts > 1) in parts of rows. */
static int run_step(const step_layer *layers, int64_t count, const step_args *s, int64_t parts) {
    return parts > 1 ? PER_ISA(spruce_decode_layers_split)(layers, count, s, parts)
                     : PER_ISA(spruce_decode_layers)(layers, count, s);
}

/* The embedding rows of `ids` into s->residual: `type` blocks (ggml id) of vocab x hidden,
 * or float32 rows where type < 0 (the model's own lookup, as models/layers.py makes it). */
static void embed_rows(const step_args *s, int64_t type, const void *table, const int64_t *ids) {
    if (type >= 0) {
        spruce_dequantize_rows(type, (const uint8_t *)table, s->hidden, ids, s->rows, s->residual);
        return;
    }
    for (int64_t r = 0; r < s->rows; r++)
        memcpy(s->residual + r * s->hidden, (const float *)table + ids[r] * s->hidden, (size_t)s->hidden * sizeof(float));
}

/* `steps` greedy decode steps in one call (s with a head; s->residual holds the first
 * step's embeddings). Step j reads its positions, new K/V slots and sequence lengths from
 * row j of s->positions, s->slots and s->seq_lens (each [steps][rows]; the request-to-token
 * table already points at every step's slots), runs the layers and the head (in `parts`
 * parts of rows when parts > 1), and takes each row's first largest logit (the sampler's
 * argmax, the same kernel): its id in ids[j][row], the logit in best[j][row] (not finite:
 * the row cannot be sampled there; the caller drops what follows). The chosen ids, looked up
 * in the embedding table, are the next step's input. Returns as spruce_decode_layers. */
int PER_ISA(spruce_decode_steps)(const step_layer *layers, int64_t count, const step_args *s, int64_t parts,
                                 int64_t steps, int64_t embed_type, const void *embed, int64_t *ids, float *best) {
    step_args at = *s;
    for (int64_t j = 0; j < steps; j++) {
        int64_t first = j * s->rows;
        at.positions = s->positions + first, at.slots = s->slots + first, at.seq_lens = s->seq_lens + first;
        int failed = run_step(layers, count, &at, parts);
        if (failed) return failed;
        PER_ISA(spruce_argmax_rows)(s->logits, s->rows, s->vocab, ids + first, best + first);
        if (j + 1 < steps) embed_rows(s, embed_type, embed, ids + first);
    }
    return 0;
}
