/* Linear layers on quantized weights (Q8_0, Q4_0, Q4_1) for many activation rows on CPUs
 * with AVX-512 VNNI or AVX2: y[rows, n] = x[rows, k] @ W^T (+ bias), in integer dot products.
 *
 * The activations are quantized as for the integer GEMV (cpu_quant_ops.c: 16-bit blocks of
 * 32 with a scale dx and a sum sx per block, so the two kernels make the same products),
 * but here the vector lanes are activation rows, not values of k: one vpdpwssd multiplies
 * a pair of k values of 16 rows by the same pair of one weight row (broadcast) and adds
 * both products to each row's sum; on AVX2 a vpmaddwd and a vpaddd do the same for 8 rows.
 * A block's integer sums then take their scales once for 16 rows (a conversion and two
 * multiply-adds per 16 vpdpwssd), where the GEMV's layout pays that per row and block;
 * that overhead, not the multiplies, makes the GEMV lose to the float GEMM past a few rows
 * (INTEGER_MAX_ROWS in cpu_quant_ops.py).
 *
 *   packed x   once per call: groups of 16 rows, per block of k the 16 pairs of 16 rows
 *              (int16 pairs as int32 lanes), dx and dx sx as 16 floats; rows past the end
 *              are zero.
 *   packed W   per task, a panel of PANEL weight rows widened to int16, in tiles of nw
 *              rows (NW_VNNI, NW_AVX2) with the rows' blocks side by side (the microkernel
 *              broadcasts each pair of values from memory, all from one pointer), with each block's scale
 *              dw and second term (Q4_0: -8 dw, Q4_1: m, Q8_0: none) as floats; rows past
 *              n are zero.
 *   microkernel  VNNI: NW_VNNI weight rows x 16 activation rows of one or two row groups
 *              (a zmm each); AVX2: NW_AVX2 weight rows x one row group (two ymm). Per block
 *              nw int32 sums per 16 rows (16 steps of multiply-adds), then acc += float(sum)
 *              dx dw + dx sx second.
 *   threads    the threads take panels (x a part of the row groups when the panels are
 *              few) as tasks (cpu_parallel.h), as the float GEMM does.
 *
 * Sums: |w x| <= 128 * 32767 and 32 of them fit in int32 (one block's sum). */
#include <stdlib.h>

#include "cpu_parallel.h"
#include "cpu_quant.h"

#define LANES 16  /* activation rows per row group (a zmm, or two ymm) */
#define NW_VNNI 8 /* weight rows per microkernel tile: 8 x 2 zmm sums of 32 registers */
#define NW_AVX2 4 /* 4 x 2 ymm sums, 2 activation vectors, a broadcast, a product of 16 */
#define PANEL 32  /* weight rows per task (a multiple of both) */

typedef struct {
    int64_t type, n, k, nb, rows, groups, row_bytes, parts; /* parts: of the row groups, per panel */
    int64_t isa, nw; /* ISA_AVX2 or ISA_AVX512VNNI, and its tile's weight rows */
    const uint8_t *w;
    const float *bias;
    float *y;
    const int32_t *xp; /* [groups][nb][16 pairs][LANES] */
    const float *dxp;  /* [groups][nb][2][LANES]: dx, then dx sx */
    const float *x;    /* the activation rows */
    char *scratch;     /* a share per thread, `share` bytes each */
    size_t share;
} igemm;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline size_t max_size(size_t a, size_t b) { return a > b ? a : b; }

#if defined(__x86_64__)
/* Row group `group` of x [rows, k] -> its packed form (the group's rows through the GEMV's
 * quantizer into the thread's `scratch` as qx, dx, sx, then regrouped). */
static void pack_group(const igemm *g, const float *x, int64_t group, void *scratch) {
    int64_t k = g->k, nb = g->nb, first = group * LANES, count = min64(LANES, g->rows - first);
    int16_t *qx = scratch;
    float *dx = (float *)(qx + LANES * k), *sx = dx + LANES * nb;
    int32_t *xp = (int32_t *)g->xp + group * nb * 16 * LANES;
    float *dxp = (float *)g->dxp + group * nb * 2 * LANES;
    spruce_quantize_rows_q16(x + first * k, count, k, qx, dx, sx, g->isa);
    if (count < LANES) {
        memset(xp, 0, (size_t)(nb * 16 * LANES) * sizeof(int32_t));
        memset(dxp, 0, (size_t)(nb * 2 * LANES) * sizeof(float));
    }
    for (int64_t lane = 0; lane < count; lane++)
        for (int64_t b = 0; b < nb; b++) {
            int32_t *to = xp + b * 16 * LANES + lane;
            const int16_t *q = qx + lane * k + b * QK;
            for (int j = 0; j < 16; j++) memcpy(to + j * LANES, q + 2 * j, sizeof(int32_t));
            float d = dx[lane * nb + b];
            dxp[b * 2 * LANES + lane] = d;
            dxp[b * 2 * LANES + LANES + lane] = d * sx[lane * nb + b];
        }
}

/* Weight rows [j0, j0 + PANEL) (zeros past n), widened to int16, in tiles of nw rows: per
 * tile, block by block, the nw rows' blocks side by side ([nb][nw][32] int16, so the
 * microkernel reaches every row's pairs from one pointer); each block's scale dw and
 * second term per tile as [nb][nw] floats. */
TARGET_AVX2 static void pack_panel(const igemm *g, int64_t j0, int16_t *w16, float *dw, float *second) {
    int64_t k = g->k, nb = g->nb, nw = g->nw, bytes = block_bytes(g->type), here = min64(PANEL, g->n - j0);
    int64_t filled = here / nw * nw;
    if (here < PANEL) {
        memset(w16 + filled * k, 0, (size_t)((PANEL - filled) * k) * sizeof(int16_t));
        memset(dw + filled * nb, 0, (size_t)((PANEL - filled) * nb) * sizeof(float));
        memset(second + filled * nb, 0, (size_t)((PANEL - filled) * nb) * sizeof(float));
    }
    for (int64_t r = 0; r < here; r++) {
        const uint8_t *row = g->w + (j0 + r) * g->row_bytes;
        int64_t base = r / nw * nw, w = r % nw;
        int16_t *tile_w = w16 + base * k + w * QK;
        float *dws = dw + base * nb + w, *seconds = second + base * nb + w;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *block = row + b * bytes;
            int16_t *wide = tile_w + b * nw * QK;
            uint16_t h[2];
            memcpy(h, block, sizeof h);
            float d = _cvtsh_ss(h[0]);
            dws[b * nw] = d;
            if (g->type == TYPE_Q8_0) {
                seconds[b * nw] = 0.0f;
                __m128i lo = _mm_loadu_si128((const __m128i *)(block + 2));
                __m128i hi = _mm_loadu_si128((const __m128i *)(block + 18));
                _mm256_storeu_si256((__m256i *)wide, _mm256_cvtepi8_epi16(lo));
                _mm256_storeu_si256((__m256i *)(wide + 16), _mm256_cvtepi8_epi16(hi));
            } else {
                seconds[b * nw] = g->type == TYPE_Q4_1 ? _cvtsh_ss(h[1]) : -8.0f * d;
                const uint8_t *qs = block + (g->type == TYPE_Q4_1 ? 4 : 2);
                __m256i bytes16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
                _mm256_storeu_si256((__m256i *)wide, _mm256_and_si256(bytes16, _mm256_set1_epi16(0x0f)));
                _mm256_storeu_si256((__m256i *)(wide + 16), _mm256_srli_epi16(bytes16, 4));
            }
        }
    }
}

/* out[groups][NW_VNNI][LANES] = the NW_VNNI weight rows of a packed tile against the row
 * groups [group, group + groups) (1 or 2): each pair of k values is loaded for 16 rows of
 * each group once, and every weight row's pair, broadcast from memory once, multiplies them
 * all. Two groups halve the broadcasts per multiply, which bound the one-group tile on CPUs
 * that issue two vpdpwssd a cycle but load only two values. The sums go to `out` block by
 * block (no registers are left for them). */
TARGET_VNNI static inline __attribute__((always_inline)) void tile_vnni(const igemm *g, const int16_t *w16,
                                                                       const float *dw, const float *second,
                                                                       int64_t group, const int groups, float *out,
                                                                       const int with_second) {
    int64_t nb = g->nb, stride = nb * 16 * LANES;
    const int32_t *xp = g->xp + group * stride, *wp = (const int32_t *)w16;
    const float *dxp = g->dxp + group * nb * 2 * LANES;
    for (int i = 0; i < groups * NW_VNNI; i++) _mm512_storeu_ps(out + i * LANES, _mm512_setzero_ps());
    for (int64_t b = 0; b < nb; b++, xp += 16 * LANES, dxp += 2 * LANES, wp += 16 * NW_VNNI) {
        __m512i dot[2][NW_VNNI];
        for (int h = 0; h < groups; h++)
            for (int w = 0; w < NW_VNNI; w++) dot[h][w] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            __m512i xv[2];
            for (int h = 0; h < groups; h++) xv[h] = _mm512_loadu_si512(xp + h * stride + j * LANES);
            for (int w = 0; w < NW_VNNI; w++) {
                __m512i pair = _mm512_set1_epi32(wp[w * 16 + j]);
                for (int h = 0; h < groups; h++) dot[h][w] = _mm512_dpwssd_epi32(dot[h][w], xv[h], pair);
            }
        }
        for (int h = 0; h < groups; h++) {
            const float *d = dxp + h * nb * 2 * LANES;
            __m512 dx = _mm512_loadu_ps(d), dxs = _mm512_loadu_ps(d + LANES);
            for (int w = 0; w < NW_VNNI; w++) {
                float *o = out + (h * NW_VNNI + w) * LANES;
                __m512 scale = _mm512_mul_ps(dx, _mm512_set1_ps(dw[b * NW_VNNI + w]));
                __m512 acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[h][w]), scale, _mm512_loadu_ps(o));
                if (with_second) acc = _mm512_fmadd_ps(dxs, _mm512_set1_ps(second[b * NW_VNNI + w]), acc);
                _mm512_storeu_ps(o, acc);
            }
        }
    }
}

/* out[NW_AVX2][LANES] = the NW_AVX2 weight rows of a packed tile against row group `group`,
 * as tile_vnni's with 8 rows to a vector: each weight row's pair, broadcast from memory,
 * meets the group's two vectors in a vpmaddwd each, added to the row's sums (the same
 * exact int32 sums as vpdpwssd: no pair of int16 products saturates). */
TARGET_AVX2 static inline __attribute__((always_inline)) void tile_avx2(const igemm *g, const int16_t *w16,
                                                                       const float *dw, const float *second,
                                                                       int64_t group, float *out,
                                                                       const int with_second) {
    int64_t nb = g->nb;
    const int32_t *xp = g->xp + group * nb * 16 * LANES, *wp = (const int32_t *)w16;
    const float *dxp = g->dxp + group * nb * 2 * LANES;
    for (int i = 0; i < 2 * NW_AVX2; i++) _mm256_storeu_ps(out + i * 8, _mm256_setzero_ps());
    for (int64_t b = 0; b < nb; b++, xp += 16 * LANES, dxp += 2 * LANES, wp += 16 * NW_AVX2) {
        __m256i dot[NW_AVX2][2];
        for (int w = 0; w < NW_AVX2; w++) dot[w][0] = dot[w][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(xp + j * LANES));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(xp + j * LANES + 8));
            for (int w = 0; w < NW_AVX2; w++) {
                __m256i pair = _mm256_set1_epi32(wp[w * 16 + j]);
                dot[w][0] = _mm256_add_epi32(dot[w][0], _mm256_madd_epi16(x0, pair));
                dot[w][1] = _mm256_add_epi32(dot[w][1], _mm256_madd_epi16(x1, pair));
                /* keep each sum one chain in its register: without this GCC regroups the
                 * adds of a block into trees of products and spills them to the stack */
                __asm__("" : "+x"(dot[w][0]), "+x"(dot[w][1]));
            }
        }
        for (int h = 0; h < 2; h++) {
            __m256 dx = _mm256_loadu_ps(dxp + h * 8), dxs = _mm256_loadu_ps(dxp + LANES + h * 8);
            for (int w = 0; w < NW_AVX2; w++) {
                float *o = out + w * LANES + h * 8;
                __m256 scale = _mm256_mul_ps(dx, _mm256_set1_ps(dw[b * NW_AVX2 + w]));
                __m256 acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[w][h]), scale, _mm256_loadu_ps(o));
                if (with_second) acc = _mm256_fmadd_ps(dxs, _mm256_set1_ps(second[b * NW_AVX2 + w]), acc);
                _mm256_storeu_ps(o, acc);
            }
        }
    }
}

/* y's columns [j0, j0 + cols) of row groups [group, group + groups) from a tile's sums
 * out[groups][nw][LANES], plus the bias. */
static void store_tile(const igemm *g, const float *out, int64_t group, int groups, int64_t j0, int64_t cols) {
    for (int h = 0; h < groups; h++) {
        int64_t first = (group + h) * LANES, lanes = min64(LANES, g->rows - first);
        for (int64_t lane = 0; lane < lanes; lane++) {
            float *y = g->y + (first + lane) * g->n + j0;
            for (int64_t w = 0; w < cols; w++)
                y[w] = out[(h * g->nw + w) * LANES + lane] + (g->bias != NULL ? g->bias[j0 + w] : 0.0f);
        }
    }
}

/* The panel at weight row j0 against row groups [g0, g1), two groups at a time. */
TARGET_VNNI static void multiply_panel_vnni(const igemm *g, int64_t j0, int64_t g0, int64_t g1, const int16_t *w16,
                                            const float *dw, const float *second) {
    int64_t nb = g->nb, cols = min64(PANEL, g->n - j0);
    for (int64_t group = g0; group < g1; group += 2) {
        int groups = g1 - group >= 2 ? 2 : 1;
        for (int64_t c = 0; c < cols; c += NW_VNNI) {
            float out[2 * NW_VNNI * LANES];
            const int16_t *w = w16 + c * g->k;
            const float *d = dw + c * nb, *sec = second + c * nb;
            if (g->type == TYPE_Q8_0 && groups == 2) tile_vnni(g, w, d, sec, group, 2, out, 0);
            else if (g->type == TYPE_Q8_0) tile_vnni(g, w, d, sec, group, 1, out, 0);
            else if (groups == 2) tile_vnni(g, w, d, sec, group, 2, out, 1);
            else tile_vnni(g, w, d, sec, group, 1, out, 1);
            store_tile(g, out, group, groups, j0 + c, min64(NW_VNNI, cols - c));
        }
    }
}

/* The panel at weight row j0 against row groups [g0, g1), one group at a time. */
TARGET_AVX2 static void multiply_panel_avx2(const igemm *g, int64_t j0, int64_t g0, int64_t g1, const int16_t *w16,
                                            const float *dw, const float *second) {
    int64_t nb = g->nb, cols = min64(PANEL, g->n - j0);
    for (int64_t group = g0; group < g1; group++)
        for (int64_t c = 0; c < cols; c += NW_AVX2) {
            float out[NW_AVX2 * LANES];
            const int16_t *w = w16 + c * g->k;
            const float *d = dw + c * nb, *sec = second + c * nb;
            if (g->type == TYPE_Q8_0) tile_avx2(g, w, d, sec, group, out, 0);
            else tile_avx2(g, w, d, sec, group, out, 1);
            store_tile(g, out, group, 1, j0 + c, min64(NW_AVX2, cols - c));
        }
}

/* Tasks [first, end) of the call: each a panel, widened into the thread's scratch, against
 * its part of the row groups. */
static void panel_tasks(const void *ctx, int64_t first, int64_t end, int thread) {
    const igemm *g = ctx;
    int16_t *w16 = (int16_t *)(g->scratch + g->share * (size_t)thread);
    float *dw = (float *)(w16 + PANEL * g->k), *second = dw + PANEL * g->nb;
    for (int64_t task = first; task < end; task++) {
        int64_t panel = task / g->parts, part = task % g->parts;
        int64_t g0 = g->groups * part / g->parts, g1 = g->groups * (part + 1) / g->parts;
        pack_panel(g, panel * PANEL, w16, dw, second);
        if (g->isa == ISA_AVX512VNNI) multiply_panel_vnni(g, panel * PANEL, g0, g1, w16, dw, second);
        else multiply_panel_avx2(g, panel * PANEL, g0, g1, w16, dw, second);
    }
}

/* Row groups [first, end), packed (through the thread's scratch). */
static void pack_tasks(const void *ctx, int64_t first, int64_t end, int thread) {
    const igemm *g = ctx;
    for (int64_t group = first; group < end; group++)
        pack_group(g, g->x, group, g->scratch + g->share * (size_t)thread);
}
#endif

/* y[rows, n] = x[rows, k] @ W^T (+ bias), W n rows of Q8_0 / Q4_0 / Q4_1 blocks, on `isa`
 * (ISA_AVX2 or ISA_AVX512VNNI). Returns 1 when the scratch memory cannot be had, 2 for a
 * K format, another ISA, or one this CPU (or build) lacks. */
int spruce_quant_igemm(int64_t type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows,
                       const float *bias, float *y, int64_t isa) {
#if defined(__x86_64__)
    if ((isa != ISA_AVX2 && isa != ISA_AVX512VNNI) || isa > spruce_quant_best_isa() || is_k_type(type)) return 2;
    int64_t nb = k / QK, groups = (rows + LANES - 1) / LANES;
    int threads = task_threads();
    size_t xp_bytes = (size_t)(groups * nb * 16 * LANES) * sizeof(int32_t);
    size_t front = xp_bytes + (size_t)(groups * nb * 2 * LANES) * sizeof(float);
    /* per thread: a packed panel, and a row group's qx, dx, sx on the way to packing */
    size_t panel_bytes = (size_t)(PANEL * k) * sizeof(int16_t) + (size_t)(2 * PANEL * nb) * sizeof(float);
    size_t rows_bytes = (size_t)(LANES * k) * sizeof(int16_t) + (size_t)(2 * LANES * nb) * sizeof(float);
    size_t share = (max_size(panel_bytes, rows_bytes) + 63) / 64 * 64;
    front = (front + 63) / 64 * 64;
    char *memory = aligned_alloc(64, front + share * (size_t)threads);
    if (memory == NULL) return 1;
    int64_t panels = (n + PANEL - 1) / PANEL, parts = 1;
    while (parts < groups && panels * parts < 4 * threads) parts++;
    igemm g = {type, n, k, nb, rows, groups, row_bytes(type, k), parts, isa, isa == ISA_AVX2 ? NW_AVX2 : NW_VNNI,
               w, bias, y, (const int32_t *)memory, (const float *)(memory + xp_bytes), x, memory + front, share};
    share_tasks(groups, 1, threads, pack_tasks, &g);
    share_tasks(panels * parts, 1, threads, panel_tasks, &g);
    free(memory);
    return 0;
#else
    (void)type, (void)w, (void)n, (void)k, (void)x, (void)rows, (void)bias, (void)y, (void)isa;
    return 2;
#endif
}
