/* Linear layers on quantized weights for many activation rows (batched decode, prefill):
 * y[rows, n] = x[rows, k] @ W^T (+ bias), W given as n rows of llama.cpp blocks (Q8_0,
 * Q4_0, Q4_1; the K formats through cpu_kquant_ops.c's row dequantizer), in float32.
 *
 * A GEMM in the BLIS manner whose "pack B" step dequantizes: with many rows each weight is
 * used `rows` times, so decoding it once per call into the layout the microkernel reads
 * costs about what packing costs in any GEMM (no float32 copy of W is ever kept, and nothing
 * is allocated per tile).
 *
 *   packed x   once per call: slivers of MR rows, [k][MR] each (rows past the end are zero),
 *              so the microkernel broadcasts one value per row and step.
 *   packed W   per thread, per panel of NCP * NR weight rows and KC values of k: each group
 *              of NR rows is dequantized row by row into a scratch [NR][KC], then transposed
 *              into [KC][NR] (8 x 8 blocks in registers on AVX2 / AVX-512); rows past n
 *              are zero.
 *   microkernel  an MR x NR tile of y in registers (MR broadcasts x 2 vectors of NR / 2
 *              per step of k): 6 x 16 on AVX2 (12 of 16 ymm registers), 12 x 32 on AVX-512
 *              (24 of 32 zmm), 6 x 8 portable (SSE2 or any CPU's baseline). The first k
 *              block stores bias + sum, later ones add to y.
 *   blocking   a KC-long NR-wide weight panel stays in L1 while every row sliver (from
 *              L2) meets it; KC splits k into equal blocks of at most KC_MAX, whole
 *              quantization blocks. Rows go in blocks of MC_SLIVERS slivers so the packed
 *              rows of one k block stay in L2 for prefill.
 *   threads    the threads take the weight panels (NCP groups of NR rows; each weight
 *              dequantized once) as tasks (cpu_parallel.h); when there are few groups for
 *              the threads (small n, many threads) a task is a panel x a part of the rows.
 *
 * Compiled once per instruction set (cpu_library.py: portable, AVX2, AVX-512) with GCC
 * vector extensions of the variant's native width; the loader binds the best one. */
#include <stdlib.h>

#include "cpu_parallel.h"
#include "cpu_quant.h"
#include "cpu_vector.h"

/* Floats per vector and rows per tile; -DVW=16 -DMR=12 builds the AVX-512 variant's tile
 * shapes on a CPU without it (for testing them there). */
#if !defined(VW) && defined(__AVX512F__)
#define VW 16
#define MR 12
#elif !defined(VW) && defined(__AVX2__)
#define VW 8
#define MR 6
#elif !defined(VW)
#define VW 4
#define MR 6
#endif
#define NR (2 * VW) /* weight rows per microkernel tile */
#define KC_MAX (20480 / (NR * 4)) /* a 20 KB weight panel in L1 */
#define NCP 4 /* NR-row groups per packed weight panel */
#define MC_SLIVERS (144 / MR) /* row slivers per block (the packed rows of a k block in L2) */

typedef float tile_vec __attribute__((vector_size(VW * sizeof(float))));
typedef float tile_vec_unaligned __attribute__((vector_size(VW * sizeof(float)), aligned(4)));

static inline tile_vec load_tile_vec(const float *p) { return *(const tile_vec_unaligned *)p; }
static inline void store_tile_vec(float *p, tile_vec v) { *(tile_vec_unaligned *)p = v; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline size_t round16(size_t floats) { return (floats + 15) / 16 * 16; } /* whole cache lines */

typedef struct {
    int64_t type, n, k, rows, row_bytes, kc;
    const uint8_t *w;
    const float *bias;
    float *y;
    float *packed_x;
    int64_t groups, slivers, parts; /* NR-row weight groups, MR-row slivers, row parts per panel */
    const float *x;                 /* the activation rows */
    float *scratch;                 /* a share per thread, `share` floats each */
    size_t share;
} gemm;

/* ---- packing ---- */

/* One 32-value block of Q8_0 / Q4_0 / Q4_1 to floats (Q4: the low nibbles are values
 * 0..15, the high ones 16..31). GCC's generic vector conversions go element by element
 * here, so AVX2 has it in intrinsics, which convert whole vectors at once; other builds in
 * loops the compiler vectorizes. */
#if defined(__AVX2__)
static inline void dequantize_block(int64_t type, const uint8_t *block, float *out) {
    uint16_t h[2];
    memcpy(h, block, sizeof h);
    __m256 d = _mm256_set1_ps(_cvtsh_ss(h[0]));
    if (type == TYPE_Q8_0) {
        for (int i = 0; i < 4; i++) {
            __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block + 2 + 8 * i)));
            _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
        }
        return;
    }
    __m256 m = type == TYPE_Q4_1 ? _mm256_set1_ps(_cvtsh_ss(h[1])) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    const uint8_t *qs = block + (type == TYPE_Q4_1 ? 4 : 2);
    for (int i = 0; i < 2; i++) {
        __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * i)));
        __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15)));
        __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
        _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(lo, d, m));
        _mm256_storeu_ps(out + 16 + 8 * i, _mm256_fmadd_ps(hi, d, m));
    }
}
#else
static inline void dequantize_block(int64_t type, const uint8_t *block, float *out) {
    uint16_t h[2];
    memcpy(h, block, sizeof h);
    float d = half_to_float(h[0]);
    if (type == TYPE_Q8_0) {
        const int8_t *qs = (const int8_t *)block + 2;
        for (int i = 0; i < QK; i++) out[i] = d * (float)qs[i];
        return;
    }
    float m = type == TYPE_Q4_1 ? half_to_float(h[1]) : -8.0f * d;
    const uint8_t *qs = block + (type == TYPE_Q4_1 ? 4 : 2);
    for (int i = 0; i < QK / 2; i++) {
        out[i] = d * (float)(qs[i] & 15) + m;
        out[i + QK / 2] = d * (float)(qs[i] >> 4) + m;
    }
}
#endif

/* Values [k0, k0 + count) of weight row `row` to floats. */
static void dequantize_range(const gemm *g, int64_t row, int64_t k0, int64_t count, float *out) {
    const uint8_t *w = g->w + row * g->row_bytes;
    if (is_k_type(g->type)) {
#if defined(__AVX2__)
        kquant_dequantize_row_avx2(g->type, w + k0 / QK_K * block_bytes(g->type), count, out);
#else
        kquant_dequantize_row(g->type, w + k0 / QK_K * block_bytes(g->type), count, out);
#endif
        return;
    }
    int64_t bytes = block_bytes(g->type);
    for (int64_t b = 0; b < count / QK; b++) dequantize_block(g->type, w + (k0 / QK + b) * bytes, out + b * QK);
}

#if defined(__AVX2__)
/* 8 x 8 floats: src rows (stride ld_src) become dst columns (dst rows at stride ld_dst). */
static inline void transpose8(const float *src, int64_t ld_src, float *dst, int64_t ld_dst) {
    __m256 r[8], t[8], s[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ld_src);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ld_dst, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ld_dst, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
    }
}

/* scratch [NR][count] -> packed [count][NR] (count is a multiple of 32). */
static void transpose_panel(const float *scratch, int64_t count, float *packed) {
    for (int64_t p = 0; p < count; p += 8)
        for (int64_t j = 0; j < NR; j += 8) transpose8(scratch + j * count + p, count, packed + p * NR + j, NR);
}
#else
static void transpose_panel(const float *scratch, int64_t count, float *packed) {
    for (int64_t p = 0; p < count; p++)
        for (int64_t j = 0; j < NR; j++) packed[p * NR + j] = scratch[j * count + p];
}
#endif

/* Weight rows [j0, j0 + NR) (zeros past n), values [k0, k0 + count), into packed [count][NR]. */
static void pack_weights(const gemm *g, int64_t j0, int64_t k0, int64_t count, float *scratch, float *packed) {
    int64_t here = min64(NR, g->n - j0);
    for (int64_t j = 0; j < here; j++) dequantize_range(g, j0 + j, k0, count, scratch + j * count);
    memset(scratch + here * count, 0, (size_t)((NR - here) * count) * sizeof(float));
    transpose_panel(scratch, count, packed);
}

/* Activation rows [s MR, s MR + MR) (zeros past rows) into packed [k][MR]. */
static void pack_rows(const float *x, int64_t rows, int64_t k, int64_t s, float *packed) {
    for (int64_t i = 0; i < MR; i++) {
        int64_t r = s * MR + i;
        for (int64_t p = 0; p < k; p++) packed[p * MR + i] = r < rows ? x[r * k + p] : 0.0f;
    }
}

/* ---- the microkernel ---- */

/* c[m rows, NR] (row stride ldc) = (add ? c : bias or 0) + a b over `count` steps: a is a
 * packed row sliver [count][MR], b a packed weight panel [count][NR]. m is a constant at
 * each call site, so the accumulators are registers. */
static inline __attribute__((always_inline)) void tile(const int m, int64_t count, const float *a, const float *b,
                                                       float *c, int64_t ldc, const float *bias, int add) {
    tile_vec acc[MR][2];
#pragma GCC unroll 16
    for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = (tile_vec){0};
#pragma GCC unroll 2
    for (int64_t p = 0; p < count; p++, a += MR, b += NR) {
        tile_vec b0 = load_tile_vec(b), b1 = load_tile_vec(b + VW);
#pragma GCC unroll 16
        for (int i = 0; i < m; i++) {
            tile_vec ai = a[i] - (tile_vec){0}; /* a broadcast (x - 0 is x, also for -0) */
            acc[i][0] += ai * b0;
            acc[i][1] += ai * b1;
        }
    }
    tile_vec base0 = {0}, base1 = {0};
    if (bias != NULL) base0 = load_tile_vec(bias), base1 = load_tile_vec(bias + VW);
#pragma GCC unroll 16
    for (int i = 0; i < m; i++) {
        float *row = c + i * ldc;
        if (add) base0 = load_tile_vec(row), base1 = load_tile_vec(row + VW);
        store_tile_vec(row, base0 + acc[i][0]);
        store_tile_vec(row + VW, base1 + acc[i][1]);
    }
}

#define TILE_CASE(M) \
    case M: tile(M, count, a, b, c, ldc, bias, add); return;

static void run_tile(int64_t m, int64_t count, const float *a, const float *b, float *c, int64_t ldc,
                     const float *bias, int add) {
    switch (m) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
#if MR > 6
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
#endif
    default: return;
    }
}

/* The last weight group when n is not a multiple of NR: through a full-width copy. */
static void run_edge_tile(int64_t m, int64_t cols, int64_t count, const float *a, const float *b, float *c,
                          int64_t ldc, const float *bias, int add) {
    float t[MR * NR], t_bias[NR] = {0};
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < cols; j++) t[i * NR + j] = add ? c[i * ldc + j] : 0.0f;
    for (int64_t j = 0; bias != NULL && j < cols; j++) t_bias[j] = bias[j];
    run_tile(m, count, a, b, t, NR, bias != NULL ? t_bias : NULL, add);
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < cols; j++) c[i * ldc + j] = t[i * NR + j];
}

/* ---- the loops ---- */

/* Row slivers [s0, s1) against the packed panel of weight groups [g0, g0 + groups), values
 * [k0, k0 + count). */
static void multiply_panel(const gemm *g, const float *panel, int64_t g0, int64_t groups, int64_t k0, int64_t count,
                           int64_t s0, int64_t s1) {
    for (int64_t q = 0; q < groups; q++) {
        int64_t j0 = (g0 + q) * NR, cols = min64(NR, g->n - j0);
        const float *b = panel + q * count * NR, *bias = k0 == 0 && g->bias != NULL ? g->bias + j0 : NULL;
        for (int64_t s = s0; s < s1; s++) {
            const float *a = g->packed_x + s * MR * g->k + k0 * MR;
            float *c = g->y + s * MR * g->n + j0;
            int64_t m = min64(MR, g->rows - s * MR);
            if (cols == NR)
                run_tile(m, count, a, b, c, g->n, bias, k0 > 0);
            else
                run_edge_tile(m, cols, count, a, b, c, g->n, bias, k0 > 0);
        }
    }
}

/* One task: the panel of weight groups [first, first + groups) (groups <= NCP) x row
 * slivers [s0, s1). */
static void multiply_task(const gemm *g, int64_t first, int64_t groups, int64_t s0, int64_t s1, float *scratch,
                          float *panel) {
    for (int64_t k0 = 0; k0 < g->k; k0 += g->kc) {
        int64_t count = min64(g->kc, g->k - k0);
        for (int64_t q = 0; q < groups; q++)
            pack_weights(g, (first + q) * NR, k0, count, scratch, panel + q * count * NR);
        for (int64_t s = s0; s < s1; s += MC_SLIVERS)
            multiply_panel(g, panel, first, groups, k0, count, s, min64(s + MC_SLIVERS, s1));
    }
}

/* Row parts per weight panel: 1, or more when the weight groups are too few to keep every
 * thread busy. */
static int64_t row_parts(int64_t threads, int64_t groups, int64_t slivers) {
    int64_t split = threads;
    while (split % 2 == 0 && groups < 4 * split && slivers >= 4 * (threads / split)) split /= 2;
    return threads / split;
}

/* k blocks of equal length, at most KC_MAX (or one quantization block), whole blocks. */
static int64_t k_block(int64_t k, int64_t block) {
    int64_t blocks = k / block, per = KC_MAX / block > 0 ? KC_MAX / block : 1;
    int64_t parts = (blocks + per - 1) / per;
    return (blocks + parts - 1) / parts * block;
}

/* Tasks [first, end) of the call: each a panel of NCP weight groups x its part of the row
 * slivers, in the thread's scratch (a dequantized group, then the packed panel). */
static void panel_tasks(const void *ctx, int64_t first, int64_t end, int thread) {
    const gemm *g = ctx;
    float *rows_scratch = g->scratch + g->share * (size_t)thread, *panel = rows_scratch + NR * g->kc;
    for (int64_t task = first; task < end; task++) {
        int64_t group = task / g->parts * NCP, part = task % g->parts;
        multiply_task(g, group, min64(NCP, g->groups - group), g->slivers * part / g->parts,
                      g->slivers * (part + 1) / g->parts, rows_scratch, panel);
    }
}

/* Slivers [first, end) of the activation rows, packed. */
static void pack_tasks(const void *ctx, int64_t first, int64_t end, int thread) {
    const gemm *g = ctx;
    (void)thread;
    for (int64_t s = first; s < end; s++) pack_rows(g->x, g->rows, g->k, s, g->packed_x + s * MR * g->k);
}

/* y[rows, n] = x[rows, k] @ W^T (+ bias), W n rows of `type` blocks. Returns 1 when the
 * scratch memory cannot be had. */
int PER_ISA(spruce_quant_gemm)(int64_t type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows,
                               const float *bias, float *y) {
    int64_t slivers = (rows + MR - 1) / MR, groups = (n + NR - 1) / NR;
    int threads = task_threads();
    gemm g = {type, n, k, rows, row_bytes(type, k), k_block(k, is_k_type(type) ? QK_K : QK), w, bias, y, NULL,
              groups, slivers, row_parts(threads, groups, slivers), x, NULL, 0};
    size_t x_floats = round16((size_t)(slivers * MR * k));
    g.share = round16((size_t)((NCP + 1) * NR * g.kc));
    float *memory = aligned_alloc(64, (x_floats + g.share * (size_t)threads) * sizeof(float));
    if (memory == NULL) return 1;
    g.packed_x = memory, g.scratch = memory + x_floats;
    share_tasks(slivers, 1, threads, pack_tasks, &g);
    share_tasks((groups + NCP - 1) / NCP * g.parts, 1, threads, panel_tasks, &g);
    free(memory);
    return 0;
}
