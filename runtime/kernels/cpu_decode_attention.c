/* Decode attention on the CPU, reading K/V straight from the token-slot pool.
 *
 * For each request b, all its query heads attend over the request's seq_len tokens, whose
 * slots are req_to_token[rows[b], 0..seq_len); query head h reads kv head h / G (GQA).
 * Keys are processed in blocks with an online softmax, so each K and V row (all kv heads,
 * contiguous) is read exactly once and nothing is gathered into a temporary buffer.
 * Requests [first, last) are handled by one call and spread over OpenMP threads: loaded into a process
 * that runs torch, the kernel shares torch's libgomp thread pool (same SONAME), so the
 * two never fight over the cores.
 *
 * Layouts (all contiguous): q, out [B, H, D]; k_cache, v_cache [S, KH, D];
 * req_to_token int32 [R, table_stride]; rows, seq_lens int64 [B].
 * Vectors are GCC vector extensions (16 floats), lowered to whatever the CPU has.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define LANES 16
#define BLOCK 32
#define MAX_HEADS 64
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

/* The attention state of one request: every query head's query, accumulator and running
 * softmax statistics, and the current block's scores / weights. */
struct head_state {
    vec q[MAX_HEADS][MAX_CHUNKS];
    vec acc[MAX_HEADS][MAX_CHUNKS];
    float m[MAX_HEADS], l[MAX_HEADS];
    float p[MAX_HEADS][BLOCK];
};

static void softmax_update(struct head_state *st, int64_t n, int64_t heads, int64_t chunks) {
    for (int64_t g = 0; g < heads; g++) {
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

/* Half-precision caches: half the memory traffic, widened to float in registers (with the
 * F16C instructions; GCC's generic vector conversion goes element by element). */
static inline vec load_half(const _Float16 *p) {
#if defined(__AVX512F__)
    __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    vec out;
    memcpy(&out, &wide, sizeof out);
    return out;
#elif defined(__F16C__)
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    vec out;
    memcpy(&out, &lo, sizeof lo);
    memcpy((char *)&out + sizeof lo, &hi, sizeof hi);
    return out;
#else
    vec out;
    for (int i = 0; i < LANES; i++) out[i] = (float)p[i];
    return out;
#endif
}

#define CACHE_T _Float16
#define LOAD_CACHE load_half
#define SUFFIX f16
#include "cpu_decode_attention_impl.h"
