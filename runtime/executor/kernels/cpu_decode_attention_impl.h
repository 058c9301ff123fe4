/* The cache-reading half of the CPU decode attention, generic over the K/V element type:
 * included by cpu_decode_attention.c once per CACHE_T (float, _Float16, int8_t), with NAME(x)
 * giving each copy its own function names and LOAD_CACHE widening AL elements to floats.
 * CACHE_SCALED (int8): each (slot, kv head) row of K and V has its own float scale,
 * k_scale / v_scale [S, KH]; a K row's scale multiplies its scores, a V row's its weights. */

/* The `group` (<= MAX_PASS) query heads that share one kv head attend over the request's
 * tokens [from, to) (a span, staged in L2 by the caller), continuing their online softmax:
 * running references m_in[g], per-lane sums l_in[g] and the accumulators, which wait in `out` (the
 * heads' rows, unnormalized: the caller divides once the last span is done). k and v point at
 * that kv head's part of slot 0's row (ks, vs at its scales, KH apart per slot); q and out
 * at the first of the heads.
 * Always inlined, so with constant group and chunks the tiles are constants, the loops
 * unroll and the tiles live in registers (see the file's header for the phases). */
static inline __attribute__((always_inline)) void NAME(attend_kv_head)(
    const float *q, const CACHE_T *k, const CACHE_T *v, const float *ks, const float *vs, const int32_t *slots,
    int64_t from, int64_t to, int64_t row_len, int64_t kv_heads, float *m_in, avec *l_in, float *out, float scale,
    const int64_t group, const int64_t chunks) {
    const int64_t dim = chunks * AL, T = score_tile(group), VC = value_tile(group, chunks);
    avec qs[MAX_PASS][MAX_CHUNKS], acc[MAX_PASS][MAX_CHUNKS], dots[MAX_PASS][BLOCK], l[MAX_PASS];
    float m[MAX_PASS], p[MAX_PASS][BLOCK];
    for (int64_t g = 0; g < group; g++) {
        m[g] = m_in[g], l[g] = l_in[g];
        for (int64_t c = 0; c < chunks; c++) {
            qs[g][c] = aload(q + g * dim + c * AL) * scale;
            acc[g][c] = aload(out + g * dim + c * AL);
        }
    }
    for (int64_t start = from; start < to; start += BLOCK) {
        int64_t n = to - start < BLOCK ? to - start : BLOCK;
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
        m_in[g] = m[g], l_in[g] = l[g];
        for (int64_t c = 0; c < chunks; c++) astore(out + g * dim + c * AL, acc[g][c]);
    }
}

/* Shapes of common models (group, head_dim) get their own unrolled copy; any other shape
 * runs the same code with run-time tiles and loop bounds. The portable variant (a fallback,
 * whose vectors the compiler splits into pieces, slowly) keeps the run-time bounds only. */
#if !defined(SPRUCE_GENERIC_SHAPES)
#define SPECIALIZED(G, D)                                                                     \
    static void NAME(CAT(CAT(attend, G), D))(const float *q, const CACHE_T *k, const CACHE_T *v, \
                                             const float *ks, const float *vs,                  \
                                             const int32_t *slots, int64_t from, int64_t to,    \
                                             int64_t row_len, int64_t kv_heads, float *m,       \
                                             avec *l, float *out, float scale) {                \
        NAME(attend_kv_head)(q, k, v, ks, vs, slots, from, to, row_len, kv_heads, m, l, out, scale, G, D / AL); \
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

/* Reads tokens [0, n)'s K/V rows (`part` elements of each, from k and v; and an int8
 * cache's scales) into L2: one load per cache line, none depending on another, so the core
 * has as many misses in flight as it can track (see the file's header, "staging"). */
static void NAME(stage_rows)(const CACHE_T *k, const CACHE_T *v, const float *ks, const float *vs,
                             const int32_t *slots, int64_t n, int64_t row_len, int64_t part, int64_t kv_heads) {
    /* bytes, not elements: widening a half float to an integer costs two conversions */
    const int64_t bytes = part * (int64_t)sizeof(CACHE_T);
    uint32_t sink = 0;
    for (int64_t j = 0; j < n; j++) {
        const volatile uint8_t *kr = (const uint8_t *)(k + (int64_t)slots[j] * row_len);
        const volatile uint8_t *vr = (const uint8_t *)(v + (int64_t)slots[j] * row_len);
        for (int64_t c = 0; c < bytes; c += 64) sink += kr[c] + vr[c];
        if (bytes % 64 != 0) sink += kr[bytes - 1] + vr[bytes - 1]; /* a row across a line's end */
        if (ks != NULL) sink += ((const volatile uint32_t *)ks)[slots[j] * kv_heads] + ((const volatile uint32_t *)vs)[slots[j] * kv_heads];
    }
    __asm__ volatile("" ::"r"(sink));
}

/* The query heads of kv heads [h0, h1) of one request attend over its tokens, `span` at a
 * time (as many as fit in half the core's L2; a multiple of BLOCK): each span's rows (those
 * kv heads' part) are staged, then every kv head's pass reads its part from L2. */
static void NAME(attend)(const float *q, const CACHE_T *k_cache, const CACHE_T *v_cache, const float *k_scale,
                         const float *v_scale, const int32_t *slots, int64_t seq_len, float *out, int64_t heads,
                         int64_t kv_heads, int64_t dim, float scale, int64_t span, int64_t h0, int64_t h1) {
    int64_t group = heads / kv_heads, row_len = kv_heads * dim;
    float m[heads];
    avec l[heads];
    for (int64_t i = h0 * group; i < h1 * group; i++) m[i] = -INFINITY, l[i] = (avec){0};
    memset(out + h0 * group * dim, 0, (size_t)((h1 - h0) * group * dim) * sizeof(float));
    for (int64_t from = 0; from < seq_len; from += span) {
        int64_t to = seq_len - from < span ? seq_len : from + span;
        NAME(stage_rows)(k_cache + h0 * dim, v_cache + h0 * dim, k_scale ? k_scale + h0 : NULL,
                         v_scale ? v_scale + h0 : NULL, slots + from, to - from, row_len, (h1 - h0) * dim, kv_heads);
        for (int64_t h = h0; h < h1; h++) {
            const float *qh = q + h * group * dim;
            float *oh = out + h * group * dim, *mh = m + h * group;
            avec *lh = l + h * group;
            const CACHE_T *k = k_cache + h * dim, *v = v_cache + h * dim;
            const float *ks = k_scale ? k_scale + h : NULL, *vs = v_scale ? v_scale + h : NULL;
#if !defined(SPRUCE_GENERIC_SHAPES)
#define CASE(G, D)                                                                                    \
    if (group == G && dim == D) {                                                                     \
        NAME(CAT(CAT(attend, G), D))(qh, k, v, ks, vs, slots, from, to, row_len, kv_heads, mh, lh, oh, scale); \
        continue;                                                                                     \
    }
            CASE(1, 64) CASE(3, 64) CASE(4, 64) CASE(7, 64) CASE(3, 128) CASE(4, 128) CASE(6, 128) CASE(7, 128)
#undef CASE
#endif
            for (int64_t g = 0; g < group; g += MAX_PASS) { /* larger groups: several passes */
                int64_t heads_here = group - g < MAX_PASS ? group - g : MAX_PASS;
                NAME(attend_kv_head)(qh + g * dim, k, v, ks, vs, slots, from, to, row_len, kv_heads, mh + g, lh + g,
                                     oh + g * dim, scale, heads_here, dim / AL);
            }
        }
    }
    for (int64_t i = h0 * group; i < h1 * group; i++) { /* the accumulators over the softmax's sums */
        float total = asum_lanes(l[i]);
        float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t c = 0; c < dim; c += AL) astore(out + i * dim + c, aload(out + i * dim + c) * inv);
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

/* One call's arguments, for its tasks. */
typedef struct {
    const float *q, *k_new, *v_new;
    int64_t q_stride, new_stride;
    const int64_t *new_slots, *rows, *seq_lens;
    CACHE_T *k_cache, *v_cache;
    float *k_scale, *v_scale, *out;
    const int32_t *req_to_token;
    int64_t table_stride, heads, kv_heads, dim, window, span, parts;
    float scale;
} NAME(call);

/* Item `item`'s request b and its kv heads [*h0, *h1): a request, or one kv head of one
 * (c->parts of them). */
static inline int64_t NAME(item)(const NAME(call) *c, int64_t item, int64_t *h0, int64_t *h1) {
    int64_t parts = c->parts;
    *h0 = parts == 1 ? 0 : item % parts, *h1 = parts == 1 ? c->kv_heads : *h0 + 1;
    return item / parts;
}

/* Items [first, end): their new K/V into the cache. */
static void NAME(store_items)(const void *ctx, int64_t first, int64_t end, int thread) {
    const NAME(call) *c = ctx;
    int64_t kv_heads = c->kv_heads, dim = c->dim, h0, h1;
    (void)thread;
    for (int64_t item = first; item < end; item++) {
        int64_t b = NAME(item)(c, item, &h0, &h1);
        int64_t at = c->new_slots[b] * kv_heads * dim + h0 * dim, scale_at = c->new_slots[b] * kv_heads + h0;
        const float *k_new = c->k_new + b * c->new_stride + h0 * dim, *v_new = c->v_new + b * c->new_stride + h0 * dim;
        NAME(store)(c->k_cache + at, c->k_scale ? c->k_scale + scale_at : NULL, k_new, h1 - h0, dim);
        NAME(store)(c->v_cache + at, c->v_scale ? c->v_scale + scale_at : NULL, v_new, h1 - h0, dim);
    }
}

/* Items [first, end): their attention. */
static void NAME(attend_items)(const void *ctx, int64_t first, int64_t end, int thread) {
    const NAME(call) *c = ctx;
    int64_t dim = c->dim, h0, h1;
    (void)thread;
    for (int64_t item = first; item < end; item++) {
        int64_t b = NAME(item)(c, item, &h0, &h1);
        /* a sliding window reads only the last `window` tokens: the tail of the row */
        int64_t len = c->seq_lens[b], from = c->window > 0 && len > c->window ? len - c->window : 0;
        NAME(attend)(c->q + b * c->q_stride, c->k_cache, c->v_cache, c->k_scale, c->v_scale,
                     c->req_to_token + c->rows[b] * c->table_stride + from, len - from, c->out + b * c->heads * dim,
                     c->heads, c->kv_heads, dim, c->scale, c->span, h0, h1);
    }
}

int PER_ISA(NAME(spruce_decode_attention))(const float *q, int64_t q_stride, const float *k_new, const float *v_new,
                                int64_t new_stride, const int64_t *new_slots, CACHE_T *k_cache,
                                CACHE_T *v_cache, float *k_scale, float *v_scale, const int32_t *req_to_token, int64_t table_stride,
                                const int64_t *rows, const int64_t *seq_lens, float *out, int64_t batch,
                                int64_t heads, int64_t kv_heads, int64_t dim, float scale, int64_t window) {
    if (heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP || dim % 16 != 0 || dim > MAX_DIM) return 1;
    if (CACHE_SCALED && (k_scale == NULL || v_scale == NULL)) return 1;
    /* tokens per span: their K and V rows in half the L2 */
    int64_t span = l2_bytes() / 2 / (2 * kv_heads * dim * (int64_t)sizeof(CACHE_T)) / BLOCK * BLOCK;
    /* Items: whole requests, or with fewer requests than threads each request's kv heads
     * one by one (their query heads, and the new token's K/V of those heads, are theirs alone). */
    int threads = task_threads();
    int64_t parts = batch < threads ? kv_heads : 1;
    NAME(call) c = {q, k_new, v_new, q_stride, new_stride, new_slots, rows, seq_lens, k_cache, v_cache, k_scale,
                    v_scale, out, req_to_token, table_stride, heads, kv_heads, dim, window, span < BLOCK ? BLOCK : span,
                    parts, scale};
    /* every new K/V first (rows of one request, drafts, read the ones before them), on this
     * thread: a row's store is a few hundred values, less than a parallel region costs */
    if (new_slots != NULL) NAME(store_items)(&c, 0, batch * parts, 0);
    share_tasks(batch * parts, 1, threads, NAME(attend_items), &c);
    return 0;
}
