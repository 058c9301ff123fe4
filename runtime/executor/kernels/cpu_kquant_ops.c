/* The K formats of llama.cpp on quantized-weight linear layers: super-blocks of 256 values
 * read as 8 groups of 32, each group against one 16-bit activation block (cpu_quant_ops.c
 * quantizes the activations and runs the row loop; this file reads one weight row).
 *
 *   Q4_K  fp16 d, dmin; 8 six-bit scales sc_j and mins m_j packed in 12 bytes; 4-bit q.
 *         w = d sc_j q - dmin m_j, so a group adds dx (d sc_j sum(q qx) - dmin m_j sx).
 *         The 128 bytes of q are 4 chunks of 32: a chunk's low nibbles are group 2c, its
 *         high nibbles group 2c + 1.
 *   Q5_K  Q4_K plus a fifth bit: bit j of qh[l] is bit 4 of value l of group j.
 *   Q6_K  fp16 d; 16 int8 scales, one per 16 values; 6-bit q - 32 (4 bits in ql, 2 in
 *         qh). w = d sc q, so a group adds dx d (sc_a sum_lo(q qx) + sc_b sum_hi(q qx)).
 *
 * The integer dot products are exact (int32 lanes); the scales apply in float. Every
 * group's values become 32 signed bytes, so the dot products are the 32-value formats'
 * (cpu_quant.h), on each instruction set. */
#include "cpu_quant.h"

#define GROUPS (QK_K / QK)

/* Q4_K / Q5_K: scale j and min j of 8, six bits each in 12 bytes (get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Per group g: w = scale[g][l / 16] q + offset[g] for value l of the group. */
static inline void k_scales(int64_t type, const uint8_t *block, float scale[GROUPS][2], float offset[GROUPS]) {
    if (type == TYPE_Q6_K) {
        const block_q6_k *b = (const block_q6_k *)block;
        float d = half_to_float(b->d);
        for (int g = 0; g < GROUPS; g++) {
            scale[g][0] = d * (float)b->scales[2 * g], scale[g][1] = d * (float)b->scales[2 * g + 1];
            offset[g] = 0.0f;
        }
        return;
    }
    const block_q4_k *b = (const block_q4_k *)block; /* Q5_K starts alike */
    float d = half_to_float(b->d), dmin = half_to_float(b->dmin);
    for (int g = 0; g < GROUPS; g++) {
        int sc, m;
        scale_min_k4(g, b->scales, &sc, &m);
        scale[g][0] = scale[g][1] = d * (float)sc;
        offset[g] = -(dmin * (float)m);
    }
}

/* Group g's 32 values as signed bytes (Q4_K 0..15, Q5_K 0..31, Q6_K -32..31). */
static inline void k_group_values(int64_t type, const uint8_t *block, int g, int8_t q[QK]) {
    if (type == TYPE_Q6_K) {
        const block_q6_k *b = (const block_q6_k *)block;
        int half = g / 4, part = g % 4, shift = (part / 2) * 4;
        const uint8_t *ql = b->ql + 64 * half + (part % 2) * 32, *qh = b->qh + 32 * half;
        for (int l = 0; l < QK; l++) q[l] = (int8_t)((((ql[l] >> shift) & 0x0f) | (((qh[l] >> (2 * part)) & 3) << 4)) - 32);
        return;
    }
    const uint8_t *qs = (type == TYPE_Q4_K ? ((const block_q4_k *)block)->qs : ((const block_q5_k *)block)->qs);
    qs += 32 * (g / 2);
    for (int l = 0; l < QK; l++) q[l] = (int8_t)((g % 2 ? qs[l] >> 4 : qs[l] & 0x0f));
    if (type == TYPE_Q5_K) {
        const uint8_t *qh = ((const block_q5_k *)block)->qh;
        for (int l = 0; l < QK; l++) q[l] |= (int8_t)(((qh[l] >> g) & 1) << 4);
    }
}

void kquant_dequantize_row(int64_t type, const uint8_t *w, int64_t k, float *out) {
    for (int64_t sb = 0; sb < k / QK_K; sb++) {
        const uint8_t *block = w + sb * block_bytes(type);
        float scale[GROUPS][2], offset[GROUPS];
        k_scales(type, block, scale, offset);
        for (int g = 0; g < GROUPS; g++) {
            int8_t q[QK];
            k_group_values(type, block, g, q);
            float *o = out + sb * QK_K + g * QK;
            for (int l = 0; l < QK; l++) o[l] = scale[g][l / 16] * (float)q[l] + offset[g];
        }
    }
}

void kquant_row_scalar(int64_t type, const uint8_t *w, const activations *a, float *out) {
    int64_t nb = a->k / QK;
    for (int64_t m = 0; m < a->rows; m++) out[m] = 0.0f;
    for (int64_t sb = 0; sb < a->k / QK_K; sb++) {
        const uint8_t *block = w + sb * block_bytes(type);
        float scale[GROUPS][2], offset[GROUPS];
        k_scales(type, block, scale, offset);
        for (int g = 0; g < GROUPS; g++) {
            int8_t q[QK];
            k_group_values(type, block, g, q);
            int64_t b = sb * GROUPS + g;
            for (int64_t m = 0; m < a->rows; m++) {
                const int16_t *x = a->qx + m * a->k + b * QK;
                int32_t lo = 0, hi = 0;
                for (int l = 0; l < QK / 2; l++) lo += (int32_t)q[l] * x[l], hi += (int32_t)q[l + 16] * x[l + 16];
                float d = a->dx[m * nb + b];
                out[m] += d * (scale[g][0] * (float)lo + scale[g][1] * (float)hi) + offset[g] * d * a->sx[m * nb + b];
            }
        }
    }
}

#if defined(__x86_64__)
/* A super-block's 8 groups as 32 signed bytes each, on whole registers. */
TARGET_AVX2 static inline void k_values_avx2(int64_t type, const uint8_t *block, __m256i q[GROUPS]) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    if (type == TYPE_Q6_K) {
        const block_q6_k *b = (const block_q6_k *)block;
        for (int half = 0; half < 2; half++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * half));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * half + 32));
            __m256i h = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * half));
            __m256i nibbles[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                                  _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                  _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
            __m256i top[4] = {h, _mm256_srli_epi16(h, 2), _mm256_srli_epi16(h, 4), _mm256_srli_epi16(h, 6)};
            for (int part = 0; part < 4; part++) {
                __m256i high = _mm256_slli_epi16(_mm256_and_si256(top[part], _mm256_set1_epi8(3)), 4);
                q[4 * half + part] = _mm256_sub_epi8(_mm256_or_si256(nibbles[part], high), _mm256_set1_epi8(32));
            }
        }
        return;
    }
    const uint8_t *qs = (type == TYPE_Q4_K ? ((const block_q4_k *)block)->qs : ((const block_q5_k *)block)->qs);
    for (int c = 0; c < 4; c++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        q[2 * c] = _mm256_and_si256(v, low4);
        q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    if (type == TYPE_Q5_K) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const block_q5_k *)block)->qh);
        for (int g = 0; g < GROUPS; g++) {
            __m256i bit = _mm256_set1_epi8((char)(1 << g));
            __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
            q[g] = _mm256_or_si256(q[g], _mm256_and_si256(set, _mm256_set1_epi8(16)));
        }
    }
}

/* kquant_dequantize_row on whole registers (the many-row GEMM's weight packing). */
TARGET_AVX2 void kquant_dequantize_row_avx2(int64_t type, const uint8_t *w, int64_t k, float *out) {
    for (int64_t sb = 0; sb < k / QK_K; sb++) {
        const uint8_t *block = w + sb * block_bytes(type);
        float scale[GROUPS][2], offset[GROUPS];
        __m256i q[GROUPS];
        k_scales(type, block, scale, offset);
        k_values_avx2(type, block, q);
        for (int g = 0; g < GROUPS; g++) {
            __m128i bytes[2] = {_mm256_castsi256_si128(q[g]), _mm256_extracti128_si256(q[g], 1)};
            for (int i = 0; i < 4; i++) {
                __m128i eight = i % 2 ? _mm_srli_si128(bytes[i / 2], 8) : bytes[i / 2];
                __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
                __m256 y = _mm256_fmadd_ps(v, _mm256_set1_ps(scale[g][i / 2]), _mm256_set1_ps(offset[g]));
                _mm256_storeu_ps(out + sb * QK_K + g * QK + 8 * i, y);
            }
        }
    }
}

/* The row loop, once per instruction set (DOT_HALVES from cpu_quant.h), its body
 * instantiated per row count (constant: the accumulators stay in registers). */
#define KQUANT_ROW(NAME, TARGET, DOT_HALVES)                                                             \
    TARGET static inline __attribute__((always_inline)) void NAME##_body(                                \
        int64_t type, const uint8_t *w, const activations *a, float *out, const int64_t rows) {          \
        int64_t nb = a->k / QK;                                                                          \
        __m256 acc[MAX_ROWS];                                                                            \
        float extra[MAX_ROWS] = {0};                                                                     \
        for (int64_t m = 0; m < MAX_ROWS; m++) acc[m] = _mm256_setzero_ps();                             \
        for (int64_t sb = 0; sb < a->k / QK_K; sb++) {                                                   \
            const uint8_t *block = w + sb * block_bytes(type);                                           \
            float scale[GROUPS][2], offset[GROUPS];                                                      \
            __m256i q[GROUPS];                                                                           \
            k_scales(type, block, scale, offset);                                                        \
            k_values_avx2(type, block, q);                                                               \
            for (int g = 0; g < GROUPS; g++) {                                                           \
                int64_t b = sb * GROUPS + g;                                                             \
                __m256i w_lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q[g]));                       \
                __m256i w_hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q[g], 1));                  \
                for (int64_t m = 0; m < rows; m++) {                                                     \
                    float d = a->dx[m * nb + b];                                                         \
                    __m256i lo, hi;                                                                      \
                    DOT_HALVES(w_lo, w_hi, a->qx + m * a->k + b * QK, &lo, &hi);                         \
                    if (type == TYPE_Q6_K) {                                                             \
                        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(scale[g][0] * d), acc[m]); \
                        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(scale[g][1] * d), acc[m]); \
                    } else {                                                                             \
                        __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));                       \
                        acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(scale[g][0] * d), acc[m]);          \
                        extra[m] += offset[g] * d * a->sx[m * nb + b];                                   \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int64_t m = 0; m < rows; m++) out[m] = hsum8(acc[m]) + extra[m];                            \
    }                                                                                                    \
    TARGET void NAME(int64_t type, const uint8_t *w, const activations *a, float *out) {                 \
        CALL_ROWS(NAME##_body, type, a->rows, w, a, out)                                                 \
    }

KQUANT_ROW(kquant_row_avx2, TARGET_AVX2, dot_halves_avx2)
KQUANT_ROW(kquant_row_vnni, TARGET_VNNI, dot_halves_vnni)
#else
void kquant_dequantize_row_avx2(int64_t type, const uint8_t *w, int64_t k, float *out) {
    kquant_dequantize_row(type, w, k, out);
}
void kquant_row_avx2(int64_t type, const uint8_t *w, const activations *a, float *out) { kquant_row_scalar(type, w, a, out); }
void kquant_row_vnni(int64_t type, const uint8_t *w, const activations *a, float *out) { kquant_row_scalar(type, w, a, out); }
#endif
