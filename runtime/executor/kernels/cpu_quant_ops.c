/* Linear layers on quantized weights, in llama.cpp's block formats (Q8_0, Q4_0, Q4_1: 32
 * values per block, an fp16 scale d, Q4_1 also an fp16 offset m; Q4 values are nibbles,
 * the low nibbles of a block's 16 bytes are values 0..15, the high ones 16..31; the K
 * formats Q4_K / Q5_K / Q6_K, super-blocks of 256, are in cpu_kquant_ops.c).
 *
 * The activation rows are quantized once per call to 16-bit blocks of 32 (scale dx, values
 * qx = round(x / dx) in -32767..32767, and their sum sx), so each weight block meets each
 * row in integers and the scales apply once per block:
 *   Q8_0  sum w x = dw dx sum(qw qx)
 *   Q4_0  sum w x = dw dx (sum(q qx) - 8 sx)             (w = dw (q - 8))
 *   Q4_1  sum w x = dw dx sum(q qx) + m dx sx             (w = dw q + m)
 * The weights are read from memory once for all activation rows (batch-1 decode and
 * small batches are bound by reading them).
 *
 * Why 16-bit activations, not llama.cpp's 8-bit ones: on SmolLM2-135M the 8-bit rounding
 * of the activations moved the top logit by up to a whole unit and flipped 2.9% of greedy
 * tokens against the same weights in float (KL 0.0024); 16 bits make that error 256x
 * smaller, and widening the weights to 16 bits costs the AVX2 loop about what the 8-bit
 * sign trick did (two madd instead of sign, sign, maddubs, madd).
 *
 * One build serves every x86-64 CPU: each instruction-set variant is compiled with its own
 * target attribute and chosen at run time (cpu_features.c; callers may force one):
 *   ISA_SCALAR      portable C
 *   ISA_AVX2        AVX2 vpmaddwd
 *   ISA_AVX512VNNI  vpdpwssd (AVX512-VNNI on 256-bit registers)
 */
#include <stdlib.h>

#include "cpu_parallel.h"
#include "cpu_quant.h"

/* ---- activations: rows x k floats -> qx int16 [rows, k], dx, sx float [rows, k / 32] ---- */

#define QMAX 32767.0f

static void quantize_block_scalar(const float *v, int16_t *q, float *d_out, float *s_out) {
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
    float d = amax / QMAX, id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int i = 0; i < QK; i++) {
        q[i] = (int16_t)nearbyintf(v[i] * id);
        sum += q[i];
    }
    *d_out = d;
    *s_out = (float)sum;
}

#if defined(__x86_64__)
/* The same arithmetic on 4 vectors: max |v|, the same float products, round to nearest
 * even (the default rounding mode, as nearbyintf), 32-bit -> 16-bit in order. */
TARGET_AVX2 static void quantize_block_avx2(const float *v, int16_t *q, float *d_out, float *s_out) {
    __m256 x[4], amax = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float d = _mm_cvtss_f32(m) / QMAX, id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i qi[4];
    for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], _mm256_set1_ps(id)));
    __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xd8);
    __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xd8);
    _mm256_storeu_si256((__m256i *)q, lo);
    _mm256_storeu_si256((__m256i *)(q + 16), hi);
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    *d_out = d;
    *s_out = (float)_mm_cvtsi128_si32(s);
}
#endif

/* rows x k floats -> qx int16 [rows, k], dx, sx float [rows, k / 32] (any isa: the same
 * result). */
void spruce_quantize_rows_q16(const float *x, int64_t rows, int64_t k, int16_t *qx, float *dx, float *sx,
                              int64_t isa) {
    void (*block)(const float *, int16_t *, float *, float *) = quantize_block_scalar;
#if defined(__x86_64__)
    if (isa != ISA_SCALAR) block = quantize_block_avx2;
#endif
    int64_t nb = k / QK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++)
            block(x + r * k + b * QK, qx + r * k + b * QK, dx + r * nb + b, sx + r * nb + b);
}

/* ---- one output row: the weight row's blocks against up to 4 activation rows ---- */

static void row_scalar(int64_t type, const uint8_t *w, const activations *a, float *out) {
    int64_t nb = a->k / QK, bytes = block_bytes(type);
    for (int64_t m = 0; m < a->rows; m++) out[m] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * bytes;
        int8_t q[QK];
        float dw, offset = 0.0f;
        if (type == TYPE_Q8_0) {
            const block_q8_0 *blk = (const block_q8_0 *)block;
            dw = half_to_float(blk->d);
            memcpy(q, blk->qs, QK);
        } else {
            const uint8_t *qs = type == TYPE_Q4_0 ? ((const block_q4_0 *)block)->qs : ((const block_q4_1 *)block)->qs;
            uint16_t d16;
            memcpy(&d16, block, 2);
            dw = half_to_float(d16);
            for (int i = 0; i < QK / 2; i++) q[i] = qs[i] & 0x0f, q[i + QK / 2] = qs[i] >> 4;
            if (type == TYPE_Q4_1) offset = half_to_float(((const block_q4_1 *)block)->m);
        }
        for (int64_t m = 0; m < a->rows; m++) {
            const int16_t *x = a->qx + m * a->k + b * QK;
            int32_t dot = 0;
            for (int i = 0; i < QK; i++) dot += (int32_t)q[i] * x[i];
            float d = a->dx[m * nb + b], s = a->sx[m * nb + b];
            if (type == TYPE_Q4_0) dot -= 8 * (int32_t)s;
            out[m] += dw * d * (float)dot + offset * d * s;
        }
    }
}

#if defined(__x86_64__)
/* The weight block widened to 16 bits, once for all activation rows: values 0..15 in *lo,
 * 16..31 in *hi. Q4 bytes are zero-extended to 16-bit lanes, whose low nibble is value i
 * and high nibble value i + 16 (one shuffle per block instead of four). */
TARGET_AVX2 static inline void load_weight16(int64_t type, const uint8_t *block, __m256i *lo, __m256i *hi) {
    if (type == TYPE_Q8_0) {
        const int8_t *qs = ((const block_q8_0 *)block)->qs;
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)qs));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)));
        return;
    }
    const uint8_t *qs = type == TYPE_Q4_0 ? ((const block_q4_0 *)block)->qs : ((const block_q4_1 *)block)->qs;
    __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
    *lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
    *hi = _mm256_srli_epi16(bytes, 4);
}

/* Integer dot of a widened weight block with 32 int16 activations, 8 int32 partial sums. */
TARGET_AVX2 static inline __m256i dot16x_avx2(__m256i lo, __m256i hi, __m256i x_lo, __m256i x_hi) {
    return _mm256_add_epi32(_mm256_madd_epi16(lo, x_lo), _mm256_madd_epi16(hi, x_hi));
}

TARGET_VNNI static inline __m256i dot16x_vnni(__m256i lo, __m256i hi, __m256i x_lo, __m256i x_hi) {
    return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), lo, x_lo), hi, x_hi);
}

static inline short half_at(const uint8_t *p) {
    short h;
    memcpy(&h, p, 2);
    return h;
}

/* The fp16 at p of `count` (<= STEP) blocks `bytes` apart, as float lanes (0 past count). */
#define STEP 8 /* blocks whose scales are converted and multiplied as one vector */
TARGET_AVX2 static inline __m256 halves8(const uint8_t *p, int64_t bytes, const int count) {
    if (count == STEP)
        return _mm256_cvtph_ps(_mm_setr_epi16(half_at(p), half_at(p + bytes), half_at(p + 2 * bytes),
                                              half_at(p + 3 * bytes), half_at(p + 4 * bytes), half_at(p + 5 * bytes),
                                              half_at(p + 6 * bytes), half_at(p + 7 * bytes)));
    short h[STEP] = {0};
    for (int j = 0; j < count; j++) h[j] = half_at(p + j * bytes);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* Q4_1: the fp16 pairs (d, m) heading `count` (<= STEP) blocks `bytes` apart, as float lanes
 * *d and *m (0 past count): one 32-bit load per block, then d and m apart. */
TARGET_AVX2 static inline void pairs8(const uint8_t *p, int64_t bytes, const int count, __m256 *d, __m256 *m) {
    int u[STEP] = {0};
    for (int j = 0; j < count; j++) memcpy(&u[j], p + j * bytes, 4);
    __m256i dm = count == STEP ? _mm256_setr_epi32(u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7])
                               : _mm256_loadu_si256((const __m256i *)u);
    dm = _mm256_shuffle_epi8(dm, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5,
                                                  8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    dm = _mm256_permute4x64_epi64(dm, 0xd8); /* d of blocks 0..7, then m of blocks 0..7 */
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    *m = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
}

/* `count` (<= STEP) floats as lanes (0 past count). */
TARGET_AVX2 static inline __m256 floats8(const float *p, const int count) {
    if (count == STEP) return _mm256_loadu_ps(p);
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lanes));
}

/* The SIMD kernel of the 32-value formats, once per instruction set (DOTX above): WROWS
 * weight rows (1, or 4 at `stride` bytes) against ROWS activation rows, both constants (the
 * accumulators stay in registers; with a run-time row count they go through the stack, far
 * slower at batch 1): out[r * MAX_ROWS + m].
 * The blocks go STEP at a time. Per step and weight row, Q4_0's and Q4_1's fp16 scales dw
 * become one float vector, multiplied by each activation row's STEP scales dx; the second
 * term (Q4_0's -8 dw sx dx, w = dw (q - 8); Q4_1's m sx dx, w = dw q + m) takes one
 * multiply-add per step. Each block then costs its integer dot and one multiply-add by its
 * dw dx (broadcast from a stored copy). Q8_0, with no second term, converts each block's
 * scale alone (with weights from memory, converting a whole step's scales at once slows it).
 * The loops go block by block over the weight rows, so the 4 x ROWS accumulators are
 * independent chains (one weight row at a time waits on each block's multiply-add). Every
 * (weight row, activation row) pair runs the same operations in the same order whatever
 * WROWS and ROWS, so its result does not depend on the tile.
 * Four rows read at once are four interleaved streams, which the hardware prefetcher does
 * not follow (with weights from memory, slower than one row at a time), so each block
 * prefetches its share of the rows 8 ahead (four rows are one contiguous region: a block's
 * share is 4 blocks). */
#define SIMD_TILE(ISA, TARGET, DOTX)                                                                 \
    TARGET static inline __attribute__((always_inline)) void ISA##_step(                             \
        const int64_t type, const uint8_t *w, const activations *a, __m256 acc[4][MAX_ROWS],         \
        const int64_t stride, const int64_t b, const int count, const int WROWS, const int ROWS) {   \
        const int64_t nb = a->k / QK, bytes = block_bytes(type);                                      \
        _Alignas(32) float scale[4][MAX_ROWS][STEP];                                                  \
        __m256 dx[MAX_ROWS], dxsx[MAX_ROWS];                                                          \
        for (int m = 0; m < ROWS; m++) {                                                              \
            dx[m] = floats8(a->dx + m * nb + b, count);                                               \
            dxsx[m] = _mm256_mul_ps(dx[m], floats8(a->sx + m * nb + b, count));                       \
        }                                                                                             \
        _Pragma("GCC unroll 4") for (int r = 0; r < WROWS && type != TYPE_Q8_0; r++) {                \
            const uint8_t *first = w + r * stride + b * bytes;                                        \
            __m256 dw, second;                                                                        \
            if (type == TYPE_Q4_1)                                                                    \
                pairs8(first, bytes, count, &dw, &second);                                            \
            else                                                                                      \
                dw = halves8(first, bytes, count), second = _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f)); \
            for (int m = 0; m < ROWS; m++) {                                                          \
                _mm256_store_ps(scale[r][m], _mm256_mul_ps(dw, dx[m]));                               \
                if (type != TYPE_Q8_0) acc[r][m] = _mm256_fmadd_ps(second, dxsx[m], acc[r][m]);       \
            }                                                                                         \
        }                                                                                             \
        _Pragma("GCC unroll 8") for (int j = 0; j < count; j++) {                                     \
            if (WROWS == 4) { /* the share of block j: 4 blocks, two or three lines */                \
                const char *ahead = (const char *)w + 8 * stride + (b + j) * 4 * bytes;               \
                _mm_prefetch(ahead, _MM_HINT_T0);                                                     \
                _mm_prefetch(ahead + 64, _MM_HINT_T0);                                                \
                if (4 * bytes > 128) _mm_prefetch(ahead + 128, _MM_HINT_T0);                          \
            }                                                                                         \
            __m256i x_lo[MAX_ROWS], x_hi[MAX_ROWS];                                                   \
            for (int m = 0; m < ROWS; m++) {                                                          \
                const int16_t *x = a->qx + m * a->k + (b + j) * QK;                                   \
                x_lo[m] = _mm256_loadu_si256((const __m256i *)x);                                     \
                x_hi[m] = _mm256_loadu_si256((const __m256i *)(x + 16));                              \
                __asm__("" : "+x"(x_lo[m]), "+x"(x_hi[m])); /* in registers for the WROWS rows */     \
            }                                                                                         \
            _Pragma("GCC unroll 4") for (int r = 0; r < WROWS; r++) {                                 \
                __m256i w_lo, w_hi;                                                                   \
                const uint8_t *block = w + r * stride + (b + j) * bytes;                              \
                load_weight16(type, block, &w_lo, &w_hi);                                             \
                for (int m = 0; m < ROWS; m++) {                                                      \
                    __m256 dot = _mm256_cvtepi32_ps(DOTX(w_lo, w_hi, x_lo[m], x_hi[m]));              \
                    __m256 s = type == TYPE_Q8_0                                                      \
                                   ? _mm256_set1_ps(_cvtsh_ss((uint16_t)half_at(block)) * a->dx[m * nb + b + j]) \
                                   : _mm256_broadcast_ss(&scale[r][m][j]);                            \
                    acc[r][m] = _mm256_fmadd_ps(dot, s, acc[r][m]);                                   \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    TARGET static inline __attribute__((always_inline)) void ISA##_body(                             \
        const int64_t type, const uint8_t *w, const activations *a, float *out, const int64_t stride, \
        const int WROWS, const int ROWS) {                                                            \
        const int64_t nb = a->k / QK;                                                                 \
        __m256 acc[4][MAX_ROWS];                                                                      \
        for (int r = 0; r < WROWS; r++)                                                               \
            for (int m = 0; m < ROWS; m++) acc[r][m] = _mm256_setzero_ps();                           \
        int64_t b = 0;                                                                                \
        for (; b + STEP <= nb; b += STEP) {                                                           \
            ISA##_step(type, w, a, acc, stride, b, STEP, WROWS, ROWS);                                \
        }                                                                                             \
        if (b < nb) ISA##_step(type, w, a, acc, stride, b, (int)(nb - b), WROWS, ROWS);               \
        for (int r = 0; r < WROWS; r++)                                                               \
            for (int m = 0; m < ROWS; m++) out[r * MAX_ROWS + m] = hsum8(acc[r][m]);                  \
    }                                                                                                 \
    TARGET static inline __attribute__((always_inline)) void ISA##_types(                            \
        int64_t type, const uint8_t *w, const activations *a, float *out, int64_t stride, const int WROWS, \
        const int ROWS) {                                                                             \
        switch (type) {                                                                               \
        case TYPE_Q8_0: ISA##_body(TYPE_Q8_0, w, a, out, stride, WROWS, ROWS); return;               \
        case TYPE_Q4_0: ISA##_body(TYPE_Q4_0, w, a, out, stride, WROWS, ROWS); return;               \
        default: ISA##_body(TYPE_Q4_1, w, a, out, stride, WROWS, ROWS); return;                      \
        }                                                                                             \
    }

SIMD_TILE(avx2, TARGET_AVX2, dot16x_avx2)
SIMD_TILE(vnni, TARGET_VNNI, dot16x_vnni)
ROW_KERNEL(TARGET_AVX2 static void row_avx2, avx2_types)
ROW_KERNEL(TARGET_VNNI static void row_vnni, vnni_types)
TILE4_KERNEL(TARGET_AVX2 static void tile4_avx2, avx2_types, 2)
TILE4_KERNEL(TARGET_VNNI static void tile4_vnni, vnni_types, 4)
#endif

typedef void (*tile4_fn)(int64_t type, const uint8_t *w, const activations *a, float *out, int64_t stride);

/* A GEMV call's arguments (spruce_quant_gemv's) and its row kernels for this ISA. */
typedef struct {
    int64_t type, n, k, rows, y_stride;
    const uint8_t *w;
    const int16_t *qx;
    const float *dx, *sx, *bias;
    float *y;
    row_fn row;
    tile4_fn tile4; /* four weight rows at a time, or NULL */
} gemv_call;

#define TILE 16 /* weight rows per tile (a multiple of 4) */

/* Weight rows [first_row, end) against every activation row, a tile of TILE rows at a time:
 * the tile stays in cache while it meets the activation rows MAX_ROWS at a time, so the
 * weights are read from memory once for any number of activation rows. */
static void gemv_rows(const gemv_call *g, int64_t first_row, int64_t end) {
    int64_t nb = g->k / QK, bytes = row_bytes(g->type, g->k), k = g->k;
    for (int64_t tile = first_row; tile < end; tile += TILE) {
        int64_t tile_end = tile + TILE < end ? tile + TILE : end;
        for (int64_t first = 0; first < g->rows; first += MAX_ROWS) {
            int64_t count = g->rows - first < MAX_ROWS ? g->rows - first : MAX_ROWS;
            activations a = {g->qx + first * k, g->dx + first * nb, g->sx + first * nb, k, count};
            float *y = g->y + first * g->y_stride;
            int64_t i = tile;
            for (; g->tile4 != NULL && i + 4 <= tile_end; i += 4) {
                float out[4 * MAX_ROWS];
                g->tile4(g->type, g->w + i * bytes, &a, out, bytes);
                for (int64_t r = 0; r < 4; r++)
                    for (int64_t m = 0; m < count; m++)
                        y[m * g->y_stride + i + r] = out[r * MAX_ROWS + m] + (g->bias != NULL ? g->bias[i + r] : 0.0f);
            }
            for (; i < tile_end; i++) {
                float out[MAX_ROWS];
                g->row(g->type, g->w + i * bytes, &a, out);
                for (int64_t m = 0; m < count; m++)
                    y[m * g->y_stride + i] = out[m] + (g->bias != NULL ? g->bias[i] : 0.0f);
            }
        }
    }
}

/* Task [first, end) of a GEMV: those tiles of TILE weight rows. */
static void gemv_task(const void *ctx, int64_t first, int64_t end, int thread) {
    const gemv_call *g = ctx;
    (void)thread;
    gemv_rows(g, first * TILE, end * TILE < g->n ? end * TILE : g->n);
}

#define TASKS_PER_THREAD 8 /* tasks of contiguous tiles per thread: streams long enough to prefetch */

/* y[m, i] = sum_j W[i, j] x[m, j] (+ bias[i]) for every activation row m < rows; W is n
 * rows of k / 32 blocks of `type` (k / 256 for the K formats); the activations are already
 * quantized (spruce_quantize_rows_q16). y has row stride y_stride. The tiles go to the
 * threads in tasks of contiguous tiles (cpu_parallel.h), each read front to back as one
 * stream. */
void spruce_quant_gemv(int64_t type, const uint8_t *w, int64_t n, int64_t k, const int16_t *qx, const float *dx,
                       const float *sx, int64_t rows, const float *bias, float *y, int64_t y_stride, int64_t isa) {
    int k_type = is_k_type(type);
    gemv_call g = {type, n, k, rows, y_stride, w, qx, dx, sx, bias, y, k_type ? kquant_row_scalar : row_scalar, NULL};
#if defined(__x86_64__)
    if (isa == ISA_AVX2) g.row = k_type ? kquant_row_avx2 : row_avx2, g.tile4 = k_type ? kquant_tile4_avx2 : tile4_avx2;
    if (isa == ISA_AVX512VNNI) g.row = k_type ? kquant_row_vnni : row_vnni, g.tile4 = k_type ? kquant_tile4_vnni : tile4_vnni;
#endif
    int64_t tiles = (n + TILE - 1) / TILE;
    int threads = task_threads();
    int64_t grain = tiles / ((int64_t)threads * TASKS_PER_THREAD);
    share_tasks(tiles, grain > 0 ? grain : 1, threads, gemv_task, &g);
}

/* The whole linear layer in one call (one ctypes call per layer at decode): the activation
 * rows are quantized into scratch memory, then meet the weights. Returns 1 when the
 * scratch memory cannot be had. */
int spruce_quant_linear(int64_t type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows,
                        const float *bias, float *y, int64_t isa) {
    int64_t nb = k / QK;
    int16_t *qx = malloc((size_t)(rows * k) * sizeof(int16_t));
    float *scales = malloc((size_t)(2 * rows * nb) * sizeof(float));
    if (qx == NULL || scales == NULL) {
        free(qx), free(scales);
        return 1;
    }
    spruce_quantize_rows_q16(x, rows, k, qx, scales, scales + rows * nb, isa);
    spruce_quant_gemv(type, w, n, k, qx, scales, scales + rows * nb, rows, bias, y, n, isa);
    free(qx), free(scales);
    return 0;
}

/* Weight rows ids[0..count) (all n rows when ids is NULL) dequantized to float, row-major
 * into out [count, k]: the tiled path for many activation rows, and embedding lookups. */
void spruce_dequantize_rows(int64_t type, const uint8_t *w, int64_t k, const int64_t *ids, int64_t count,
                            float *out) {
    int64_t nb = k / QK, bytes = block_bytes(type), stride = row_bytes(type, k);
#pragma omp parallel for schedule(static) if (count * k >= (1 << 16))
    for (int64_t r = 0; r < count; r++) {
        const uint8_t *row = w + (ids != NULL ? ids[r] : r) * stride;
        if (is_k_type(type)) {
            kquant_dequantize_row(type, row, k, out + r * k);
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *block = row + b * bytes;
            float *o = out + r * k + b * QK;
            uint16_t d16;
            memcpy(&d16, block, 2);
            float d = half_to_float(d16);
            if (type == TYPE_Q8_0) {
                const int8_t *qs = ((const block_q8_0 *)block)->qs;
                for (int i = 0; i < QK; i++) o[i] = d * (float)qs[i];
                continue;
            }
            const uint8_t *qs = type == TYPE_Q4_0 ? ((const block_q4_0 *)block)->qs : ((const block_q4_1 *)block)->qs;
            float m = type == TYPE_Q4_1 ? half_to_float(((const block_q4_1 *)block)->m) : -8.0f * d;
            for (int i = 0; i < QK / 2; i++) {
                o[i] = d * (float)(qs[i] & 0x0f) + m;
                o[i + QK / 2] = d * (float)(qs[i] >> 4) + m;
            }
        }
    }
}
