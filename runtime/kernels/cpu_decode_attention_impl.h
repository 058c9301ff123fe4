/* The cache-reading half of the CPU decode attention, generic over the K/V element type:
 * included by cpu_decode_attention.c once per CACHE_T (float, _Float16), with NAME(x)
 * giving each copy its own function names and LOAD_CACHE widening 16 elements to floats. */

/* Scores of the block's tokens for every query head; `rows[j]` is token j's K row, all kv
 * heads contiguous, so the row is consumed in order. */
static void NAME(scores)(struct head_state *st, const CACHE_T *const *rows, int64_t n, int64_t heads,
                   int64_t group, int64_t chunks, float scale) {
    for (int64_t j = 0; j < n; j++) {
        for (int64_t h = 0; h < heads; h++) {
            const CACHE_T *k = rows[j] + (h / group) * chunks * LANES;
            vec dot = st->q[h][0] * LOAD_CACHE(k);
            for (int64_t c = 1; c < chunks; c++) dot += st->q[h][c] * LOAD_CACHE(k + c * LANES);
            st->p[h][j] = sum_lanes(dot) * scale;
        }
    }
}

/* One accumulator at a time stays in a register over the block; the block's V rows stay
 * in L1 across the repeated loads. */
static void NAME(accumulate)(struct head_state *st, const CACHE_T *const *rows, int64_t n, int64_t heads,
                       int64_t group, int64_t chunks) {
    for (int64_t h = 0; h < heads; h++) {
        int64_t offset = (h / group) * chunks * LANES;
        for (int64_t c = 0; c < chunks; c++) {
            vec a = st->acc[h][c];
            for (int64_t j = 0; j < n; j++) a += st->p[h][j] * LOAD_CACHE(rows[j] + offset + c * LANES);
            st->acc[h][c] = a;
        }
    }
}

/* Asks for the next block's K/V rows while this block computes (slots are scattered). */
static void NAME(prefetch_block)(const CACHE_T *k_cache, const CACHE_T *v_cache, const int32_t *slots,
                           int64_t start, int64_t seq_len, int64_t row_len) {
    int64_t end = seq_len < start + BLOCK ? seq_len : start + BLOCK;
    for (int64_t j = start; j < end; j++) {
        int64_t row = (int64_t)slots[j] * row_len;
        for (int64_t c = 0; c < row_len; c += 64 / (int64_t)sizeof(CACHE_T)) { /* one cache line */
            __builtin_prefetch(k_cache + row + c);
            __builtin_prefetch(v_cache + row + c);
        }
    }
}

static void NAME(attend)(const float *q, const CACHE_T *k_cache, const CACHE_T *v_cache,
                   const int32_t *slots, int64_t seq_len, float *out, int64_t heads,
                   int64_t kv_heads, int64_t dim, float scale) {
    struct head_state st;
    int64_t chunks = dim / LANES, group = heads / kv_heads, row_len = kv_heads * dim;
    for (int64_t h = 0; h < heads; h++) {
        st.m[h] = -INFINITY;
        st.l[h] = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            st.q[h][c] = load(q + h * dim + c * LANES);
            st.acc[h][c] = (vec){0};
        }
    }
    const CACHE_T *keys[BLOCK], *values[BLOCK];
    for (int64_t start = 0; start < seq_len; start += BLOCK) {
        int64_t n = seq_len - start < BLOCK ? seq_len - start : BLOCK;
        for (int64_t j = 0; j < n; j++) {
            int64_t row = (int64_t)slots[start + j] * row_len;
            keys[j] = k_cache + row;
            values[j] = v_cache + row;
        }
        NAME(prefetch_block)(k_cache, v_cache, slots, start + BLOCK, seq_len, row_len);
        NAME(scores)(&st, keys, n, heads, group, chunks, scale);
        softmax_update(&st, n, heads, chunks);
        NAME(accumulate)(&st, values, n, heads, group, chunks);
    }
    for (int64_t h = 0; h < heads; h++) {
        float inv = st.l[h] > 0.0f ? 1.0f / st.l[h] : 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            vec o = st.acc[h][c] * inv;
            memcpy(out + h * dim + c * LANES, &o, sizeof o);
        }
    }
}

int NAME(spruce_decode_attention)(const float *q, const CACHE_T *k_cache, const CACHE_T *v_cache,
                                const int32_t *req_to_token, int64_t table_stride,
                                const int64_t *rows, const int64_t *seq_lens, float *out,
                                int64_t first, int64_t last, int64_t heads, int64_t kv_heads,
                                int64_t dim, float scale) {
    if (heads % kv_heads != 0 || heads > MAX_HEADS || dim % LANES != 0 || dim / LANES > MAX_CHUNKS)
        return 1;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t b = first; b < last; b++) {
        int64_t offset = b * heads * dim;
        NAME(attend)(q + offset, k_cache, v_cache, req_to_token + rows[b] * table_stride, seq_lens[b],
               out + offset, heads, kv_heads, dim, scale);
    }
    return 0;
}
