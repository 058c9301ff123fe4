/* Decode attention on the CPU, reading K/V straight from the token-slot pool.
 *
 * For each request b, all its query heads attend over the request's seq_len tokens, whose
 * slots are req_to_token[rows[b], 0..seq_len); query head h reads kv head h / G (GQA).
 * Keys are processed in blocks of 16 with an online softmax, so each K and V row (all kv
 * heads, contiguous) is read from memory once and nothing is gathered into a temporary.
 * A block's 16 scores of one head fill one vector: the 16 dot products are summed by a
 * transpose-and-add tree (15 shuffle pairs instead of 16 horizontal sums), and the softmax
 * update (max, exp, sum) runs on whole vectors.
 * When given the step's new K/V, each request first stores its own token's K/V into its
 * slot (converted to the cache type), so one call replaces the pool write and the
 * attention; the new token is the last of its context, so only its own thread reads it.
 * Requests are spread over OpenMP threads: loaded into a process that runs torch, the
 * kernel shares torch's libgomp thread pool (same SONAME), so the two never fight over
 * the cores.
 *
 * With window W > 0 (sliding-window layers), request b reads only its last W tokens:
 * slots req_to_token[rows[b], seq_len - W .. seq_len).
 *
 * Layouts: q [B, H, D] with row stride q_stride; k_new, v_new [B, KH, D] with row stride
 * new_stride; out [B, H, D] contiguous; k_cache, v_cache [S, KH, D]; req_to_token int32
 * [R, table_stride]; rows, seq_lens, new_slots int64 [B].
 * Vectors are GCC vector extensions (16 floats), lowered to the instruction set this copy is
 * compiled for (cpu_vector.h: one copy per instruction set, picked at load).
 */
#include "cpu_vector.h"

#define BLOCK LANES /* tokens per block: one score vector per head */
#define MAX_GROUP 64 /* query heads per kv head */
#define MAX_CHUNKS 16 /* head_dim up to 256 */

/* d[j] holds token j's 16 partial dot products; returns the vector whose lane j is token
 * j's full sum. Each level halves the partials per token and doubles the tokens per vector. */
static inline vec transpose_sum(const vec d[BLOCK]) {
    vec a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) {
        vec x = d[2 * i], y = d[2 * i + 1];
        a[i] = SHUFFLE(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 4; i++) {
        vec x = a[2 * i], y = a[2 * i + 1];
        b[i] = SHUFFLE(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUFFLE(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
    for (int i = 0; i < 2; i++) {
        vec x = b[2 * i], y = b[2 * i + 1];
        c[i] = SHUFFLE(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUFFLE(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    }
    return SHUFFLE(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Folds one block's scores `s` of one head (lanes >= n unused) into its online softmax:
 * running max *m, per-lane sum *l and accumulator acc[0..chunks); the block's weights go
 * to p[0..BLOCK). */
static inline void softmax_update(vec s, int64_t n, float *m, vec *l, float *p, vec *acc, int64_t chunks) {
    ivec live = (ivec){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} < (int32_t)n;
    s = (vec)(((ivec)s & live) | ((ivec)splat(-INFINITY) & ~live));
    float block_max = max_lanes(s);
    float new_max = block_max > *m ? block_max : *m;
    vec correction = exp_nonpositive(splat(*m - new_max));
    *m = new_max;
    vec weights = (vec)((ivec)exp_nonpositive(s - new_max) & live);
    memcpy(p, &weights, sizeof weights);
    *l = *l * correction + weights;
    for (int64_t c = 0; c < chunks; c++) acc[c] *= correction;
}

/* out[0..chunks) = acc / (sum of the lanes of l). */
static inline void finish_head(float *out, const vec *acc, vec l, int64_t chunks) {
    float total = sum_lanes(l);
    float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t c = 0; c < chunks; c++) {
        vec o = acc[c] * inv;
        memcpy(out + c * LANES, &o, sizeof o);
    }
}

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define NAME(x) CAT(x, SUFFIX)

#define CACHE_T float
#define LOAD_CACHE load
#define SUFFIX f32
#include "cpu_decode_attention_impl.h"
#undef CACHE_T
#undef LOAD_CACHE
#undef SUFFIX

#define CACHE_T _Float16
#define LOAD_CACHE load_half
#define SUFFIX f16
#include "cpu_decode_attention_impl.h"
