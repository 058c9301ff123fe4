/* The cache-reading half of the CPU decode attention, generic over the K/V element type:
 * included by cpu_decode_attention.c once per CACHE_T (float, _Float16, int8_t), with NAME(x)
 * giving each copy its own function names and LOAD_CACHE widening AL elements to floats.
 * CACHE_SCALED (int8): each (slot, kv head) row of K and V has its own float scale,
 * k_scale / v_scale [S, KH]; a K row's scale multiplies its scores, a V row's its weights. */

/* Asks for `len` elements of the K/V rows of tokens [from, to) (clipped to seq_len), from k
 * and v on, into L2 (slots are scattered, so the hardware prefetcher cannot guess them). */
static inline void NAME(prefetch_rows)(const CACHE_T *k, const CACHE_T *v, const int32_t *slots, int64_t from,
                                       int64_t to, int64_t seq_len, int64_t row_len, int64_t len) {
    if (to > seq_len) to = seq_len;
    for (int64_t j = from; j < to; j++) {
        int64_t row = (int64_t)slots[j] * row_len;
        for (int64_t c = 0; c < len; c += 64 / (int64_t)sizeof(CACHE_T)) { /* one cache line */
            __builtin_prefetch(k + row + c, 0, 2);
            __builtin_prefetch(v + row + c, 0, 2);
        }
    }
}

/* The `group` (<= MAX_PASS) query heads that share one kv head attend over the request's tokens. k and
 * v point at that kv head's part of slot 0's row (ks, vs at its scales, KH apart per slot);
 * q and out at the first of the heads. The rows are prefetched from `head_offset` elements
 * before k on, `prefetch_len` elements each: the first kv head's pass asks for whole rows
 * (the later heads' parts then wait in L2: ~15% faster at batch 64 from main memory than
 * each pass asking for its own part), the others for nothing.
 * Always inlined, so with constant group and chunks the tiles are constants, the loops
 * unroll and the tiles live in registers (see the file's header for the phases). */
static inline __attribute__((always_inline)) void NAME(attend_kv_head)(
    const float *q, const CACHE_T *k, const CACHE_T *v, const float *ks, const float *vs, const int32_t *slots,
    int64_t seq_len, int64_t row_len, int64_t kv_heads, int64_t head_offset, int64_t prefetch_len, float *out,
    float scale, const int64_t group, const int64_t chunks) {
    const int64_t dim = chunks * AL, T = score_tile(group), VC = value_tile(group, chunks);
    avec qs[MAX_PASS][MAX_CHUNKS], acc[MAX_PASS][MAX_CHUNKS], dots[MAX_PASS][BLOCK], l[MAX_PASS];
    float m[MAX_PASS], p[MAX_PASS][BLOCK];
    for (int64_t g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = (avec){0};
        for (int64_t c = 0; c < chunks; c++) {
            qs[g][c] = aload(q + g * dim + c * AL) * scale;
            acc[g][c] = (avec){0};
        }
    }
    const CACHE_T *k_rows = k - head_offset, *v_rows = v - head_offset;
    NAME(prefetch_rows)(k_rows, v_rows, slots, 0, PREFETCH_AHEAD, seq_len, row_len, prefetch_len);
    for (int64_t start = 0; start < seq_len; start += BLOCK) {
        int64_t n = seq_len - start < BLOCK ? seq_len - start : BLOCK;
        const CACHE_T *krow[BLOCK], *vrow[BLOCK];
#if CACHE_SCALED
        float kscale[BLOCK], vscale[BLOCK];
#endif
        for (int64_t j = 0; j < BLOCK; j++) { /* past n: token 0's row, weight 0 */
            int64_t slot = slots[start + (j < n ? j : 0)], row = slot * row_len;
            krow[j] = k + row;
            vrow[j] = v + row;
#if CACHE_SCALED
            kscale[j] = ks[slot * kv_heads];
            vscale[j] = vs[slot * kv_heads];
#endif
        }
        NAME(prefetch_rows)(k_rows, v_rows, slots, start + PREFETCH_AHEAD, start + PREFETCH_AHEAD + BLOCK, seq_len,
                            row_len, prefetch_len);
        /* scores: G x T dot products at a time, each K chunk loaded once */
        for (int64_t j0 = 0; j0 < BLOCK; j0 += T) {
            avec d[MAX_TILE];
#pragma GCC unroll 32
            for (int64_t i = 0; i < group * T; i++) d[i] = (avec){0};
            if (j0 < n) {
                for (int64_t c = 0; c < chunks; c++) {
#pragma GCC unroll 8
                    for (int64_t t = 0; t < T; t++) {
                        avec kc = IN_REGISTER(LOAD_CACHE(krow[j0 + t] + c * AL));
#pragma GCC unroll 16
                        for (int64_t g = 0; g < group; g++) d[g * T + t] += qs[g][c] * kc;
                    }
                }
            }
#pragma GCC unroll 16
            for (int64_t g = 0; g < group; g++)
#pragma GCC unroll 8
                for (int64_t t = 0; t < T; t++) dots[g][j0 + t] = d[g * T + t];
        }
        for (int64_t g = 0; g < group; g++) {
            avec s[SCORE_VECS];
            for (int i = 0; i < SCORE_VECS; i++) s[i] = transpose_sum(dots[g] + i * AL);
#if CACHE_SCALED
            for (int i = 0; i < SCORE_VECS; i++) s[i] *= aload(kscale + i * AL);
#endif
            softmax_update(s, n, &m[g], &l[g], p[g], acc[g], chunks);
#if CACHE_SCALED /* the weights of V's integers (the softmax's sum took the plain weights) */
            for (int i = 0; i < SCORE_VECS; i++) astore(p[g] + i * AL, aload(p[g] + i * AL) * aload(vscale + i * AL));
#endif
        }
        /* values: G x VC accumulators at a time, each V chunk loaded once */
        for (int64_t c0 = 0; c0 < chunks; c0 += VC) {
            avec a[MAX_TILE];
#pragma GCC unroll 16
            for (int64_t g = 0; g < group; g++)
#pragma GCC unroll 8
                for (int64_t cc = 0; cc < VC; cc++) a[g * VC + cc] = acc[g][c0 + cc];
#pragma GCC unroll 1 /* unrolled, GCC keeps the weights in registers and spills the tile */
            for (int64_t j = 0; j < BLOCK; j++) { /* weight 0 past n */
                avec w[MAX_TILE];
#pragma GCC unroll 16
                for (int64_t g = 0; g < group; g++) w[g] = asplat(p[g][j]);
#pragma GCC unroll 8
                for (int64_t cc = 0; cc < VC; cc++) {
                    avec vc = IN_REGISTER(LOAD_CACHE(vrow[j] + (c0 + cc) * AL));
#pragma GCC unroll 16
                    for (int64_t g = 0; g < group; g++) a[g * VC + cc] += w[g] * vc;
                }
            }
#pragma GCC unroll 16
            for (int64_t g = 0; g < group; g++)
#pragma GCC unroll 8
                for (int64_t cc = 0; cc < VC; cc++) acc[g][c0 + cc] = a[g * VC + cc];
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float total = asum_lanes(l[g]);
        float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t c = 0; c < chunks; c++) astore(out + g * dim + c * AL, acc[g][c] * inv);
    }
}

/* Shapes of common models (group, head_dim) get their own unrolled copy; any other shape
 * runs the same code with run-time tiles and loop bounds. The portable variant (a fallback,
 * whose vectors the compiler splits into pieces, slowly) keeps the run-time bounds only. */
#if !defined(SPRUCE_GENERIC_SHAPES)
#define SPECIALIZED(G, D)                                                                     \
    static void NAME(CAT(CAT(attend, G), D))(const float *q, const CACHE_T *k, const CACHE_T *v, \
                                             const float *ks, const float *vs,                  \
                                             const int32_t *slots, int64_t seq_len,             \
                                             int64_t row_len, int64_t kv_heads, int64_t offset, \
                                             int64_t prefetch, float *out, float scale) {       \
        NAME(attend_kv_head)(q, k, v, ks, vs, slots, seq_len, row_len, kv_heads, offset, prefetch, out, scale, G, \
                             D / AL);                                                          \
    }
SPECIALIZED(1, 64)
SPECIALIZED(3, 64)
SPECIALIZED(4, 64)
SPECIALIZED(7, 64)
SPECIALIZED(3, 128)
SPECIALIZED(4, 128)
SPECIALIZED(6, 128)
SPECIALIZED(7, 128)
#undef SPECIALIZED
#endif

/* Reads tokens [0, n)'s K/V rows (and an int8 cache's scales) into L2: one load per cache
 * line, none depending on another, so the core has as many misses in flight as it can track
 * (see the file's header, "staging"). */
static void NAME(stage_rows)(const CACHE_T *k, const CACHE_T *v, const float *ks, const float *vs,
                             const int32_t *slots, int64_t n, int64_t row_len, int64_t kv_heads) {
    const int64_t line = 64 / (int64_t)sizeof(CACHE_T), last = row_len - 1; /* last: a row across a line's end */
    uint32_t sink = 0;
    for (int64_t j = 0; j < n; j++) {
        const volatile CACHE_T *kr = k + (int64_t)slots[j] * row_len, *vr = v + (int64_t)slots[j] * row_len;
        for (int64_t c = 0; c < row_len; c += line) sink += (uint32_t)kr[c] + (uint32_t)vr[c];
        sink += (uint32_t)kr[last] + (uint32_t)vr[last];
        if (ks != NULL) sink += ((const volatile uint32_t *)ks)[slots[j] * kv_heads] + ((const volatile uint32_t *)vs)[slots[j] * kv_heads];
    }
    __asm__ volatile("" ::"r"(sink));
}

static void NAME(attend)(const float *q, const CACHE_T *k_cache, const CACHE_T *v_cache, const float *k_scale,
                         const float *v_scale, const int32_t *slots, int64_t seq_len, float *out, int64_t heads,
                         int64_t kv_heads, int64_t dim, float scale, int64_t stage_bytes) {
    int64_t group = heads / kv_heads, row_len = kv_heads * dim;
    int64_t staged = stage_bytes / (2 * row_len * (int64_t)sizeof(CACHE_T));
    if (staged > seq_len) staged = seq_len;
    NAME(stage_rows)(k_cache, v_cache, k_scale, v_scale, slots, staged, row_len, kv_heads);
    for (int64_t h = 0; h < kv_heads; h++) {
        const float *qh = q + h * group * dim;
        float *oh = out + h * group * dim;
        const CACHE_T *k = k_cache + h * dim, *v = v_cache + h * dim;
        const float *ks = k_scale ? k_scale + h : NULL, *vs = v_scale ? v_scale + h : NULL;
        /* past the staged tokens, the first pass prefetches whole rows for all */
        int64_t offset = h * dim, prefetch = h == 0 && staged < seq_len ? row_len : 0;
#if !defined(SPRUCE_GENERIC_SHAPES)
#define CASE(G, D)                                                                     \
    if (group == G && dim == D) {                                                      \
        NAME(CAT(CAT(attend, G), D))(qh, k, v, ks, vs, slots, seq_len, row_len, kv_heads, offset, prefetch, oh, scale); \
        continue;                                                                      \
    }
        CASE(1, 64) CASE(3, 64) CASE(4, 64) CASE(7, 64) CASE(3, 128) CASE(4, 128) CASE(6, 128) CASE(7, 128)
#undef CASE
#endif
        for (int64_t g = 0; g < group; g += MAX_PASS) { /* larger groups: several passes */
            int64_t heads_here = group - g < MAX_PASS ? group - g : MAX_PASS;
            NAME(attend_kv_head)(qh + g * dim, k, v, ks, vs, slots, seq_len, row_len, kv_heads, offset,
                                 g == 0 ? prefetch : 0, oh + g * dim, scale, heads_here, dim / AL);
        }
    }
}

/* One token's K or V (kv_heads rows of dim) into the cache; int8: each row as
 * round(x / s) with s = max |x| / 127 (1 for a zero row), as kv_pool.quantize_int8 does. */
static void NAME(store)(CACHE_T *cache, float *scales, const float *row, int64_t kv_heads, int64_t dim) {
#if CACHE_SCALED
    for (int64_t h = 0; h < kv_heads; h++, row += dim, cache += dim) {
        float amax = 0.0f;
        for (int64_t i = 0; i < dim; i++) amax = fmaxf(amax, fabsf(row[i]));
        float s = amax > 0.0f ? amax / 127.0f : 1.0f;
        scales[h] = s;
        for (int64_t i = 0; i < dim; i++) cache[i] = (int8_t)nearbyintf(row[i] / s);
    }
#else
    (void)scales;
    for (int64_t i = 0; i < kv_heads * dim; i++) cache[i] = (CACHE_T)row[i];
#endif
}

int PER_ISA(NAME(spruce_decode_attention))(const float *q, int64_t q_stride, const float *k_new, const float *v_new,
                                int64_t new_stride, const int64_t *new_slots, CACHE_T *k_cache,
                                CACHE_T *v_cache, float *k_scale, float *v_scale, const int32_t *req_to_token, int64_t table_stride,
                                const int64_t *rows, const int64_t *seq_lens, float *out, int64_t batch,
                                int64_t heads, int64_t kv_heads, int64_t dim, float scale, int64_t window) {
    if (heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP || dim % 16 != 0 || dim > MAX_DIM) return 1;
    if (CACHE_SCALED && (k_scale == NULL || v_scale == NULL)) return 1;
    int64_t row_len = kv_heads * dim, stage_bytes = l2_bytes() / 2;
#pragma omp parallel for schedule(dynamic, 1) if (batch > 1) /* one request: no thread wake-up */
    for (int64_t b = 0; b < batch; b++) {
        if (new_slots != NULL) {
            int64_t slot = new_slots[b];
            NAME(store)(k_cache + slot * row_len, k_scale ? k_scale + slot * kv_heads : NULL, k_new + b * new_stride,
                        kv_heads, dim);
            NAME(store)(v_cache + slot * row_len, v_scale ? v_scale + slot * kv_heads : NULL, v_new + b * new_stride,
                        kv_heads, dim);
        }
        /* a sliding window reads only the last `window` tokens: the tail of the row */
        int64_t first = window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0;
        NAME(attend)(q + b * q_stride, k_cache, v_cache, k_scale, v_scale, req_to_token + rows[b] * table_stride + first,
               seq_lens[b] - first, out + b * heads * dim, heads, kv_heads, dim, scale, stage_bytes);
    }
    return 0;
}
