/* What the quantized-weight kernels share (cpu_quant_ops.c: 32-value block formats and the
 * entry points; cpu_kquant_ops.c: the 256-value "K" formats): block layouts mirroring
 * llama.cpp's C structs, fp16 decoding, the activation rows, and the integer dot products
 * of one 32-value group per instruction set. */
#ifndef SPRUCE_CPU_QUANT_H
#define SPRUCE_CPU_QUANT_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define QK 32 /* activation block: every weight format is read in groups of 32 values */
#define QK_K 256 /* K formats' super-block */
#define MAX_ROWS 4

enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8, TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14 };
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512VNNI = 2 };

typedef struct __attribute__((packed)) { uint16_t d; int8_t qs[QK]; } block_q8_0;
typedef struct __attribute__((packed)) { uint16_t d; uint8_t qs[QK / 2]; } block_q4_0;
typedef struct __attribute__((packed)) { uint16_t d, m; uint8_t qs[QK / 2]; } block_q4_1;
typedef struct __attribute__((packed)) { uint16_t d, dmin; uint8_t scales[12], qs[QK_K / 2]; } block_q4_k;
typedef struct __attribute__((packed)) {
    uint16_t d, dmin;
    uint8_t scales[12], qh[QK_K / 8], qs[QK_K / 2];
} block_q5_k;
typedef struct __attribute__((packed)) {
    uint8_t ql[QK_K / 2], qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    uint16_t d;
} block_q6_k;

static inline int is_k_type(int64_t type) { return type >= TYPE_Q4_K && type <= TYPE_Q6_K; }

/* Bytes per block of `type`; a block holds QK values, or QK_K for the K formats. */
static inline int64_t block_bytes(int64_t type) {
    switch (type) {
    case TYPE_Q8_0: return sizeof(block_q8_0);
    case TYPE_Q4_0: return sizeof(block_q4_0);
    case TYPE_Q4_1: return sizeof(block_q4_1);
    case TYPE_Q4_K: return sizeof(block_q4_k);
    case TYPE_Q5_K: return sizeof(block_q5_k);
    default: return sizeof(block_q6_k);
    }
}

static inline int64_t row_bytes(int64_t type, int64_t k) {
    return k / (is_k_type(type) ? QK_K : QK) * block_bytes(type);
}

/* IEEE half -> float, portable (subnormals included). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {
        float value = (float)mantissa * (1.0f / 16777216.0f); /* 2^-24 */
        return sign ? -value : value;
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* Up to MAX_ROWS activation rows quantized to 16-bit blocks of 32: qx [rows, k] int16,
 * dx (scale) and sx (sum of qx) [rows, k / 32]. */
typedef struct {
    const int16_t *qx;
    const float *dx, *sx;
    int64_t k, rows;
} activations;

typedef void (*row_fn)(int64_t type, const uint8_t *w, const activations *a, float *out);

/* The SIMD kernels' entry points from one body per format family, TYPES(type, w, a, out,
 * stride, WROWS, ROWS), whose weight-row count WROWS and activation-row count ROWS are
 * constants (the accumulators stay in registers). ROW_KERNEL: one weight row against the
 * activation rows, out[m]. TILE4_KERNEL: four weight rows at `stride` bytes against the
 * activation rows, at most TILE_ROWS of them at a time (the registers: 16 ymm on AVX2, 32
 * with AVX-512VL), out[r * MAX_ROWS + m]. DECL is the function's attributes and name. */
#define ROW_KERNEL(DECL, TYPES)                                                                       \
    DECL(int64_t type, const uint8_t *w, const activations *a, float *out) {                          \
        switch (a->rows) {                                                                            \
        case 1: TYPES(type, w, a, out, 0, 1, 1); return;                                              \
        case 2: TYPES(type, w, a, out, 0, 1, 2); return;                                              \
        case 3: TYPES(type, w, a, out, 0, 1, 3); return;                                              \
        default: TYPES(type, w, a, out, 0, 1, 4); return;                                             \
        }                                                                                             \
    }
#define TILE4_KERNEL(DECL, TYPES, TILE_ROWS)                                                          \
    DECL(int64_t type, const uint8_t *w, const activations *a, float *out, int64_t stride) {          \
        for (int64_t first = 0; first < a->rows; first += TILE_ROWS) {                                \
            int64_t nb = a->k / QK, count = a->rows - first < TILE_ROWS ? a->rows - first : TILE_ROWS; \
            activations part = {a->qx + first * a->k, a->dx + first * nb, a->sx + first * nb, a->k, count}; \
            switch (count) {                                                                          \
            case 1: TYPES(type, w, &part, out + first, stride, 4, 1); break;                          \
            case 2: TYPES(type, w, &part, out + first, stride, 4, 2); break;                          \
            case 3: TYPES(type, w, &part, out + first, stride, 4, TILE_ROWS > 2 ? 3 : 1); break;      \
            default: TYPES(type, w, &part, out + first, stride, 4, TILE_ROWS > 2 ? 4 : 1); break;     \
            }                                                                                         \
        }                                                                                             \
    }

/* The K formats (cpu_kquant_ops.c): one weight row or four against the activation rows,
 * and one row dequantized. */
#define HIDDEN __attribute__((visibility("hidden")))
HIDDEN void kquant_row_scalar(int64_t type, const uint8_t *w, const activations *a, float *out);
HIDDEN void kquant_row_avx2(int64_t type, const uint8_t *w, const activations *a, float *out);
HIDDEN void kquant_row_vnni(int64_t type, const uint8_t *w, const activations *a, float *out);
HIDDEN void kquant_tile4_avx2(int64_t type, const uint8_t *w, const activations *a, float *out, int64_t stride);
HIDDEN void kquant_tile4_vnni(int64_t type, const uint8_t *w, const activations *a, float *out, int64_t stride);
HIDDEN void kquant_dequantize_row(int64_t type, const uint8_t *w, int64_t k, float *out);
HIDDEN void kquant_dequantize_row_avx2(int64_t type, const uint8_t *w, int64_t k, float *out); /* needs AVX2 */

/* cpu_quant_ops.c's activation quantizer and cpu_features.c's ISA check (exported). */
void spruce_quantize_rows_q16(const float *x, int64_t rows, int64_t k, int16_t *qx, float *dx, float *sx,
                              int64_t isa);
int64_t spruce_quant_best_isa(void);

#if defined(__x86_64__)
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

TARGET_AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Integer dots of a weight group (32 values widened to 16 bits: 0..15 in w_lo, 16..31 in
 * w_hi) with 32 int16 activations: values 0..15 into *lo, 16..31 into *hi, as 8 int32
 * partial sums each (|w x| <= 128 * 32767, so no sum of 32 overflows). */
TARGET_AVX2 static inline void dot_halves_avx2(__m256i w_lo, __m256i w_hi, const int16_t *x, __m256i *lo,
                                               __m256i *hi) {
    *lo = _mm256_madd_epi16(w_lo, _mm256_loadu_si256((const __m256i *)x));
    *hi = _mm256_madd_epi16(w_hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
}

TARGET_VNNI static inline void dot_halves_vnni(__m256i w_lo, __m256i w_hi, const int16_t *x, __m256i *lo,
                                               __m256i *hi) {
    *lo = _mm256_dpwssd_epi32(_mm256_setzero_si256(), w_lo, _mm256_loadu_si256((const __m256i *)x));
    *hi = _mm256_dpwssd_epi32(_mm256_setzero_si256(), w_hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
}
#endif

#endif
