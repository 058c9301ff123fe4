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
TARGET_AVX2 static inline __m256i dot16_avx2(__m256i lo, __m256i hi, const int16_t *x) {
    __m256i a = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x));
    return _mm256_add_epi32(a, _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
}

TARGET_VNNI static inline __m256i dot16_vnni(__m256i lo, __m256i hi, const int16_t *x) {
    __m256i a = _mm256_dpwssd_epi32(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)x));
    return _mm256_dpwssd_epi32(a, hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
}

/* The SIMD row loop, once per instruction set (DOT is dot16 above). Per row m:
 * a float vector accumulates dw dx dot, a scalar the Q4 terms in sx. The body is
 * instantiated per (type, rows) with both constant, so the row loops unroll and the
 * accumulators stay in registers (with a run-time row count they went through the stack:
 * about 3x slower at batch 1). */
/* A block's weight scale dw and its second term: Q4_0's -8 dw (w = dw (q - 8)), Q4_1's
 * offset m (w = dw q + m), none for Q8_0. */
TARGET_AVX2 static inline void block_scales(int64_t type, const uint8_t *block, float *dw, float *second) {
    uint16_t d16;
    memcpy(&d16, block, 2);
    *dw = _cvtsh_ss(d16);
    *second = type == TYPE_Q4_0 ? -8.0f * *dw : type == TYPE_Q4_1 ? _cvtsh_ss(((const block_q4_1 *)block)->m) : 0.0f;
}

#define SIMD_ROW(NAME, TARGET, DOT)                                                                  \
    TARGET static inline __attribute__((always_inline)) void NAME##_body(                            \
        const int64_t type, const uint8_t *w, const activations *a, float *out, const int64_t rows) { \
        int64_t nb = a->k / QK, bytes = block_bytes(type);                                            \
        __m256 acc[MAX_ROWS];                                                                         \
        float extra[MAX_ROWS] = {0};                                                                  \
        for (int64_t m = 0; m < MAX_ROWS; m++) acc[m] = _mm256_setzero_ps();                          \
        for (int64_t b = 0; b < nb; b++) {                                                            \
            const uint8_t *block = w + b * bytes;                                                     \
            float dw, second;                                                                         \
            block_scales(type, block, &dw, &second);                                                  \
            __m256i w_lo, w_hi;                                                                       \
            load_weight16(type, block, &w_lo, &w_hi);                                                 \
            for (int64_t m = 0; m < rows; m++) {                                                      \
                float d = a->dx[m * nb + b];                                                          \
                __m256 dot = _mm256_cvtepi32_ps(DOT(w_lo, w_hi, a->qx + m * a->k + b * QK));          \
                acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * d), acc[m]);                        \
                if (type != TYPE_Q8_0) extra[m] += second * d * a->sx[m * nb + b];                    \
            }                                                                                         \
        }                                                                                             \
        for (int64_t m = 0; m < rows; m++) out[m] = hsum8(acc[m]) + extra[m];                         \
    }                                                                                                 \
    TARGET static void NAME(int64_t type, const uint8_t *w, const activations *a, float *out) {      \
        SWITCH_TYPE_ROWS(NAME##_body, type, a->rows, w, a, out)                                       \
    }

SIMD_ROW(row_avx2, TARGET_AVX2, dot16_avx2)
SIMD_ROW(row_vnni, TARGET_VNNI, dot16_vnni)

/* Four weight rows (at `stride` bytes) against ROWS activation rows: a tile of 4 x ROWS
 * outputs, with the activation blocks loaded once for the four weight rows and each weight
 * block widened once for the ROWS activation rows; the 4 x ROWS accumulators are independent
 * chains (one weight row at a time waited on each block's multiply-add: about 1.3x slower at
 * batch 1, and more per extra activation row). ROWS is a constant, at most TILE_ROWS of the
 * variant (the accumulators, activations and scales stay in registers: 16 ymm on AVX2, 32
 * with AVX-512VL). The arithmetic per (weight row, activation row) is SIMD_ROW's, in the
 * same order, so the results are identical whatever the tile (the compiler contracts
 * SIMD_ROW's Q4 term to the multiply-add written out here; a test checks).
 * Four rows read at once are four interleaved streams, which the hardware prefetcher did
 * not follow (weights from memory: 1.3-1.45x slower than one row at a time), so each block
 * step prefetches its share (4 blocks, two lines cover them) of the rows 8 ahead. */
TARGET_AVX2 static inline __m256i dot16x_avx2(__m256i lo, __m256i hi, __m256i x_lo, __m256i x_hi) {
    return _mm256_add_epi32(_mm256_madd_epi16(lo, x_lo), _mm256_madd_epi16(hi, x_hi));
}

TARGET_VNNI static inline __m256i dot16x_vnni(__m256i lo, __m256i hi, __m256i x_lo, __m256i x_hi) {
    return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), lo, x_lo), hi, x_hi);
}

/* Q4_1: the four rows' block headers (d, m) as floats in one conversion, lanes 2r = d and
 * 2r + 1 = m of row r. With the products d dx and m dx sx in vectors this saved ~12% of
 * the batch-1 Q4_1 matmuls (for Q4_0 and Q8_0, one fp16 per block, it lost). Row r's d dx
 * then reaches its multiply-add as a broadcast load from a stored copy rather than a lane
 * permute: batch-1 matmuls in cache 2-3% faster on Zen 4, the same at 2-4 rows. */
TARGET_AVX2 static inline __m256 block_scales4(const uint8_t *block, int64_t stride) {
    uint32_t h[4];
    for (int r = 0; r < 4; r++) memcpy(&h[r], block + r * stride, 4);
    return _mm256_cvtph_ps(_mm_setr_epi32((int)h[0], (int)h[1], (int)h[2], (int)h[3]));
}

/* The activation rows' block b: 32 int16 values in two vectors each. */
#define LOAD_X(ROWS)                                                                                 \
    __m256i x_lo[MAX_ROWS], x_hi[MAX_ROWS];                                                           \
    for (int m = 0; m < ROWS; m++) {                                                                  \
        const int16_t *x = a->qx + m * a->k + b * QK;                                                 \
        x_lo[m] = _mm256_loadu_si256((const __m256i *)x);                                             \
        x_hi[m] = _mm256_loadu_si256((const __m256i *)(x + 16));                                      \
    }                                                                                                 \
    const char *ahead = (const char *)w + 8 * stride + b * 4 * bytes;                                 \
    _mm_prefetch(ahead, _MM_HINT_T0);                                                                 \
    _mm_prefetch(ahead + 63, _MM_HINT_T0);

#define SIMD_TILE(NAME, TARGET, DOTX)                                                                \
    TARGET static inline __attribute__((always_inline)) void NAME##_body(                            \
        const int64_t type, const uint8_t *w, const activations *a, float *out, const int64_t stride, \
        const int ROWS) {                                                                             \
        int64_t nb = a->k / QK, bytes = block_bytes(type);                                            \
        __m256 acc[4][MAX_ROWS];                                                                      \
        float extra[4][MAX_ROWS];                                                                     \
        for (int r = 0; r < 4; r++)                                                                   \
            for (int m = 0; m < ROWS; m++) acc[r][m] = _mm256_setzero_ps(), extra[r][m] = 0.0f;       \
        for (int64_t b = 0; b < nb; b++) {                                                            \
            LOAD_X(ROWS)                                                                              \
            for (int r = 0; r < 4; r++) {                                                             \
                const uint8_t *block = w + r * stride + b * bytes;                                    \
                float dw, second;                                                                     \
                block_scales(type, block, &dw, &second);                                              \
                __m256i w_lo, w_hi;                                                                   \
                load_weight16(type, block, &w_lo, &w_hi);                                             \
                for (int m = 0; m < ROWS; m++) {                                                      \
                    float d = a->dx[m * nb + b];                                                      \
                    __m256 dot = _mm256_cvtepi32_ps(DOTX(w_lo, w_hi, x_lo[m], x_hi[m]));              \
                    acc[r][m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * d), acc[r][m]);              \
                    if (type != TYPE_Q8_0) extra[r][m] += second * d * a->sx[m * nb + b];             \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        for (int r = 0; r < 4; r++)                                                                   \
            for (int m = 0; m < ROWS; m++) out[r * MAX_ROWS + m] = hsum8(acc[r][m]) + extra[r][m];    \
    }                                                                                                 \
    TARGET static inline __attribute__((always_inline)) void NAME##_q4_1(                            \
        const uint8_t *w, const activations *a, float *out, const int64_t stride, const int ROWS) {   \
        int64_t nb = a->k / QK, bytes = sizeof(block_q4_1);                                           \
        __m256 acc[4][MAX_ROWS], extra[MAX_ROWS];                                                     \
        for (int m = 0; m < ROWS; m++) {                                                              \
            extra[m] = _mm256_setzero_ps();                                                           \
            for (int r = 0; r < 4; r++) acc[r][m] = _mm256_setzero_ps();                              \
        }                                                                                             \
        for (int64_t b = 0; b < nb; b++) {                                                            \
            LOAD_X(ROWS)                                                                              \
            const uint8_t *block = w + b * bytes;                                                     \
            __m256 dm = block_scales4(block, stride), ds[MAX_ROWS];                                   \
            float dsv[MAX_ROWS][8];                                                                   \
            for (int m = 0; m < ROWS; m++) {                                                          \
                ds[m] = _mm256_mul_ps(dm, _mm256_set1_ps(a->dx[m * nb + b]));                         \
                _mm256_storeu_ps(dsv[m], ds[m]);                                                      \
                extra[m] = _mm256_fmadd_ps(ds[m], _mm256_set1_ps(a->sx[m * nb + b]), extra[m]);       \
            }                                                                                         \
            for (int r = 0; r < 4; r++) {                                                             \
                __m256i w_lo, w_hi;                                                                   \
                load_weight16(TYPE_Q4_1, block + r * stride, &w_lo, &w_hi);                           \
                for (int m = 0; m < ROWS; m++) {                                                      \
                    __m256 dot = _mm256_cvtepi32_ps(DOTX(w_lo, w_hi, x_lo[m], x_hi[m]));              \
                    __m256 scale = _mm256_broadcast_ss(&dsv[m][2 * r]);                               \
                    acc[r][m] = _mm256_fmadd_ps(dot, scale, acc[r][m]);                               \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        for (int m = 0; m < ROWS; m++) {                                                              \
            float extras[8];                                                                          \
            _mm256_storeu_ps(extras, extra[m]);                                                       \
            for (int r = 0; r < 4; r++) out[r * MAX_ROWS + m] = hsum8(acc[r][m]) + extras[2 * r + 1]; \
        }                                                                                             \
    }                                                                                                 \
    TARGET static inline __attribute__((always_inline)) void NAME##_rows(                            \
        int64_t type, const uint8_t *w, const activations *a, float *out, int64_t stride, const int ROWS) { \
        switch (type) {                                                                               \
        case TYPE_Q8_0: NAME##_body(TYPE_Q8_0, w, a, out, stride, ROWS); return;                     \
        case TYPE_Q4_0: NAME##_body(TYPE_Q4_0, w, a, out, stride, ROWS); return;                     \
        default: NAME##_q4_1(w, a, out, stride, ROWS); return;                                       \
        }                                                                                             \
    }

/* out[r * MAX_ROWS + m]: weight row r (of 4) against activation row m (< a->rows <= MAX_ROWS),
 * in tiles of at most TILE_ROWS activation rows (the accumulators in registers). */
#define TILE_FN(NAME, TARGET, TILE_ROWS)                                                             \
    TARGET static void NAME(int64_t type, const uint8_t *w, const activations *a, float *out, int64_t stride) { \
        for (int64_t first = 0; first < a->rows; first += TILE_ROWS) {                                \
            int64_t nb = a->k / QK, count = a->rows - first < TILE_ROWS ? a->rows - first : TILE_ROWS; \
            activations part = {a->qx + first * a->k, a->dx + first * nb, a->sx + first * nb, a->k, count}; \
            float *o = out + first;                                                                   \
            switch (count) {                                                                          \
            case 1: NAME##_tile_rows(type, w, &part, o, stride, 1); break;                            \
            case 2: NAME##_tile_rows(type, w, &part, o, stride, 2); break;                            \
            case 3: NAME##_tile_rows(type, w, &part, o, stride, TILE_ROWS > 2 ? 3 : 1); break;        \
            default: NAME##_tile_rows(type, w, &part, o, stride, TILE_ROWS > 2 ? 4 : 1); break;       \
            }                                                                                         \
        }                                                                                             \
    }

SIMD_TILE(tile4_avx2_tile, TARGET_AVX2, dot16x_avx2)
SIMD_TILE(tile4_vnni_tile, TARGET_VNNI, dot16x_vnni)
TILE_FN(tile4_avx2, TARGET_AVX2, 2)
TILE_FN(tile4_vnni, TARGET_VNNI, 4)
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
    tile4_fn tile4; /* four weight rows at a time (the 32-value formats), or NULL */
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
    if (isa == ISA_AVX2) g.row = k_type ? kquant_row_avx2 : row_avx2, g.tile4 = k_type ? NULL : tile4_avx2;
    if (isa == ISA_AVX512VNNI) g.row = k_type ? kquant_row_vnni : row_vnni, g.tile4 = k_type ? NULL : tile4_vnni;
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
