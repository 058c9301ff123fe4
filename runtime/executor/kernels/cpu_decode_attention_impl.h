/* The cache-reading half of the CPU decode attention, generic over the K/V element type:
 * included by cpu_decode_attention.c once per CACHE_T (float, _Float16), with NAME(x)
 * giving each copy its own function names and LOAD_CACHE widening 16 elements to floats. */

/* Asks for the kv head's part of a block's K/V rows one block ahead of use (slots are
 * scattered, so the hardware prefetcher cannot guess them), into L2. */
static inline void NAME(prefetch_block)(const CACHE_T *k, const CACHE_T *v, const int32_t *slots,
                                        int64_t start, int64_t seq_len, int64_t row_len, int64_t dim) {
    int64_t end = seq_len < start + BLOCK ? seq_len : start + BLOCK;
    for (int64_t j = start; j < end; j++) {
        int64_t row = (int64_t)slots[j] * row_len;
        for (int64_t c = 0; c < dim; c += 64 / (int64_t)sizeof(CACHE_T)) { /* one cache line */
            __builtin_prefetch(k + row + c, 0, 2);
            __builtin_prefetch(v + row + c, 0, 2);
        }
    }
}

/* The `group` query heads that share one kv head attend over the request's tokens. k and
 * v point at that kv head's part of slot 0's row; q and out at the first of the heads.
 * Per block of 16 tokens each K and V chunk is loaded once for all the heads, and the
 * heads' dot products and accumulators form independent chains. Always inlined, so with
 * constant group and chunks the loops unroll and the state lives in registers. */
static inline __attribute__((always_inline)) void NAME(attend_kv_head)(
    const float *q, const CACHE_T *k, const CACHE_T *v, const int32_t *slots, int64_t seq_len,
    int64_t row_len, float *out, float scale, const int64_t group, const int64_t chunks) {
    vec qv[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS], l[MAX_GROUP];
    vec dots[MAX_GROUP][BLOCK];
    float m[MAX_GROUP], p[MAX_GROUP][BLOCK];
    int64_t dim = chunks * LANES;
    for (int64_t g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = (vec){0};
        for (int64_t c = 0; c < chunks; c++) {
            qv[g][c] = load(q + g * dim + c * LANES);
            acc[g][c] = (vec){0};
        }
    }
    NAME(prefetch_block)(k, v, slots, 0, seq_len, row_len, dim);
    for (int64_t start = 0; start < seq_len; start += BLOCK) {
        int64_t n = seq_len - start < BLOCK ? seq_len - start : BLOCK;
        const CACHE_T *krow[BLOCK], *vrow[BLOCK];
        for (int64_t j = 0; j < n; j++) {
            int64_t row = (int64_t)slots[start + j] * row_len;
            krow[j] = k + row;
            vrow[j] = v + row;
        }
        NAME(prefetch_block)(k, v, slots, start + BLOCK, seq_len, row_len, dim);
        for (int64_t j = 0; j < n; j++) {
            vec kc[MAX_CHUNKS];
            for (int64_t c = 0; c < chunks; c++) kc[c] = LOAD_CACHE(krow[j] + c * LANES);
            for (int64_t g = 0; g < group; g++) {
                vec d = qv[g][0] * kc[0];
                for (int64_t c = 1; c < chunks; c++) d += qv[g][c] * kc[c];
                dots[g][j] = d;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            for (int64_t j = n; j < BLOCK; j++) dots[g][j] = (vec){0};
            softmax_update(transpose_sum(dots[g]) * scale, n, &m[g], &l[g], p[g], acc[g], chunks);
        }
        for (int64_t j = 0; j < n; j++) {
            vec vc[MAX_CHUNKS];
            for (int64_t c = 0; c < chunks; c++) vc[c] = LOAD_CACHE(vrow[j] + c * LANES);
            for (int64_t g = 0; g < group; g++)
                for (int64_t c = 0; c < chunks; c++) acc[g][c] += p[g][j] * vc[c];
        }
    }
    for (int64_t g = 0; g < group; g++) finish_head(out + g * dim, acc[g], l[g], chunks);
}

/* Shapes of common models get their own unrolled copy; any other shape runs the same code
 * with run-time loop bounds. The portable variant (a fallback, whose 16-float vectors the
 * compiler splits into pieces, slowly) keeps the run-time bounds only. */
#if !defined(SPRUCE_GENERIC_SHAPES)
#define SPECIALIZED(G, C)                                                                     \
    static void NAME(CAT(CAT(attend, G), C))(const float *q, const CACHE_T *k, const CACHE_T *v, \
                                             const int32_t *slots, int64_t seq_len,             \
                                             int64_t row_len, float *out, float scale) {        \
        NAME(attend_kv_head)(q, k, v, slots, seq_len, row_len, out, scale, G, C);             \
    }
SPECIALIZED(1, 4)
SPECIALIZED(3, 4)
SPECIALIZED(4, 4)
SPECIALIZED(7, 4)
SPECIALIZED(3, 8)
SPECIALIZED(4, 8)
SPECIALIZED(6, 8)
SPECIALIZED(7, 8)
#undef SPECIALIZED
#endif

static void NAME(attend)(const float *q, const CACHE_T *k_cache, const CACHE_T *v_cache,
                         const int32_t *slots, int64_t seq_len, float *out, int64_t heads,
                         int64_t kv_heads, int64_t dim, float scale) {
    int64_t group = heads / kv_heads, chunks = dim / LANES, row_len = kv_heads * dim;
    for (int64_t h = 0; h < kv_heads; h++) {
        const float *qh = q + h * group * dim;
        float *oh = out + h * group * dim;
        const CACHE_T *k = k_cache + h * dim, *v = v_cache + h * dim;
#if !defined(SPRUCE_GENERIC_SHAPES)
#define CASE(G, C)                                                                     \
    if (group == G && chunks == C) {                                                   \
        NAME(CAT(CAT(attend, G), C))(qh, k, v, slots, seq_len, row_len, oh, scale);     \
        continue;                                                                      \
    }
        CASE(1, 4) CASE(3, 4) CASE(4, 4) CASE(7, 4) CASE(3, 8) CASE(4, 8) CASE(6, 8) CASE(7, 8)
#undef CASE
#endif
        NAME(attend_kv_head)(qh, k, v, slots, seq_len, row_len, oh, scale, group, chunks);
    }
}

static void NAME(store)(CACHE_T *cache, const float *row, int64_t n) {
    for (int64_t i = 0; i < n; i++) cache[i] = (CACHE_T)row[i];
}

int PER_ISA(NAME(spruce_decode_attention))(const float *q, int64_t q_stride, const float *k_new, const float *v_new,
                                int64_t new_stride, const int64_t *new_slots, CACHE_T *k_cache,
                                CACHE_T *v_cache, const int32_t *req_to_token, int64_t table_stride,
                                const int64_t *rows, const int64_t *seq_lens, float *out, int64_t batch,
                                int64_t heads, int64_t kv_heads, int64_t dim, float scale, int64_t window) {
    if (heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP || dim % LANES != 0 || dim / LANES > MAX_CHUNKS)
        return 1;
    int64_t row_len = kv_heads * dim;
#pragma omp parallel for schedule(dynamic, 1) if (batch > 1) /* one request: no thread wake-up */
    for (int64_t b = 0; b < batch; b++) {
        if (new_slots != NULL) {
            NAME(store)(k_cache + new_slots[b] * row_len, k_new + b * new_stride, row_len);
            NAME(store)(v_cache + new_slots[b] * row_len, v_new + b * new_stride, row_len);
        }
        /* a sliding window reads only the last `window` tokens: the tail of the row */
        int64_t first = window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0;
        NAME(attend)(q + b * q_stride, k_cache, v_cache, req_to_token + rows[b] * table_stride + first,
               seq_lens[b] - first, out + b * heads * dim, heads, kv_heads, dim, scale);
    }
    return 0;
}
