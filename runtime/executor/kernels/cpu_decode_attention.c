/* Decode attention on the CPU, reading K/V straight from the token-slot pool.
 *
 * For each request b, all its query heads attend over the request's seq_len tokens, whose
 * slots are req_to_token[rows[b], 0..seq_len); query head h reads kv head h / G (GQA).
 * Keys are processed in blocks of BLOCK tokens with an online softmax, so each K and V
 * element is read from memory once and nothing is gathered into a temporary. The `group`
 * query heads of one kv head are one pass (up to MAX_PASS heads; a larger group takes
 * several), so each K/V load serves them all.
 *
 * Vector width: `avec` of AL floats, one register of the instruction set
 * (cpu_register_vector.h: 8 on AVX2, 16 on AVX-512 and the portable build). A block is 16
 * tokens: one head's scores of a block fill SCORE_VECS vectors (2 on AVX2).
 *
 * Registers decide the speed. Keeping every head's q and accumulator and a whole block's
 * dot products live at once (with 16-float vectors, two ymm each on AVX2) asks for far more
 * than the 16 ymm registers, and the spills then cost more than the arithmetic. So each
 * phase of a block works on a register tile that fits (TILE_REGS, 15 ymm on AVX2):
 *   scores: T tokens at a time (score_tile), for each AL-float chunk of the head dimension
 *     each token's K chunk is loaded (widened) once and multiplied into the G x T dot
 *     accumulators; q (pre-multiplied by `scale`) is read from an L1 copy as an FMA memory
 *     operand. The accumulators go to dots[g][token]; a transpose-and-add tree then turns a
 *     head's AL dot vectors into one vector of AL scores (AL - 1 adds, 2 (AL - 1) shuffles
 *     instead of AL horizontal sums).
 *   softmax: per head, on whole vectors (compare, exp, per-lane sum); gives the block's
 *     weights p[g][token]. Its reference max moves only when a score passes it by
 *     RESCALE_SLACK (softmax_update), so past the first block the accumulators are rarely
 *     rescaled and no block needs a max reduction.
 *   values: VC chunks of the head dimension at a time (value_tile), the G x VC accumulator
 *     tile is loaded from an L1 array and every token's V chunks (widened once) are
 *     multiplied by the broadcast weights of the G heads; then stored back.
 * Tokens past the end of the last block read token 0's row (valid memory) and are masked out
 * of the softmax (weight 0), so the tiles keep constant shapes.
 * GCC needs two nudges to keep the tiles in registers (both checked in the assembly):
 * IN_REGISTER on each loaded K/V chunk (otherwise, with a float cache, it re-reads the chunk
 * as a memory operand per head and holds q in registers instead, spilling the tile), and no
 * unrolling of the value phase's token loop (unrolled, it keeps a block's weights in
 * registers and spills the accumulators).
 * Spans and staging: a request's tokens go in spans of as many as fit in half the core's L2;
 * each span's K/V rows are first read once (staged), one plain load per cache line and none
 * depending on another, so the core keeps as many misses in flight as it can track; then
 * every kv head's pass finds its part of the span's rows in L2, and the online softmax goes
 * on from span to span (its state, the accumulators in `out`, divided once at the end).
 * Passes that ran over all the tokens asking for the rows with prefetches a few blocks ahead
 * of their arithmetic read main memory at a fraction of what the machine streams, since the
 * misses then wait on the arithmetic between them; staged, no load waits on arithmetic.
 * Tried and not kept: prefetching the next layer's rows during the GEMMs before it (spread
 * between their tiles: it slowed the GEMMs by as much as it saved); other prefetch distances
 * and locality hints; contiguous slots against decode tokens a batch apart (no difference,
 * so the pool's allocation order does not matter).
 * When given the step's new K/V, the call first stores every row's K/V into its slot
 * (converted to the cache type), then attends, so one call replaces the pool write and the
 * attention, also for rows of one request (speculative drafts: each reads the ones before).
 * Requests are spread over the threads (cpu_parallel.h), and with fewer requests than
 * threads each request's kv heads (batch 1 at 2 threads: SmolLM2's 3 kv heads go 2 + 1
 * instead of all on one thread while the other waits). Loaded into a process that runs
 * torch, the kernel shares torch's libgomp thread pool (same SONAME), so the two never
 * fight over the cores.
 *
 * With window W > 0 (sliding-window layers), request b reads only its last W tokens:
 * slots req_to_token[rows[b], seq_len - W .. seq_len).
 *
 * Layouts: q [B, H, D] with row stride q_stride; k_new, v_new [B, KH, D] with row stride
 * new_stride; out [B, H, D] contiguous; k_cache, v_cache [S, KH, D]; k_scale, v_scale
 * float32 [S, KH] (the int8 cache's; NULL for the float ones); req_to_token int32
 * [R, table_stride]; rows, seq_lens, new_slots int64 [B]. D must be a multiple of 16 (on
 * every variant, so they all accept the same shapes), at most MAX_DIM.
 */
#include <unistd.h>

#include "cpu_parallel.h"
#include "cpu_register_vector.h"

#if AL == 8
#define TILE_REGS 15 /* of 16 ymm */
#else
#define TILE_REGS 28 /* of 32 zmm (the portable build splits its vectors anyway) */
#endif

#define BLOCK 16 /* tokens per block */
#define SCORE_VECS (BLOCK / AL) /* a head's scores of one block */
#define RESCALE_SLACK 8.0f /* see softmax_update */
#define MAX_GROUP 64 /* query heads per kv head */
#define MAX_PASS 16 /* query heads per pass over the K/V: larger groups take several */
#define MAX_DIM 256
#define MAX_CHUNKS (MAX_DIM / AL)
#define MAX_TILE 32 /* accumulators in a register tile */

/* x, loaded into a register once: keeps GCC from re-reading a float cache chunk as the memory
 * operand of each head's FMA and holding the heads' q chunks in registers instead (which
 * spilled the accumulator tile). */
#if defined(__x86_64__) && AL == 8
#define IN_REGISTER(x) ({ avec in_register_ = (x); __asm__("" : "+x"(in_register_)); in_register_; })
#else
#define IN_REGISTER(x) (x)
#endif

/* AL half floats widened (F16C / AVX-512 instructions; GCC's generic vector conversion goes
 * element by element). */
static inline avec aload_half(const _Float16 *p) {
    avec out;
#if AL == 16 && defined(__AVX512F__)
    __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&out, &wide, sizeof out);
#elif AL == 8 && defined(__F16C__)
    __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(&out, &wide, sizeof out);
#else
    for (int i = 0; i < AL; i++) out[i] = (float)p[i];
#endif
    return out;
}

/* AL int8s widened (sign-extended to 32 bits, then converted). */
static inline avec aload_int8(const int8_t *p) {
    avec out;
#if AL == 16 && defined(__AVX512F__)
    __m512 wide = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&out, &wide, sizeof out);
#elif AL == 8 && defined(__AVX2__)
    __m256 wide = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    memcpy(&out, &wide, sizeof out);
#else
    for (int i = 0; i < AL; i++) out[i] = (float)p[i];
#endif
    return out;
}

/* d[j] holds token j's AL partial dot products; returns the vector whose lane j is token j's
 * full sum. Each level halves the partials per token and doubles the tokens per vector; the
 * pairing (token j with token j + AL/2 first) leaves the lanes in token order. */
static inline avec transpose_sum(const avec d[AL]) {
#if AL == 8
    /* level 1 within 128-bit lanes (two tokens' partials per 128-bit half), level 2 the same
     * on pairs, the last level crosses the 128-bit halves once. The tokens pair as (0, 1),
     * (4, 5), (2, 3), (6, 7), (0-1, 2-3), (4-5, 6-7), which leaves the lanes in token order. */
    avec a[4], b[2];
    for (int i = 0; i < 4; i++) {
        avec x = d[(i & 1) * 4 + (i >> 1) * 2], y = d[(i & 1) * 4 + (i >> 1) * 2 + 1];
        a[i] = SHUFFLE(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
    }
    /* a[i] = [x0+x2, x1+x3, y0+y2, y1+y3 | x4+x6, x5+x7, y4+y6, y5+y7] */
    for (int i = 0; i < 2; i++) {
        avec x = a[i], y = a[i + 2];
        b[i] = SHUFFLE(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
    }
    /* b[0] = tokens 0, 1, 2, 3's sums over lanes 0-3 | the same over lanes 4-7; b[1] tokens 4-7 */
    return SHUFFLE(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
#else
    avec a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) {
        avec x = d[2 * i], y = d[2 * i + 1];
        a[i] = SHUFFLE(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 4; i++) {
        avec x = a[2 * i], y = a[2 * i + 1];
        b[i] = SHUFFLE(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUFFLE(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
    for (int i = 0; i < 2; i++) {
        avec x = b[2 * i], y = b[2 * i + 1];
        c[i] = SHUFFLE(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUFFLE(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    }
    return SHUFFLE(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#endif
}

/* Whether any lane of the mask is set. */
static inline int any_lane(aivec mask) {
#if AL == 8 && defined(__AVX__)
    __m256 bits;
    memcpy(&bits, &mask, sizeof bits);
    return _mm256_movemask_ps(bits) != 0;
#elif AL == 16 && defined(__AVX512F__)
    __m512i bits;
    memcpy(&bits, &mask, sizeof bits);
    return _mm512_test_epi32_mask(bits, bits) != 0;
#else
    int32_t any = 0;
    for (int i = 0; i < AL; i++) any |= mask[i];
    return any != 0;
#endif
}

/* Folds one block's scores of one head, s[0..SCORE_VECS) (token i * AL + lane; tokens >= n
 * unused), into its online softmax: running reference *m, per-lane sum *l and accumulator
 * acc[0..chunks); the block's weights go to p[0..BLOCK) (0 past n).
 * The reference moves (and l and acc are rescaled) only when a score exceeds it by more than
 * RESCALE_SLACK, so weights stay below e^RESCALE_SLACK and the result, a ratio, is the same;
 * past the first block that is rare, and a block costs a compare instead of a max
 * reduction, an exp and a multiply of the accumulator. */
static inline void softmax_update(avec *s, int64_t n, float *m, avec *l, float *p, avec *acc, int64_t chunks) {
    aivec live[SCORE_VECS];
    for (int i = 0; i < SCORE_VECS; i++) {
        live[i] = lane_index() + i * AL < (int32_t)n;
        if (n < BLOCK) s[i] = aselect(live[i], s[i], asplat(-INFINITY));
    }
    avec limit = asplat(*m + RESCALE_SLACK);
    aivec over = s[0] > limit;
    for (int i = 1; i < SCORE_VECS; i++) over |= s[i] > limit;
    if (any_lane(over)) {
        avec top = s[0];
        for (int i = 1; i < SCORE_VECS; i++) top = amax2(top, s[i]);
        float new_max = amax_lanes(top);
        float c = expf(*m - new_max); /* 0 on the first block (m = -inf) */
        *m = new_max;
        *l *= c;
        for (int64_t j = 0; j < chunks; j++) acc[j] *= c;
    }
    for (int i = 0; i < SCORE_VECS; i++) {
        avec w = aexp(s[i] - *m);
        if (n < BLOCK) w = (avec)((aivec)w & live[i]);
        astore(p + i * AL, w);
        *l += w;
    }
}

/* Tokens per score tile: G x T accumulators and the K chunk in the registers (q is an FMA
 * memory operand), T a power of two <= BLOCK. */
static inline int64_t score_tile(int64_t group) {
    int64_t t = BLOCK;
    while (t > 1 && group * t + 1 > TILE_REGS) t /= 2;
    return t;
}

/* Head-dimension chunks per value tile: G x VC accumulators, G broadcast weights and the V
 * chunk in the registers, VC a power of two dividing `chunks`. */
static inline int64_t value_tile(int64_t group, int64_t chunks) {
    int64_t vc = 8;
    while (vc > 1 && (group * vc + group + 1 > TILE_REGS || chunks % vc != 0)) vc /= 2;
    return vc;
}

/* The core's L2 in bytes (glibc's sysconf, asked once: in a VM it may trap to the host; 512 KB
 * where it does not say). */
static int64_t l2_bytes(void) {
    static int64_t known = 0;
    int64_t bytes = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (bytes > 0) return bytes;
#if defined(_SC_LEVEL2_CACHE_SIZE)
    bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    if (bytes <= 0) bytes = 512 * 1024;
    __atomic_store_n(&known, bytes, __ATOMIC_RELAXED);
    return bytes;
}

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define NAME(x) CAT(x, SUFFIX)

#define CACHE_SCALED 0
#define CACHE_T float
#define LOAD_CACHE aload
#define SUFFIX f32
#include "cpu_decode_attention_impl.h"
#undef CACHE_T
#undef LOAD_CACHE
#undef SUFFIX

#define CACHE_T _Float16
#define LOAD_CACHE aload_half
#define SUFFIX f16
#include "cpu_decode_attention_impl.h"
#undef CACHE_T
#undef LOAD_CACHE
#undef SUFFIX
#undef CACHE_SCALED

#define CACHE_SCALED 1
#define CACHE_T int8_t
#define LOAD_CACHE aload_int8
#define SUFFIX i8
#include "cpu_decode_attention_impl.h"
