/* Decode attention on the CPU, reading K/V straight from the token-slot pool.
 *
 * For each request b and kv head h, the G query heads that share h attend over the
 * request's seq_len tokens, whose slots are req_to_token[rows[b], 0..seq_len). Keys are
 * processed in blocks with an online softmax, so each K and V row is read exactly once
 * and nothing is gathered into a temporary buffer. Requests [first, last) are handled by
 * one call, so callers can split a batch across threads (the call holds no global state).
 *
 * Layouts (all contiguous): q, out [B, H, D]; k_cache, v_cache [S, KH, D];
 * req_to_token int32 [R, table_stride]; rows, seq_lens int64 [B].
 * Vectors are GCC vector extensions (16 floats), lowered to whatever the CPU has.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define BLOCK 32
#define MAX_GROUP 16
#define MAX_CHUNKS 16 /* head_dim up to 256 */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

static inline vec load(const float *p) { return *(const vec_unaligned *)p; }

typedef float half_vec __attribute__((vector_size(LANES / 2 * sizeof(float))));
typedef float quarter_vec __attribute__((vector_size(LANES / 4 * sizeof(float))));

/* Tree sum of the lanes (a chain of scalar adds would serialize on add latency). */
static inline float sum_lanes(vec v) {
    half_vec lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    half_vec h = lo + hi;
    quarter_vec a, b;
    memcpy(&a, &h, sizeof a);
    memcpy(&b, (const char *)&h + sizeof a, sizeof b);
    quarter_vec s = a + b;
    return (s[0] + s[1]) + (s[2] + s[3]);
}

/* exp(x) for x <= 0 to about 2e-7 relative error, as plain arithmetic so that loops over
 * it vectorize (libm's expf is one call per element). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.4426950408889634f;
    float whole = floorf(t);
    float f = t - whole;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)whole << 23;
    memcpy(&p, &bits, sizeof bits);
    return p;
}

struct head_state {
    vec q[MAX_GROUP][MAX_CHUNKS];
    vec acc[MAX_GROUP][MAX_CHUNKS];
    float m[MAX_GROUP], l[MAX_GROUP];
    float p[MAX_GROUP][BLOCK];
};

static void scores(struct head_state *st, const float *const *keys, int64_t n, int64_t group,
                   int64_t chunks, float scale) {
    for (int64_t j = 0; j < n; j++) {
        vec k[MAX_CHUNKS];
        for (int64_t c = 0; c < chunks; c++) k[c] = load(keys[j] + c * LANES);
        for (int64_t g = 0; g < group; g++) {
            vec dot = st->q[g][0] * k[0];
            for (int64_t c = 1; c < chunks; c++) dot += st->q[g][c] * k[c];
            st->p[g][j] = sum_lanes(dot) * scale;
        }
    }
}

static void softmax_update(struct head_state *st, int64_t n, int64_t group, int64_t chunks) {
    for (int64_t g = 0; g < group; g++) {
        float block_max = st->m[g];
        for (int64_t j = 0; j < n; j++) block_max = st->p[g][j] > block_max ? st->p[g][j] : block_max;
        float correction = st->m[g] == -INFINITY ? 0.0f : exp_nonpositive(st->m[g] - block_max);
        st->m[g] = block_max;
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            float e = exp_nonpositive(st->p[g][j] - block_max);
            st->p[g][j] = e;
            sum += e;
        }
        st->l[g] = st->l[g] * correction + sum;
        for (int64_t c = 0; c < chunks; c++) st->acc[g][c] *= correction;
    }
}

/* One accumulator at a time stays in a register over the block; the block's V rows
 * (BLOCK x dim floats) stay in L1 across the repeated loads. */
static void accumulate(struct head_state *st, const float *const *values, int64_t n,
                       int64_t group, int64_t chunks) {
    for (int64_t g = 0; g < group; g++) {
        for (int64_t c = 0; c < chunks; c++) {
            vec a = st->acc[g][c];
            for (int64_t j = 0; j < n; j++) a += st->p[g][j] * load(values[j] + c * LANES);
            st->acc[g][c] = a;
        }
    }
}

static void attend(const float *q, const float *k_cache, const float *v_cache,
                   const int32_t *slots, int64_t seq_len, float *out, int64_t kv_heads,
                   int64_t kv_head, int64_t group, int64_t dim, float scale) {
    struct head_state st;
    int64_t chunks = dim / LANES;
    for (int64_t g = 0; g < group; g++) {
        st.m[g] = -INFINITY;
        st.l[g] = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            st.q[g][c] = load(q + g * dim + c * LANES);
            st.acc[g][c] = (vec){0};
        }
    }
    const float *keys[BLOCK], *values[BLOCK];
    for (int64_t start = 0; start < seq_len; start += BLOCK) {
        int64_t n = seq_len - start < BLOCK ? seq_len - start : BLOCK;
        for (int64_t j = 0; j < n; j++) {
            int64_t row = ((int64_t)slots[start + j] * kv_heads + kv_head) * dim;
            keys[j] = k_cache + row;
            values[j] = v_cache + row;
        }
        scores(&st, keys, n, group, chunks, scale);
        softmax_update(&st, n, group, chunks);
        accumulate(&st, values, n, group, chunks);
    }
    for (int64_t g = 0; g < group; g++) {
        float inv = st.l[g] > 0.0f ? 1.0f / st.l[g] : 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            vec o = st.acc[g][c] * inv;
            memcpy(out + g * dim + c * LANES, &o, sizeof o);
        }
    }
}

int spruce_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                const int32_t *req_to_token, int64_t table_stride,
                                const int64_t *rows, const int64_t *seq_lens, float *out,
                                int64_t first, int64_t last, int64_t heads, int64_t kv_heads,
                                int64_t dim, float scale) {
    int64_t group = heads / kv_heads;
    if (heads % kv_heads != 0 || group > MAX_GROUP || dim % LANES != 0 || dim / LANES > MAX_CHUNKS)
        return 1;
    for (int64_t b = first; b < last; b++) {
        const int32_t *slots = req_to_token + rows[b] * table_stride;
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t offset = (b * heads + h * group) * dim;
            attend(q + offset, k_cache, v_cache, slots, seq_lens[b], out + offset, kv_heads, h,
                   group, dim, scale);
        }
    }
    return 0;
}
