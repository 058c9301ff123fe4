/* Linear layers on quantized weights, in llama.cpp's block formats (Q8_0, Q4_0, Q4_1: 32
 * values per block, an fp16 scale d, Q4_1 also an fp16 offset m; Q4 values are nibbles,
 * the low nibbles of a block's 16 bytes are values 0..15, the high ones 16..31).
 *
 * The activation rows are quantized once per call to 16-bit blocks of 32 (scale dx, values
 * qx = round(x / dx) in -32767..32767, and their sum sx), so each weight block meets each
 * row in integers and the scales apply once per block:
 *   Q8_0  sum w x = dw dx sum(qw qx)
 *   Q4_0  sum w x = dw dx (sum(q qx) - 8 sx)             (w = dw (q - 8))
 *   Q4_1  sum w x = dw dx sum(q qx) + m dx sx             (w = dw q + m)
 * The weights are read from memory once for all activation rows (batch-1 decode and
 * small batches are bound by reading them).
 *
 * Why 16-bit activations, not llama.cpp's 8-bit ones: on SmolLM2-135M the 8-bit rounding
 * of the activations moved the top logit by up to a whole unit and flipped 2.9% of greedy
 * tokens against the same weights in float (KL 0.0024); 16 bits make that error 256x
 * smaller, and widening the weights to 16 bits costs the AVX2 loop about what the 8-bit
 * sign trick did (two madd instead of sign, sign, maddubs, madd).
 *
 * One build serves every x86-64 CPU: each instruction-set variant is compiled with its own
 * target attribute and chosen at run time (spruce_quant_best_isa; callers may force one):
 *   ISA_SCALAR      portable C
 *   ISA_AVX2        AVX2 vpmaddwd
 *   ISA_AVX512VNNI  vpdpwssd (AVX512-VNNI on 256-bit registers)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define QK 32
#define MAX_ROWS 4

enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8 };
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512VNNI = 2 };

typedef struct __attribute__((packed)) { uint16_t d; int8_t qs[QK]; } block_q8_0;
typedef struct __attribute__((packed)) { uint16_t d; uint8_t qs[QK / 2]; } block_q4_0;
typedef struct __attribute__((packed)) { uint16_t d, m; uint8_t qs[QK / 2]; } block_q4_1;

static int64_t block_bytes(int64_t type) {
    return type == TYPE_Q8_0 ? sizeof(block_q8_0) : type == TYPE_Q4_0 ? sizeof(block_q4_0) : sizeof(block_q4_1);
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

/* ---- activations: rows x k floats -> qx int16 [rows, k], dx, sx float [rows, k / 32] ---- */

#define QMAX 32767.0f

void spruce_quantize_rows_q16(const float *x, int64_t rows, int64_t k, int16_t *qx, float *dx, float *sx) {
    int64_t nb = k / QK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * k + b * QK;
            int16_t *q = qx + r * k + b * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
            float d = amax / QMAX, id = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int i = 0; i < QK; i++) {
                q[i] = (int16_t)nearbyintf(v[i] * id);
                sum += q[i];
            }
            dx[r * nb + b] = d;
            sx[r * nb + b] = (float)sum;
        }
}

/* ---- one output row: the weight row's blocks against up to 4 activation rows ---- */

typedef struct {
    const int16_t *qx;
    const float *dx, *sx;
    int64_t k, rows;
} activations;

static void row_scalar(int64_t type, const uint8_t *w, const activations *a, float *out) {
    int64_t nb = a->k / QK, bytes = block_bytes(type);
    for (int64_t m = 0; m < a->rows; m++) out[m] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * bytes;
        int8_t q[QK];
        float dw, offset = 0.0f;
        if (type == TYPE_Q8_0) {
            const block_q8_0 *blk = (const block_q8_0 *)block;
            dw = half_to_float(blk->d);
            memcpy(q, blk->qs, QK);
        } else {
            const uint8_t *qs = type == TYPE_Q4_0 ? ((const block_q4_0 *)block)->qs : ((const block_q4_1 *)block)->qs;
            uint16_t d16;
            memcpy(&d16, block, 2);
            dw = half_to_float(d16);
            for (int i = 0; i < QK / 2; i++) q[i] = qs[i] & 0x0f, q[i + QK / 2] = qs[i] >> 4;
            if (type == TYPE_Q4_1) offset = half_to_float(((const block_q4_1 *)block)->m);
        }
        for (int64_t m = 0; m < a->rows; m++) {
            const int16_t *x = a->qx + m * a->k + b * QK;
            int32_t dot = 0;
            for (int i = 0; i < QK; i++) dot += (int32_t)q[i] * x[i];
            float d = a->dx[m * nb + b], s = a->sx[m * nb + b];
            if (type == TYPE_Q4_0) dot -= 8 * (int32_t)s;
            out[m] += dw * d * (float)dot + offset * d * s;
        }
    }
}

#if defined(__x86_64__)
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

TARGET_AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 packed bytes -> 32 bytes 0..15: low nibbles (values 0..15), then high (16..31). */
TARGET_AVX2 static inline __m256i unpack_nibbles(const uint8_t *qs) {
    __m128i packed = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* The weight block as 32 signed bytes (Q4: 0..15). */
TARGET_AVX2 static inline __m256i load_weight_block(int64_t type, const uint8_t *block) {
    if (type == TYPE_Q8_0) return _mm256_loadu_si256((const __m256i *)((const block_q8_0 *)block)->qs);
    return unpack_nibbles(type == TYPE_Q4_0 ? ((const block_q4_0 *)block)->qs : ((const block_q4_1 *)block)->qs);
}

/* Integer dot of a weight block (32 bytes, widened to 16 bits) with 32 int16 activations,
 * as 8 int32 partial sums: |w x| <= 128 * 32767, so no sum of 32 overflows. */
TARGET_AVX2 static inline __m256i dot_avx2(__m256i w, const int16_t *x) {
    __m256i w_lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
    __m256i w_hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
    __m256i lo = _mm256_madd_epi16(w_lo, _mm256_loadu_si256((const __m256i *)x));
    return _mm256_add_epi32(lo, _mm256_madd_epi16(w_hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
}

TARGET_VNNI static inline __m256i dot_vnni(__m256i w, const int16_t *x) {
    __m256i w_lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
    __m256i w_hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
    __m256i acc = _mm256_dpwssd_epi32(_mm256_setzero_si256(), w_lo, _mm256_loadu_si256((const __m256i *)x));
    return _mm256_dpwssd_epi32(acc, w_hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
}

/* The SIMD row loop, once per instruction set (DOT is the integer dot above). Per row m:
 * a float vector accumulates dw dx dot, a scalar the Q4 terms in sx. */
#define SIMD_ROW(NAME, TARGET, DOT)                                                                  \
    TARGET static void NAME(int64_t type, const uint8_t *w, const activations *a, float *out) {      \
        int64_t nb = a->k / QK, bytes = block_bytes(type), rows = a->rows;                            \
        __m256 acc[MAX_ROWS];                                                                         \
        float extra[MAX_ROWS] = {0};                                                                  \
        for (int64_t m = 0; m < MAX_ROWS; m++) acc[m] = _mm256_setzero_ps();                          \
        for (int64_t b = 0; b < nb; b++) {                                                            \
            const uint8_t *block = w + b * bytes;                                                     \
            uint16_t d16;                                                                             \
            memcpy(&d16, block, 2);                                                                   \
            float dw = _cvtsh_ss(d16), second = 0.0f;                                                 \
            if (type == TYPE_Q4_0) second = -8.0f * dw;                                               \
            if (type == TYPE_Q4_1) second = _cvtsh_ss(((const block_q4_1 *)block)->m);                \
            __m256i wv = load_weight_block(type, block);                                              \
            for (int64_t m = 0; m < rows; m++) {                                                      \
                float d = a->dx[m * nb + b];                                                          \
                __m256 dot = _mm256_cvtepi32_ps(DOT(wv, a->qx + m * a->k + b * QK));                  \
                acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * d), acc[m]);                        \
                extra[m] += second * d * a->sx[m * nb + b];                                           \
            }                                                                                         \
        }                                                                                             \
        for (int64_t m = 0; m < rows; m++) out[m] = hsum8(acc[m]) + extra[m];                         \
    }

SIMD_ROW(row_avx2, TARGET_AVX2, dot_avx2)
SIMD_ROW(row_vnni, TARGET_VNNI, dot_vnni)
#endif

/* The best instruction set this CPU runs. */
int64_t spruce_quant_best_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw"))
        return ISA_AVX512VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

/* y[m, i] = sum_j W[i, j] x[m, j] (+ bias[i]) for every activation row m < rows; W is n
 * rows of k / 32 blocks of `type`; the activations are already quantized
 * (spruce_quantize_rows_q16). y has row stride y_stride. Tiles of TILE weight rows are
 * spread over torch's OpenMP threads; a tile stays in cache while it meets the activation
 * rows 4 at a time, so the weights are read from memory once for any number of rows. */
#define TILE 16

void spruce_quant_gemv(int64_t type, const uint8_t *w, int64_t n, int64_t k, const int16_t *qx, const float *dx,
                       const float *sx, int64_t rows, const float *bias, float *y, int64_t y_stride, int64_t isa) {
    int64_t nb = k / QK, row_bytes = nb * block_bytes(type);
    void (*row)(int64_t, const uint8_t *, const activations *, float *) = row_scalar;
#if defined(__x86_64__)
    if (isa == ISA_AVX2) row = row_avx2;
    if (isa == ISA_AVX512VNNI) row = row_vnni;
#endif
#pragma omp parallel for schedule(static)
    for (int64_t tile = 0; tile < n; tile += TILE) {
        int64_t end = tile + TILE < n ? tile + TILE : n;
        for (int64_t first = 0; first < rows; first += MAX_ROWS) {
            int64_t count = rows - first < MAX_ROWS ? rows - first : MAX_ROWS;
            activations a = {qx + first * k, dx + first * nb, sx + first * nb, k, count};
            for (int64_t i = tile; i < end; i++) {
                float out[MAX_ROWS];
                row(type, w + i * row_bytes, &a, out);
                for (int64_t m = 0; m < count; m++)
                    y[(first + m) * y_stride + i] = out[m] + (bias != NULL ? bias[i] : 0.0f);
            }
        }
    }
}

/* Weight rows ids[0..count) (all n rows when ids is NULL) dequantized to float, row-major
 * into out [count, k]: the tiled path for many activation rows, and embedding lookups. */
void spruce_dequantize_rows(int64_t type, const uint8_t *w, int64_t k, const int64_t *ids, int64_t count,
                            float *out) {
    int64_t nb = k / QK, bytes = block_bytes(type), row_bytes = nb * bytes;
#pragma omp parallel for schedule(static) if (count * k >= (1 << 16))
    for (int64_t r = 0; r < count; r++) {
        const uint8_t *row = w + (ids != NULL ? ids[r] : r) * row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *block = row + b * bytes;
            float *o = out + r * k + b * QK;
            uint16_t d16;
            memcpy(&d16, block, 2);
            float d = half_to_float(d16);
            if (type == TYPE_Q8_0) {
                const int8_t *qs = ((const block_q8_0 *)block)->qs;
                for (int i = 0; i < QK; i++) o[i] = d * (float)qs[i];
                continue;
            }
            const uint8_t *qs = type == TYPE_Q4_0 ? ((const block_q4_0 *)block)->qs : ((const block_q4_1 *)block)->qs;
            float m = type == TYPE_Q4_1 ? half_to_float(((const block_q4_1 *)block)->m) : -8.0f * d;
            for (int i = 0; i < QK / 2; i++) {
                o[i] = d * (float)(qs[i] & 0x0f) + m;
                o[i + QK / 2] = d * (float)(qs[i] >> 4) + m;
            }
        }
    }
}
