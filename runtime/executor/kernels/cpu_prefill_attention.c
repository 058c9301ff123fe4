/* Causal attention of a prompt's new tokens on the CPU (the extend / prefill part of a
 * forward pass), in float32.
 *
 * Query i of `length` new tokens attends keys 0 .. prefix + i of k / v (the prefix's cached
 * keys first, then the new ones), and with a sliding window W only the last W of those.
 * Query head h reads kv head h / G (GQA). Flash style: keys go in blocks of BK with an
 * online softmax per query row, so no score matrix is stored and each K / V block, once in
 * L1, serves every query row of a task:
 *   task     one kv head and BQ consecutive positions, i.e. BQ x G query rows; tasks are
 *            spread over OpenMP threads, the longest (last positions) first.
 *   q        copied once per task into an L1 array, multiplied by `scale`.
 *   scores   the key block transposed into kt [dim][BK]; RS query rows at a time, each
 *            row's BK scores SV register vectors, summed over the head dimension (a
 *            broadcast q value times a kt row per step; RS x SV independent sums hide the
 *            FMA latency).
 *   softmax  per row on its scores: masked keys (past the row's last key, before its
 *            window) get weight 0; the running max moves and rescales the row's sums.
 *   values   per row, the head dimension in passes of VC vectors (64 floats) held in
 *            registers while the block's value rows are added in with their weights.
 * Vectors are one register wide (`avec`, cpu_register_vector.h): with cpu_vector.h's
 * 16-float vectors GCC spilled and shuffled through memory on AVX2, far slower than torch's
 * scaled_dot_product_attention(is_causal, enable_gqa); one register wide, the kernel is
 * faster than it at SmolLM2-135M's shapes (9 query heads, 3 kv heads, head_dim 64). BK 32 /
 * RS 2 came out a little ahead of BK 16 / RS 4, BQ 16 and 32 about even.
 *
 * Compiled once per instruction set (cpu_library.py). */
#include <stdlib.h>

#include "cpu_register_vector.h"

#define BK 32        /* keys per block */
#define SV (BK / AL) /* vectors per row's block scores */
#define BQ 16        /* positions per task */
#define RS 2         /* query rows per pass of the score phase */
#define VC (64 / AL) /* vectors of the head dimension per pass of the value phase */

typedef struct {
    const float *k, *v;
    int64_t kv_stride, dim, kv_head, window;
    int64_t count; /* keys in the current block (BK, fewer at the end) */
    float *kt;     /* [dim][BK] */
} keys;

typedef struct {
    float *q;         /* [rows][dim], scaled */
    float *acc;       /* [rows][dim] */
    float *max, *sum; /* [rows] */
    int64_t *last;    /* [rows] the row's last key */
    int64_t rows;
} query_rows;

/* The block's keys [k0, k0 + count) of the kv head, transposed into kt (zeros after them). */
static void transpose_keys(const keys *ks, int64_t k0) {
    for (int64_t j = 0; j < ks->count; j++) {
        const float *row = ks->k + (k0 + j) * ks->kv_stride + ks->kv_head * ks->dim;
        for (int64_t d = 0; d < ks->dim; d++) ks->kt[d * BK + j] = row[d];
    }
    for (int64_t j = ks->count; j < BK; j++)
        for (int64_t d = 0; d < ks->dim; d++) ks->kt[d * BK + j] = 0.0f;
}

/* Scores of query rows [r0, r0 + n) (n <= RS, constant at each call) against kt, into
 * out[i][BK]. */
static inline __attribute__((always_inline)) void score_rows(const int n, const query_rows *qr, int64_t r0,
                                                             const keys *ks, float out[RS][BK]) {
    avec s[RS][SV];
    for (int i = 0; i < n; i++)
        for (int c = 0; c < SV; c++) s[i][c] = asplat(0.0f);
    const float *q = qr->q + r0 * ks->dim;
    for (int64_t d = 0; d < ks->dim; d++) {
        avec kd[SV];
        for (int c = 0; c < SV; c++) kd[c] = aload(ks->kt + d * BK + c * AL);
        for (int i = 0; i < n; i++) {
            avec qi = asplat(q[i * ks->dim + d]);
            for (int c = 0; c < SV; c++) s[i][c] += qi * kd[c];
        }
    }
    for (int i = 0; i < n; i++)
        for (int c = 0; c < SV; c++) astore(out[i] + c * AL, s[i][c]);
}

/* acc[dim] += sum_j p[j] v[j] over the block's keys (VC vectors of dim at a time; the last
 * block may hold fewer keys). */
static void add_values(const keys *ks, int64_t k0, const float *p, float *acc) {
    const float *v = ks->v + k0 * ks->kv_stride + ks->kv_head * ks->dim;
    int64_t c = 0;
    for (; c + VC * AL <= ks->dim; c += VC * AL) {
        avec a[VC];
        for (int i = 0; i < VC; i++) a[i] = aload(acc + c + i * AL);
#pragma GCC unroll 1
        for (int64_t j = 0; j < ks->count; j++) {
            avec pj = asplat(p[j]);
            for (int i = 0; i < VC; i++) a[i] += pj * aload(v + j * ks->kv_stride + c + i * AL);
        }
        for (int i = 0; i < VC; i++) astore(acc + c + i * AL, a[i]);
    }
    for (; c < ks->dim; c += AL) {
        avec a = aload(acc + c);
        for (int64_t j = 0; j < ks->count; j++) a += asplat(p[j]) * aload(v + j * ks->kv_stride + c);
        astore(acc + c, a);
    }
}

/* One row's online softmax step on its block scores s[BK], then its values. */
static void update_row(const query_rows *qr, int64_t r, const keys *ks, int64_t k0, float *s) {
    int64_t last = qr->last[r], first = ks->window > 0 ? last - ks->window + 1 : 0;
    if (k0 > last || k0 + BK <= first) return; /* no key of this block is the row's */
    int partial = k0 + BK - 1 > last || k0 < first;
    if (partial) /* masked keys: score -inf, weight 0 */
        for (int64_t j = 0; j < BK; j++)
            if (k0 + j > last || k0 + j < first) s[j] = -INFINITY;
    avec m = aload(s);
    for (int c = 1; c < SV; c++) m = amax2(m, aload(s + c * AL));
    float block_max = amax_lanes(m), old = qr->max[r];
    float new_max = block_max > old ? block_max : old;
    for (int c = 0; c < SV; c++) astore(s + c * AL, aexp(aload(s + c * AL) - new_max));
    if (partial) /* exp clamps its argument at -87: not 0 by itself */
        for (int64_t j = 0; j < BK; j++)
            if (k0 + j > last || k0 + j < first) s[j] = 0.0f;
    avec total = aload(s);
    for (int c = 1; c < SV; c++) total += aload(s + c * AL);
    float correction = expf(old - new_max); /* 0 on the row's first block (old = -inf) */
    qr->max[r] = new_max;
    qr->sum[r] = qr->sum[r] * correction + asum_lanes(total);
    float *acc = qr->acc + r * ks->dim;
    if (correction != 1.0f)
        for (int64_t d = 0; d < ks->dim; d++) acc[d] *= correction;
    add_values(ks, k0, s, acc);
}

/* Every query row of the task against keys [0, end). */
static void attend_task(query_rows *qr, keys *ks, int64_t end) {
    int64_t lo = 0;
    if (ks->window > 0) { /* the first key any row of the task attends */
        lo = qr->last[0] - ks->window + 1;
        for (int64_t r = 1; r < qr->rows; r++) lo = qr->last[r] - ks->window + 1 < lo ? qr->last[r] - ks->window + 1 : lo;
        lo = lo < 0 ? 0 : lo / BK * BK;
    }
    for (int64_t k0 = lo; k0 < end; k0 += BK) {
        ks->count = end - k0 < BK ? end - k0 : BK;
        transpose_keys(ks, k0);
        for (int64_t r = 0; r < qr->rows; r += RS) {
            float s[RS][BK];
            int64_t n = qr->rows - r < RS ? qr->rows - r : RS;
            if (n == RS)
                score_rows(RS, qr, r, ks, s);
            else
                for (int64_t i = 0; i < n; i++) score_rows(1, qr, r + i, ks, s + i);
            for (int64_t i = 0; i < n; i++) update_row(qr, r + i, ks, k0, s[i]);
        }
    }
}

/* out [length, heads, dim] (contiguous) = causal attention of q [length, heads, dim] (row
 * stride q_stride) over k, v [prefix + length, kv_heads, dim] (row stride kv_stride), each
 * query i ending at key prefix + i, the last `window` keys only when window > 0. Returns 1
 * when the head dimension is not a multiple of 16 or scratch memory cannot be had. */
int PER_ISA(spruce_prefill_attention)(const float *q, int64_t q_stride, const float *k, const float *v,
                                      int64_t kv_stride, float *out, int64_t length, int64_t prefix, int64_t heads,
                                      int64_t kv_heads, int64_t dim, float scale, int64_t window) {
    if (dim % LANES != 0 || heads % kv_heads != 0) return 1;
    int64_t group = heads / kv_heads, blocks = (length + BQ - 1) / BQ, rows = BQ * group;
    size_t per_task = (size_t)(2 * rows * dim + dim * BK + 2 * rows) * sizeof(float) + (size_t)rows * sizeof(int64_t);
    int failed = 0;
#pragma omp parallel
    {
        char *scratch = aligned_alloc(64, (per_task + 63) / 64 * 64);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < blocks * kv_heads; t++) {
            if (scratch == NULL) continue;
            int64_t block = blocks - 1 - t / kv_heads, g = t % kv_heads; /* the longest tasks first */
            int64_t p0 = block * BQ, count = length - p0 < BQ ? length - p0 : BQ;
            query_rows qr = {(float *)scratch, NULL, NULL, NULL, NULL, count * group};
            qr.acc = qr.q + rows * dim;
            keys ks = {k, v, kv_stride, dim, g, window, BK, qr.acc + rows * dim};
            qr.max = ks.kt + dim * BK, qr.sum = qr.max + rows, qr.last = (int64_t *)(qr.sum + rows);
            for (int64_t i = 0; i < count; i++) /* row i * group + h: position p0 + i, head g * group + h */
                for (int64_t h = 0; h < group; h++) {
                    int64_t r = i * group + h;
                    const float *src = q + (p0 + i) * q_stride + (g * group + h) * dim;
                    for (int64_t d = 0; d < dim; d++) qr.q[r * dim + d] = src[d] * scale;
                    memset(qr.acc + r * dim, 0, (size_t)dim * sizeof(float));
                    qr.max[r] = -INFINITY, qr.sum[r] = 0.0f, qr.last[r] = prefix + p0 + i;
                }
            attend_task(&qr, &ks, prefix + p0 + count);
            for (int64_t r = 0; r < qr.rows; r++) {
                float *dst = out + (p0 + r / group) * heads * dim + (g * group + r % group) * dim;
                for (int64_t d = 0; d < dim; d++) dst[d] = qr.acc[r * dim + d] / qr.sum[r];
            }
        }
        free(scratch);
    }
    return failed;
}
