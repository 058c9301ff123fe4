/* The K formats of llama.cpp on quantized-weight linear layers: super-blocks of 256 values
 * read as 8 groups of 32, each group against one 16-bit activation block (cpu_quant_ops.c
 * quantizes the activations and shares the weight rows among threads; this file's kernels
 * read four weight rows at a time, or one).
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
 * group's values become 32 values widened to 16 bits, so the dot products are the 32-value
 * formats' (cpu_quant.h), on each instruction set. */
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
/* Groups 4 half .. 4 half + 3 of a Q6_K super-block as 32 signed bytes each: the low or
 * high nibbles of ql's two chunks, bits 2 part of qh moved to bits 4-5, less 32. */
TARGET_AVX2 static inline void k6_half_avx2(const uint8_t *block, int half, __m256i q[4]) {
    const block_q6_k *b = (const block_q6_k *)block;
    const __m256i low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30);
    __m256i l0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * half));
    __m256i l1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * half + 32));
    __m256i h = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * half));
    __m256i nibbles[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                          _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                          _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
    __m256i top[4] = {_mm256_slli_epi16(h, 4), _mm256_slli_epi16(h, 2), h, _mm256_srli_epi16(h, 2)};
    for (int part = 0; part < 4; part++)
        q[part] = _mm256_sub_epi8(_mm256_or_si256(nibbles[part], _mm256_and_si256(top[part], top2)), _mm256_set1_epi8(32));
}

/* A super-block's 8 groups as 32 signed bytes each, on whole registers. */
TARGET_AVX2 static inline void k_values_avx2(int64_t type, const uint8_t *block, __m256i q[GROUPS]) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    if (type == TYPE_Q6_K) {
        k6_half_avx2(block, 0, q);
        k6_half_avx2(block, 1, q + 4);
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

/* A super-block's scales for one weight row over its 8 groups, in float lanes: Q4_K / Q5_K
 * d sc_g in *lo (both halves of a group) and -dmin m_g in *mins; Q6_K d sc_2g in *lo
 * (values 0..15 of group g) and d sc_2g+1 in *hi (values 16..31). The six-bit scales and
 * mins are unpacked four at a time in 32-bit words (llama.cpp's kmask steps). */
TARGET_AVX2 static inline void k_scales_avx2(int64_t type, const uint8_t *block, __m256 *lo, __m256 *hi,
                                             __m256 *mins) {
    if (type == TYPE_Q6_K) {
        const block_q6_k *b = (const block_q6_k *)block;
        __m128i sc = _mm_loadu_si128((const __m128i *)b->scales);
        sc = _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
        __m256 d = _mm256_set1_ps(_cvtsh_ss(b->d));
        *lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        *hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
        return;
    }
    const block_q4_k *b = (const block_q4_k *)block; /* Q5_K starts alike */
    uint32_t u[3], sc[2], m[2];
    memcpy(u, b->scales, 12);
    sc[0] = u[0] & 0x3f3f3f3f, m[0] = u[1] & 0x3f3f3f3f;
    sc[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    m[1] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    __m128i scales = _mm_set_epi32(0, 0, (int)sc[1], (int)sc[0]), mins8 = _mm_set_epi32(0, 0, (int)m[1], (int)m[0]);
    *lo = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(b->d)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scales)));
    *mins = _mm256_mul_ps(_mm256_set1_ps(-_cvtsh_ss(b->dmin)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mins8)));
    *hi = *lo;
}

/* Group g of a Q4_K / Q5_K super-block widened to 16 bits: values 0..15 in *lo, 16..31 in
 * *hi. The bytes are zero-extended into 16-bit lanes whose low nibble is group 2c's value
 * and high nibble group 2c + 1's (chunk c = g / 2). */
TARGET_AVX2 static inline void k4_group16(int64_t type, const uint8_t *block, int g, __m256i *lo, __m256i *hi) {
    const uint8_t *qs = (type == TYPE_Q4_K ? ((const block_q4_k *)block)->qs : ((const block_q5_k *)block)->qs);
    __m256i v[2];
    for (int h = 0; h < 2; h++) {
        v[h] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * (g / 2) + 16 * h)));
        v[h] = g % 2 ? _mm256_srli_epi16(v[h], 4) : _mm256_and_si256(v[h], _mm256_set1_epi16(0x0f));
        if (type == TYPE_Q5_K) { /* bit g of qh[l] -> bit 4 */
            __m256i qh = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(((const block_q5_k *)block)->qh + 16 * h)));
            qh = g < 4 ? _mm256_slli_epi16(qh, 4 - g) : _mm256_srli_epi16(qh, g - 4);
            v[h] = _mm256_or_si256(v[h], _mm256_and_si256(qh, _mm256_set1_epi16(0x10)));
        }
    }
    *lo = v[0], *hi = v[1];
}

/* Weight rows (WROWS: 1, or 4 at `stride` bytes) of a K format against ROWS activation rows,
 * both constants: out[r * MAX_ROWS + m]. Per super-block and weight row the scales become
 * float lanes once (k_scales_avx2) and meet each activation row's 8 group scales dx in one
 * multiply; each group's exact integer dot then takes one multiply-add (Q6_K, a scale per 16
 * values: a multiply and a multiply-add summed into the row's accumulator), and Q4_K /
 * Q5_K's mins one per super-block against dx sx. The loops go group by group over the weight
 * rows, so the 4 x ROWS accumulators are independent chains in flight together. Every
 * (weight row, activation row) pair runs the same operations in the same order whatever
 * WROWS and ROWS, so a row's result does not depend on the tile it was computed in. Each
 * super-block step prefetches its share of the four rows 8 rows ahead (the region of four
 * rows is contiguous: a step's share is four super-blocks). */
#define KQUANT_TILE(ISA, TARGET, DOT_HALVES)                                                             \
    TARGET static inline __attribute__((always_inline)) void kquant_##ISA##_body(                       \
        const int64_t type, const uint8_t *w, const activations *a, float *out, const int64_t stride,    \
        const int WROWS, const int ROWS) {                                                               \
        const int64_t nb = a->k / QK, bytes = block_bytes(type);                                         \
        __m256 acc[4][MAX_ROWS];                                                                         \
        for (int r = 0; r < WROWS; r++)                                                                  \
            for (int m = 0; m < ROWS; m++) acc[r][m] = _mm256_setzero_ps();                              \
        for (int64_t sb = 0; sb < a->k / QK_K; sb++) {                                                   \
            if (WROWS == 4) {                                                                            \
                const char *ahead = (const char *)w + 8 * stride + sb * 4 * bytes;                       \
                for (int64_t line = 0; line < 4 * bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0); \
            }                                                                                            \
            const uint8_t *block[4];                                                                     \
            _Alignas(32) float s_lo[4][MAX_ROWS][GROUPS], s_hi[4][MAX_ROWS][GROUPS];                     \
            _Pragma("GCC unroll 4") for (int r = 0; r < WROWS; r++) {                                    \
                block[r] = w + r * stride + sb * bytes;                                                  \
                __m256 scale_lo, scale_hi, mins;                                                         \
                k_scales_avx2(type, block[r], &scale_lo, &scale_hi, &mins);                              \
                for (int m = 0; m < ROWS; m++) {                                                         \
                    __m256 dx = _mm256_loadu_ps(a->dx + m * nb + sb * GROUPS);                           \
                    _mm256_store_ps(s_lo[r][m], _mm256_mul_ps(scale_lo, dx));                            \
                    if (type == TYPE_Q6_K) {                                                             \
                        _mm256_store_ps(s_hi[r][m], _mm256_mul_ps(scale_hi, dx));                        \
                    } else {                                                                             \
                        __m256 dxsx = _mm256_mul_ps(dx, _mm256_loadu_ps(a->sx + m * nb + sb * GROUPS));  \
                        acc[r][m] = _mm256_fmadd_ps(mins, dxsx, acc[r][m]);                              \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
            const int16_t *x = a->qx + sb * QK_K;                                                        \
            if (type == TYPE_Q6_K) {                                                                     \
                _Pragma("GCC unroll 2") for (int half = 0; half < 2; half++) {                           \
                    _Pragma("GCC unroll 4") for (int r = 0; r < WROWS; r++) {                            \
                        __m256i q[4];                                                                    \
                        k6_half_avx2(block[r], half, q);                                                 \
                        _Pragma("GCC unroll 4") for (int part = 0; part < 4; part++) {                   \
                            int g = 4 * half + part;                                                     \
                            __m256i w_lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q[part]));        \
                            __m256i w_hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q[part], 1));   \
                            for (int m = 0; m < ROWS; m++) {                                             \
                                __m256i lo, hi;                                                          \
                                DOT_HALVES(w_lo, w_hi, x + m * a->k + g * QK, &lo, &hi);                 \
                                __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(lo), _mm256_broadcast_ss(&s_lo[r][m][g])); \
                                t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_broadcast_ss(&s_hi[r][m][g]), t); \
                                acc[r][m] = _mm256_add_ps(acc[r][m], t);                                 \
                            }                                                                            \
                        }                                                                                \
                    }                                                                                    \
                }                                                                                        \
                continue;                                                                                \
            }                                                                                            \
            _Pragma("GCC unroll 8") for (int g = 0; g < GROUPS; g++) {                                   \
                _Pragma("GCC unroll 4") for (int r = 0; r < WROWS; r++) {                                \
                    __m256i w_lo, w_hi;                                                                  \
                    k4_group16(type, block[r], g, &w_lo, &w_hi);                                         \
                    for (int m = 0; m < ROWS; m++) {                                                     \
                        __m256i lo, hi;                                                                  \
                        DOT_HALVES(w_lo, w_hi, x + m * a->k + g * QK, &lo, &hi);                         \
                        __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));                       \
                        acc[r][m] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(&s_lo[r][m][g]), acc[r][m]); \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < WROWS; r++)                                                                  \
            for (int m = 0; m < ROWS; m++) out[r * MAX_ROWS + m] = hsum8(acc[r][m]);                     \
    }                                                                                                    \
    TARGET static inline __attribute__((always_inline)) void kquant_##ISA##_types(                               \
        int64_t type, const uint8_t *w, const activations *a, float *out, int64_t stride, const int WROWS, \
        const int ROWS) {                                                                                \
        switch (type) {                                                                                  \
        case TYPE_Q4_K: kquant_##ISA##_body(TYPE_Q4_K, w, a, out, stride, WROWS, ROWS); return;                 \
        case TYPE_Q5_K: kquant_##ISA##_body(TYPE_Q5_K, w, a, out, stride, WROWS, ROWS); return;                 \
        default: kquant_##ISA##_body(TYPE_Q6_K, w, a, out, stride, WROWS, ROWS); return;                        \
        }                                                                                                \
    }

KQUANT_TILE(avx2, TARGET_AVX2, dot_halves_avx2)
KQUANT_TILE(vnni, TARGET_VNNI, dot_halves_vnni)

ROW_KERNEL(TARGET_AVX2 void kquant_row_avx2, kquant_avx2_types)
ROW_KERNEL(TARGET_VNNI void kquant_row_vnni, kquant_vnni_types)
TILE4_KERNEL(TARGET_AVX2 void kquant_tile4_avx2, kquant_avx2_types, 2)
TILE4_KERNEL(TARGET_VNNI void kquant_tile4_vnni, kquant_vnni_types, 4)
#else
void kquant_dequantize_row_avx2(int64_t type, const uint8_t *w, int64_t k, float *out) {
    kquant_dequantize_row(type, w, k, out);
}
void kquant_row_avx2(int64_t type, const uint8_t *w, const activations *a, float *out) { kquant_row_scalar(type, w, a, out); }
void kquant_row_vnni(int64_t type, const uint8_t *w, const activations *a, float *out) { kquant_row_scalar(type, w, a, out); }
#endif
