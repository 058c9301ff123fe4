/* Vector helpers shared by the float CPU kernels: 16-float vectors as GCC vector
 * extensions (lowered to the instruction set the file is compiled for), lane reductions, a
 * vector exp, and float16 widening.
 *
 * The float kernels are compiled once per instruction set (cpu_library.py: portable, AVX2,
 * AVX-512) with -DSPRUCE_ISA=<name>; PER_ISA(f) names each copy's exported functions
 * f_<name>, and the loader binds the variant the CPU runs. */
#ifndef SPRUCE_CPU_VECTOR_H
#define SPRUCE_CPU_VECTOR_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#ifndef SPRUCE_ISA
#define SPRUCE_ISA portable
#endif
#define ISA_CAT_(a, b) a##_##b
#define ISA_CAT(a, b) ISA_CAT_(a, b)
#define PER_ISA(name) ISA_CAT(name, SPRUCE_ISA)

#define LANES 16

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef float vec_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

static inline vec load(const float *p) { return *(const vec_unaligned *)p; }
static inline vec splat(float x) { return (vec){0} + x; }

/* a > b ? a : b per lane. With instructions: GCC lowers a comparison of vectors wider than
 * the registers (16 floats on AVX2) lane by lane, with scalar compares, which made SiLU over
 * a decode batch slow. */
static inline vec max2(vec a, vec b) {
#if defined(__AVX512F__)
    __m512 x, y;
    memcpy(&x, &a, sizeof x), memcpy(&y, &b, sizeof y);
    x = _mm512_max_ps(x, y);
    memcpy(&a, &x, sizeof a);
    return a;
#elif defined(__AVX__)
    __m256 x[2], y[2];
    memcpy(x, &a, sizeof x), memcpy(y, &b, sizeof y);
    x[0] = _mm256_max_ps(x[0], y[0]), x[1] = _mm256_max_ps(x[1], y[1]);
    memcpy(&a, x, sizeof a);
    return a;
#else
    ivec a_wins = a > b;
    return (vec)(((ivec)a & a_wins) | ((ivec)b & ~a_wins));
#endif
}

#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)

static inline float max_lanes(vec v) {
    v = max2(v, SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = max2(v, SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = max2(v, SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = max2(v, SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

static inline float sum_lanes(vec v) {
    v += SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

/* exp(x) for x <= 0 to about 2e-7 relative error, on whole vectors: 2^t = 2^round(t) * 2^f
 * with f in [-0.5, 0.5] by a degree-6 polynomial; round() by adding and removing 1.5 * 2^23
 * (valid without -ffast-math, which would fold it away). x is clamped to >= -87; positive x
 * up to 88 come out right too (the 2^round(t) factor is added to the exponent). Defined for
 * a vector type V (int vector IV, lane max MAX, broadcast SPLAT), so that a kernel with its
 * own vector width gets the same function. */
#define DEFINE_VECTOR_EXP(NAME, V, IV, MAX, SPLAT)                                  \
    static inline V NAME(V x) {                                                     \
        x = MAX(x, SPLAT(-87.0f));                                                  \
        V t = x * 1.4426950408889634f;                                              \
        V whole = (t + 12582912.0f) - 12582912.0f;                                  \
        V f = t - whole;                                                            \
        V p = SPLAT(1.535336188319500e-4f);                                         \
        p = p * f + 1.339887440266574e-3f;                                          \
        p = p * f + 9.618437357674640e-3f;                                          \
        p = p * f + 5.550332471162809e-2f;                                          \
        p = p * f + 2.402264791363012e-1f;                                          \
        p = p * f + 6.931472028550421e-1f;                                          \
        p = p * f + 1.0f;                                                           \
        return (V)((IV)p + (__builtin_convertvector(whole, IV) << 23));             \
    }
DEFINE_VECTOR_EXP(exp_nonpositive, vec, ivec, max2, splat)

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

#endif
