/* One register of floats for the attention kernels (cpu_decode_attention.c,
 * cpu_prefill_attention.c): `avec` of AL floats, 8 on AVX2 (one ymm), 16 on AVX-512 (one
 * zmm); the portable build keeps 16 (a fallback, so it runs and tests the 16-lane code the
 * AVX-512 copy compiles). cpu_vector.h's 16-float `vec` is two registers on AVX2, and
 * kernels that keep tiles of them in registers spilled. Loads, broadcasts, lane select,
 * butterfly reductions over the lanes, and exp on this width. */
#ifndef SPRUCE_CPU_REGISTER_VECTOR_H
#define SPRUCE_CPU_REGISTER_VECTOR_H

#include "cpu_vector.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
#define AL 8
#else
#define AL 16
#endif

typedef float avec __attribute__((vector_size(AL * sizeof(float))));
typedef int32_t aivec __attribute__((vector_size(AL * sizeof(int32_t))));
typedef float avec_unaligned __attribute__((vector_size(AL * sizeof(float)), aligned(4)));

static inline avec aload(const float *p) { return *(const avec_unaligned *)p; }
static inline avec asplat(float x) { return x - (avec){0}; } /* (x - 0 is x, unlike x + 0: one broadcast) */
static inline void astore(float *p, avec x) { memcpy(p, &x, sizeof x); }

static inline avec aselect(aivec mask, avec a, avec b) { return (avec)(((aivec)a & mask) | ((aivec)b & ~mask)); }
static inline avec amax2(avec a, avec b) { return aselect(a > b, a, b); }

static inline aivec lane_index(void) {
#if AL == 8
    return (aivec){0, 1, 2, 3, 4, 5, 6, 7};
#else
    return (aivec){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#endif
}

/* Reductions over the lanes: a butterfly of half-swaps, every lane ends with the result. */
#if AL == 8
#define SWAP_HALVES(v) SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3)
#define SWAP_QUARTERS(v) SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5)
#define SWAP_PAIRS(v) SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6)
#define BUTTERFLY(v, op) (v = op(v, SWAP_HALVES(v)), v = op(v, SWAP_QUARTERS(v)), v = op(v, SWAP_PAIRS(v)))
#else
#define SWAP_HALVES(v) SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
#define SWAP_QUARTERS(v) SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)
#define SWAP_EIGHTHS(v) SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
#define SWAP_PAIRS(v) SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)
#define BUTTERFLY(v, op)                                                                     \
    (v = op(v, SWAP_HALVES(v)), v = op(v, SWAP_QUARTERS(v)), v = op(v, SWAP_EIGHTHS(v)),     \
     v = op(v, SWAP_PAIRS(v)))
#endif
static inline avec add2(avec a, avec b) { return a + b; }
static inline float amax_lanes(avec v) { return BUTTERFLY(v, amax2), v[0]; }
static inline float asum_lanes(avec v) { return BUTTERFLY(v, add2), v[0]; }

/* exp(x) on this vector width (cpu_vector.h). */
DEFINE_VECTOR_EXP(aexp, avec, aivec, amax2, asplat)

#endif
