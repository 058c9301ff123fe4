/* A decode step's layers in one call: the loop of models/decode_plan.py in C.
 *
 * Per layer the plan makes nine kernel calls (norm, QKV, rotary, attention, O, norm,
 * gate/up, SiLU * up, down). From Python each call cost a ctypes call and its argument
 * conversions while the other threads waited, 270 calls a step on a 30-layer model. Here the
 * same calls, with the same arguments and in the same order, run from C, so the results are
 * the Python loop's bit for bit.
 *
 * Compiled once per instruction set like the float kernels, so each variant calls its own
 * instruction set's norm, rotary, SiLU, attention and float GEMM; the quantized GEMV and
 * integer GEMM take the ISA as data (cpu_quant_ops.c). `spruce_decode_steps` runs several
 * greedy decode steps in one call, each step's chosen tokens the next one's input. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>

#include "cpu_vector.h"

/* the kernels it calls (cpu_layer_ops.c, cpu_decode_attention.c, cpu_quant_*.c) */
void PER_ISA(spruce_rms_norm)(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                              int64_t dim, float eps);
void PER_ISA(spruce_silu_mul)(const float *gate_up, float *out, int64_t rows, int64_t inter);
void PER_ISA(spruce_rotary)(float *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t dim,
                            const int64_t *positions, const float *cos, const float *sin);
int PER_ISA(spruce_quant_gemm)(int64_t type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows,
                               const float *bias, float *y);
int spruce_quant_linear(int64_t type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows,
                        const float *bias, float *y, int64_t isa);
int spruce_quant_igemm(int64_t type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows,
                       const float *bias, float *y, int64_t isa);
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
} step_args;

/* Where the fields of step_layer and step_args lie, for decode_plan.py's ctypes mirrors to
 * check at load: into `out`, each struct's size and then its fields' offsets in declaration
 * order (step_layer's, then step_args'); returns how many numbers it wrote. */
#define LAYER_FIELDS(X) X(norm) X(eps) X(type) X(weight) X(n) X(k) X(qkv_bias) X(cos) X(sin) \
    X(k_cache) X(v_cache) X(k_scale) X(v_scale) X(window)
#define ARGS_FIELDS(X) X(residual) X(h) X(out) X(qkv) X(attn) X(gate_up) X(act) X(rows) X(hidden) X(q_size) \
    X(kv_size) X(heads) X(kv_heads) X(head_dim) X(inter) X(isa) X(positions) X(slots) X(table_rows) X(seq_lens) \
    X(table) X(table_stride) X(scale) X(cache_kind) X(kernel) X(final_norm) X(final_eps) X(head_type) X(vocab) \
    X(head) X(logits)
int64_t PER_ISA(spruce_step_layout)(int64_t *out) {
    int64_t n = 0;
    out[n++] = (int64_t)sizeof(step_layer);
#define LAYER_OFFSET(F) out[n++] = (int64_t)offsetof(step_layer, F);
    LAYER_FIELDS(LAYER_OFFSET)
    out[n++] = (int64_t)sizeof(step_args);
#define ARGS_OFFSET(F) out[n++] = (int64_t)offsetof(step_args, F);
    ARGS_FIELDS(ARGS_OFFSET)
    return n;
}

/* y [rows, n] = x [rows, k] @ W^T (+ bias) through the kernel the table gives W's type. */
static int linear(const step_args *s, int64_t type, const uint8_t *w, int64_t n, int64_t k, const float *x,
                  const float *bias, float *y) {
    switch (type >= 0 && type < KERNEL_TYPES ? s->kernel[type] : KERNEL_GEMM) {
    case KERNEL_INTEGER: return spruce_quant_linear(type, w, n, k, x, s->rows, bias, y, s->isa);
    case KERNEL_IGEMM: return spruce_quant_igemm(type, w, n, k, x, s->rows, bias, y, s->isa);
    default: return PER_ISA(spruce_quant_gemm)(type, w, n, k, x, s->rows, bias, y);
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
 * table already points at every step's slots), runs the layers and the head, and takes each row's first largest logit (the sampler's
 * argmax, the same kernel): its id in ids[j][row], the logit in best[j][row] (not finite:
 * the row cannot be sampled there; the caller drops what follows). The chosen ids, looked up
 * in the embedding table, are the next step's input. Returns as spruce_decode_layers. */
int PER_ISA(spruce_decode_steps)(const step_layer *layers, int64_t count, const step_args *s, int64_t steps, int64_t embed_type, const void *embed, int64_t *ids, float *best) {
    step_args at = *s;
    for (int64_t j = 0; j < steps; j++) {
        int64_t first = j * s->rows;
        at.positions = s->positions + first, at.slots = s->slots + first, at.seq_lens = s->seq_lens + first;
        int failed = PER_ISA(spruce_decode_layers)(layers, count, &at);
        if (failed) return failed;
        PER_ISA(spruce_argmax_rows)(s->logits, s->rows, s->vocab, ids + first, best + first);
        if (j + 1 < steps) embed_rows(s, embed_type, embed, ids + first);
    }
    return 0;
}
