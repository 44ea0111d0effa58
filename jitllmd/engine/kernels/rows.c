/* Few-row projections for x86 CPUs with AVX2 and FMA: y[t, o] = sum_k x[t, k] * W[o, k], for a handful of rows t
 * (the decode rows of a step). Each weight row is read once for every x row, so a step of 8 rows costs about what
 * one row costs while the weights stream from memory; MKL's small-M sgemm reads them far slower (bench/decode.py).
 *
 * Every (t, o) is summed in the same order whatever the number of rows, so a row's result does not depend on
 * which rows share its step. W is f32, or bf16 widened to f32 in registers (a bf16 value is an f32's top half).
 * Built by jitllmd/engine/kernels/__init__.py with -O3 -mavx2 -mfma -fopenmp; OpenMP is torch's own runtime.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define GROUP 8 /* x rows per pass over a weight row: 8 accumulators, 1 weight and 1 x register */

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
    return _mm_cvtss_f32(s);
}

static inline __m256 load_f32(const float *w) { return _mm256_loadu_ps(w); }

static inline __m256 load_bf16(const uint16_t *w) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* One weight row against n x rows (n a constant at each call site, so the loops unroll and the accumulators stay
 * in registers). */
#define DOT_ROWS(NAME, WTYPE, LOAD)                                                                           \
    static inline __attribute__((always_inline)) void NAME(const float *x, const WTYPE *w, float *y, int64_t K, \
                                                           int64_t O, const int n) {                          \
        __m256 acc[GROUP];                                                                                    \
        for (int t = 0; t < n; t++) acc[t] = _mm256_setzero_ps();                                             \
        for (int64_t k = 0; k < K; k += 8) {                                                                  \
            __m256 wk = LOAD(w + k);                                                                          \
            for (int t = 0; t < n; t++) acc[t] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + t * K + k), acc[t]); \
        }                                                                                                     \
        for (int t = 0; t < n; t++) y[t * O] = hsum(acc[t]);                                                  \
    }

#define ROWS_KERNEL(NAME, DOT, WTYPE)                                                                         \
    void NAME(const float *x, const WTYPE *W, float *y, int64_t T, int64_t K, int64_t O, int threads) {      \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                    \
        for (int64_t o = 0; o < O; o++) {                                                                     \
            const WTYPE *w = W + o * K;                                                                       \
            for (int64_t t0 = 0; t0 < T; t0 += GROUP) {                                                       \
                const float *xt = x + t0 * K;                                                                 \
                float *yt = y + t0 * O + o;                                                                   \
                switch (T - t0 < GROUP ? T - t0 : GROUP) {                                                    \
                case 1: DOT(xt, w, yt, K, O, 1); break;                                                       \
                case 2: DOT(xt, w, yt, K, O, 2); break;                                                       \
                case 3: DOT(xt, w, yt, K, O, 3); break;                                                       \
                case 4: DOT(xt, w, yt, K, O, 4); break;                                                       \
                case 5: DOT(xt, w, yt, K, O, 5); break;                                                       \
                case 6: DOT(xt, w, yt, K, O, 6); break;                                                       \
                case 7: DOT(xt, w, yt, K, O, 7); break;                                                       \
                default: DOT(xt, w, yt, K, O, 8); break;                                                      \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }

DOT_ROWS(dot_f32, float, load_f32)
DOT_ROWS(dot_bf16, uint16_t, load_bf16)

/* K must be a multiple of 8 (the caller checks); x, W and y are contiguous. */
ROWS_KERNEL(rows_f32, dot_f32, float)
ROWS_KERNEL(rows_bf16, dot_bf16, uint16_t)

/* Decode attention for a step's single-token rows in one call. Row r's new key and value (k_new[r], v_new[r]:
 * [Hkv, D]) are written at position lengths[r] - 1 of its own session's cache (k_ptrs[r], v_ptrs[r]: [Hkv, stride,
 * D]); then its query heads q[r] [H, D] attend to positions starts[r] .. lengths[r] - 1. Query head j reads kv head
 * j / (H / Hkv), as grouped-query attention repeats them. D is a multiple of 8. */
void attend_rows(const float *q, const float *k_new, const float *v_new, float *out, const int64_t *k_ptrs,
                 const int64_t *v_ptrs, const int64_t *lengths, const int64_t *starts, const int64_t *strides, int64_t R,
                 int64_t H, int64_t Hkv, int64_t D, float scale, int threads) {
    const int64_t group = H / Hkv;
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t at = (h * strides[r] + lengths[r] - 1) * D;
            memcpy((float *)k_ptrs[r] + at, k_new + (r * Hkv + h) * D, (size_t)D * sizeof(float));
            memcpy((float *)v_ptrs[r] + at, v_new + (r * Hkv + h) * D, (size_t)D * sizeof(float));
        }
    }
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")
    for (int64_t item = 0; item < R * H; item++) {
        const int64_t r = item / H, j = item % H, h = j / group;
        const float *K = (const float *)k_ptrs[r] + h * strides[r] * D;
        const float *V = (const float *)v_ptrs[r] + h * strides[r] * D;
        const float *qj = q + (r * H + j) * D;
        float *o = out + (r * H + j) * D;
        const int64_t s = starts[r], L = lengths[r];
        float *p = (float *)__builtin_alloca((size_t)(L - s) * sizeof(float));
        float best = -INFINITY;
        for (int64_t i = s; i < L; i++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qj + d), _mm256_loadu_ps(K + i * D + d), acc);
            float score = hsum(acc) * scale;
            p[i - s] = score;
            if (score > best) best = score;
        }
        float total = 0.0f;
        for (int64_t i = 0; i < L - s; i++) {
            p[i] = expf(p[i] - best);
            total += p[i];
        }
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_setzero_ps());
        for (int64_t i = s; i < L; i++) {  /* values row by row: each read once, in order */
            const __m256 pi = _mm256_set1_ps(p[i - s]);
            for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pi, _mm256_loadu_ps(V + i * D + d), _mm256_loadu_ps(o + d)));
        }
        const __m256 inv = _mm256_set1_ps(1.0f / total);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
    }
}

/* RMSNorm of f32 rows, as Hugging Face computes it in f32: x * rsqrt(mean(x^2) + eps) * w. D is a multiple of 8.
 * A step's few rows in one call where torch's fused norm costs tens of microseconds per call; a prompt's rows split
 * between the threads. */
void rms_norm_rows(const float *x, const float *w, float *y, int64_t T, int64_t D, float eps, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (T >= 64)")
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * D;
        float *yt = y + t * D;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            __m256 v = _mm256_loadu_ps(xt + d);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 scale = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)D + eps));
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(yt + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xt + d), scale), _mm256_loadu_ps(w + d)));
    }
}

/* e^x for 8 floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial, 2^n in the exponent
 * bits), within 2 ulp of libm over [-87.3, 88.7], clamped beyond. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f)), _mm256_set1_ps(88.72283935546875f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    /* 2^n: n + 127 in the exponent field; n = 128 (x near 88.7) is split as 2 * 2^127 */
    __m256i e = _mm256_cvtps_epi32(n);
    __m256i big = _mm256_cmpgt_epi32(e, _mm256_set1_epi32(127));
    e = _mm256_sub_epi32(e, _mm256_and_si256(big, _mm256_set1_epi32(1)));
    __m256 two_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
    p = _mm256_mul_ps(p, two_n);
    return _mm256_blendv_ps(p, _mm256_add_ps(p, p), _mm256_castsi256_ps(big));
}

/* The gated MLP's activation: out[t, i] = silu(gu[t, i]) * gu[t, I + i], silu(g) = g / (1 + e^-g); one pass over a
 * [T, 2I] gate_up product instead of three. I is a multiple of 8. */
void silu_mul_rows(const float *gu, float *out, int64_t T, int64_t I, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (T >= 16)")
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        for (int64_t i = 0; i < I; i += 8) {
            const __m256 gi = _mm256_loadu_ps(g + i);
            const __m256 sig = _mm256_div_ps(gi, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gi))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(sig, _mm256_loadu_ps(u + i)));
        }
    }
}
