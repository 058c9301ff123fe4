/* The small per-layer operations of a decoder on the CPU, one pass over memory each:
 * residual add + RMSNorm, SiLU(gate) * up, and rotary embedding in place; and each row's
 * argmax for greedy sampling.
 *
 * Each of these is several torch operators, and each torch operator over a decode batch
 * wakes the OpenMP threads, which costs more than the arithmetic. Here a decode batch runs
 * on the calling thread; only inputs large enough to be worth it (prefill) are spread over
 * torch's threads.
 * The arithmetic follows transformers' order of operations, so results agree with the
 * torch path to float rounding.
 */
#include "cpu_vector.h"

#define PARALLEL_MIN_ELEMENTS (1 << 18)

static inline vec abs_vec(vec x) { return (vec)((ivec)x & 0x7fffffff); }

/* One row: x' = x + residual (when residual is given; residual := x'), then
 * out = weight * (x' * 1 / sqrt(mean(x'^2) + eps)). */
static void rms_norm_row(const float *x, float *residual, const float *weight, float *out, int64_t dim,
                         float eps) {
    const float *src = x;
    if (residual != NULL) {
        for (int64_t i = 0; i < dim; i++) residual[i] = x[i] + residual[i];
        src = residual;
    }
    vec squares = (vec){0};
    int64_t i = 0;
    for (; i + LANES <= dim; i += LANES) {
        vec v = load(src + i);
        squares += v * v;
    }
    float sum = sum_lanes(squares);
    for (; i < dim; i++) sum += src[i] * src[i];
    float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    for (i = 0; i < dim; i++) out[i] = weight[i] * (src[i] * inv);
}

/* rows x dim, contiguous; residual may be NULL (no add). */
void PER_ISA(spruce_rms_norm)(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t dim,
                     float eps) {
#pragma omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float *res = residual != NULL ? residual + r * dim : NULL;
        rms_norm_row(x + r * dim, res, weight, out + r * dim, dim, eps);
    }
}

/* x * sigmoid(x), with sigmoid from exp(-|x|) <= 1 so it never overflows. */
static inline vec silu_vec(vec x) {
    vec e = exp_nonpositive(-abs_vec(x));
    ivec positive = ~((ivec)x >> 31); /* sign bit clear (a shift: see max2 on wide compares) */
    vec numerator = (vec)(((ivec)splat(1.0f) & positive) | ((ivec)e & ~positive));
    return x * (numerator / (1.0f + e));
}

static inline float silu_scalar(float x) { return x / (1.0f + expf(-x)); }

/* gate_up rows are [gate (inter), up (inter)]; out rows are silu(gate) * up (inter). */
void PER_ISA(spruce_silu_mul)(const float *gate_up, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + LANES <= inter; i += LANES) {
            vec v = silu_vec(load(gate + i)) * load(up + i);
            memcpy(o + i, &v, sizeof v);
        }
        for (; i < inter; i++) o[i] = silu_scalar(gate[i]) * up[i];
    }
}

/* Rotate-half rotary embedding in place: row r holds `heads` vectors of `dim` floats
 * (q heads then k heads) at stride row_stride; cos / sin are [positions, dim / 2].
 * No fused multiply-add, so the rounding is transformers' (two products, one sum). */
__attribute__((optimize("fp-contract=off"))) void PER_ISA(spruce_rotary)(float *x, int64_t row_stride, int64_t rows,
                                                                         int64_t heads, int64_t dim,
                                                                         const int64_t *positions,
                                                                         const float *cos, const float *sin) {
    int64_t half = dim / 2;
#pragma omp parallel for if (rows * heads * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + positions[r] * half, *s = sin + positions[r] * half;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * row_stride + h * dim;
            for (int64_t i = 0; i < half; i++) {
                float x1 = v[i], x2 = v[i + half];
                v[i] = x1 * c[i] - x2 * s[i];
                v[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* y[m] = W x[m] (+ bias) for a few rows x (m < rows <= 4), W [n, k] row-major: the weights
 * are streamed once for all rows, four weight rows at a time so the four dot products form
 * independent chains. At batch 1 a decode step is this, bound by reading the weights, and
 * both threads together read them faster than one. */
#define GEMV_MAX_ROWS 4

static inline void dot_rows(const float *x, int64_t rows, int64_t k, const float *w, int64_t n_here,
                            float out[4][GEMV_MAX_ROWS]) {
    vec acc[4][GEMV_MAX_ROWS];
    for (int64_t i = 0; i < 4; i++)
        for (int64_t m = 0; m < GEMV_MAX_ROWS; m++) acc[i][m] = (vec){0};
    int64_t j = 0;
    for (; j + LANES <= k; j += LANES) {
        vec xs[GEMV_MAX_ROWS];
        for (int64_t m = 0; m < rows; m++) xs[m] = load(x + m * k + j);
        for (int64_t i = 0; i < n_here; i++) {
            vec wv = load(w + i * k + j);
            for (int64_t m = 0; m < rows; m++) acc[i][m] += wv * xs[m];
        }
    }
    for (int64_t i = 0; i < n_here; i++)
        for (int64_t m = 0; m < rows; m++) {
            float s = sum_lanes(acc[i][m]);
            for (int64_t t = j; t < k; t++) s += w[i * k + t] * x[m * k + t];
            out[i][m] = s;
        }
}

void PER_ISA(spruce_gemv)(const float *x, int64_t rows, int64_t k, const float *w, const float *bias, int64_t n, float *y) {
#pragma omp parallel for schedule(static)
    for (int64_t start = 0; start < n; start += 4) {
        int64_t n_here = n - start < 4 ? n - start : 4;
        float out[4][GEMV_MAX_ROWS];
        dot_rows(x, rows, k, w + start * k, n_here, out);
        for (int64_t i = 0; i < n_here; i++)
            for (int64_t m = 0; m < rows; m++) y[m * n + start + i] = out[i][m] + (bias != NULL ? bias[start + i] : 0.0f);
    }
}

/* One row's argmax as torch.argmax takes it: the first NaN where there is one, else the first
 * of the largest values. */
static int64_t argmax_row(const float *row, int64_t n) {
    int64_t best = 0, i = 0;
#if defined(__AVX2__)
    /* the largest value (max_ps(v, m) keeps m where v is NaN) and whether a NaN is there,
     * then the first lane equal to it: two vector passes, instead of a compare and branch
     * per value */
    __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(row + i);
        m = _mm256_max_ps(v, m), nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float top = _mm_cvtss_f32(h);
    for (int64_t j = i; j < n; j++) top = row[j] > top ? row[j] : top;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t j = i; j < n; j++) any_nan |= row[j] != row[j];
    if (!any_nan) {
        __m256 wanted = _mm256_set1_ps(top);
        for (i = 0; i + 8 <= n; i += 8) {
            int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), wanted, _CMP_EQ_OQ));
            if (hits != 0) return i + __builtin_ctz((unsigned)hits);
        }
        for (; i < n; i++)
            if (row[i] == top) return i;
    }
    i = 0; /* a NaN somewhere: the exact loop below finds the first */
#endif
    for (i = i + 1; i < n && row[best] == row[best]; i++) /* stops at a NaN */
        if (!(row[i] <= row[best])) best = i;             /* larger, or NaN */
    return best;
}

/* Each row of x [rows, n] (contiguous): its argmax (argmax_row) in ids, the value there in
 * values (a row whose value is not finite cannot be sampled). It replaces torch's argmax and
 * the gather for the value: two small operators over cold logits, whose overhead outweighs
 * their work at decode sizes. */
void PER_ISA(spruce_argmax_rows)(const float *x, int64_t rows, int64_t n, int64_t *ids, float *values) {
#pragma omp parallel for if (rows * n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        ids[r] = argmax_row(x + r * n, n);
        values[r] = x[r * n + ids[r]];
    }
}
