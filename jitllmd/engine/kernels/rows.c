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
#include <stdlib.h>
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

/* Rotate-half RoPE in place on f32 rows: x [T, heads, D] (row stride `stride` floats, heads adjacent in a row), cos
 * [T, D], sin [T, D] with its first half negated: x' = x * cos + (x's halves swapped) * sin. D is a multiple of 16. */
void rope_rows(float *x, int64_t stride, const float *cos, const float *sin, int64_t T, int64_t heads, int64_t D, int threads) {
    const int64_t half = D / 2;
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (T >= 16)")
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < heads; h++) {
            float *xh = x + t * stride + h * D;
            for (int64_t d = 0; d < half; d += 8) {
                const __m256 x1 = _mm256_loadu_ps(xh + d), x2 = _mm256_loadu_ps(xh + half + d);
                _mm256_storeu_ps(xh + d, _mm256_fmadd_ps(x2, _mm256_loadu_ps(s + d), _mm256_mul_ps(x1, _mm256_loadu_ps(c + d))));
                _mm256_storeu_ps(xh + half + d, _mm256_fmadd_ps(x1, _mm256_loadu_ps(s + half + d), _mm256_mul_ps(x2, _mm256_loadu_ps(c + half + d))));
            }
        }
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

/* Attention for a chunk of one session's tokens (a prompt, or a prompt's later chunk), flash-style: no score matrix
 * is ever whole. Query i of the chunk (q[i]: [H, D]) is at position p + i and sees the keys at positions
 * max(key_start, p + i - window + 1) .. p + i (window 0: no window) of its session's cache K, V ([Hkv, stride, D],
 * the chunk's own keys already written). Query head j reads kv head j / (H / Hkv). D is a multiple of 64.
 *
 * Work items are (kv head, block of QB queries): the block's group * QB query rows share each key block's K and V
 * while they are in L1. Per key block of KB keys: the scores by 3 x 4 register tiles of dot products, then for each
 * row the running maximum and sum (the softmax's rescaling) and its output row += p * V with the row's 64-wide
 * output slices in registers. */
#define QB 16
#define KB 64
#define SK (KB + 8) /* a score row's stride: a masked tail vector may spill past KB */

static inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* All-ones in the first `left` lanes (all eight when left >= 8). */
static inline __m256 lanes(int64_t left) {
    const __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)), at));
}

static inline float hmax(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 0x55));
    return _mm_cvtss_f32(x);
}

/* s[r * SK + c] = q_r . k_c for three query rows and four keys, over D */
static inline void scores_3x4(const float *const *qr, const float *k, int64_t D, float *s) {
    __m256 a[3][4];
    for (int r = 0; r < 3; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 x0 = _mm256_loadu_ps(qr[0] + d), x1 = _mm256_loadu_ps(qr[1] + d), x2 = _mm256_loadu_ps(qr[2] + d);
        for (int c = 0; c < 4; c++) {
            const __m256 w = _mm256_loadu_ps(k + c * D + d);
            a[0][c] = _mm256_fmadd_ps(x0, w, a[0][c]);
            a[1][c] = _mm256_fmadd_ps(x1, w, a[1][c]);
            a[2][c] = _mm256_fmadd_ps(x2, w, a[2][c]);
        }
    }
    for (int r = 0; r < 3; r++) _mm_storeu_ps(s + r * SK, sum4(a[r][0], a[r][1], a[r][2], a[r][3]));
}

int attend_chunk(const float *q, const float *K, const float *V, float *out, int64_t n, int64_t H, int64_t Hkv, int64_t D,
                 int64_t stride, int64_t p, int64_t key_start, int64_t window, float scale, int threads) {
    const int64_t group = H / Hkv, blocks = (n + QB - 1) / QB, rows_max = group * QB;
    int failed = 0;
    _Pragma("omp parallel num_threads(threads)")
    {
        const int64_t rows_cap = (rows_max + 2) / 3 * 3;
        float *s = malloc(sizeof(float) * (size_t)(rows_cap * SK));
        float *o = malloc(sizeof(float) * (size_t)(rows_cap * D));
        float *m = malloc(sizeof(float) * (size_t)rows_cap), *l = malloc(sizeof(float) * (size_t)rows_cap);
        const float **qrow = malloc(sizeof(float *) * (size_t)rows_cap);
        int64_t *pos = malloc(sizeof(int64_t) * (size_t)rows_cap);
        const int ready = s && o && m && l && qrow && pos;
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t item = 0; item < Hkv * blocks; item++) {
            if (!ready) {
                _Pragma("omp atomic write")
                failed = 1;
                continue;
            }
            const int64_t h = item / blocks, i0 = (item % blocks) * QB, i1 = i0 + QB < n ? i0 + QB : n;
            const float *Kh = K + h * stride * D, *Vh = V + h * stride * D;
            /* rows: (query i, head h * group + j), query-major */
            int64_t rows = 0;
            for (int64_t i = i0; i < i1; i++)
                for (int64_t j = 0; j < group; j++, rows++) {
                    qrow[rows] = q + (i * H + h * group + j) * D;
                    pos[rows] = p + i;
                    m[rows] = -INFINITY;
                    l[rows] = 0.0f;
                    memset(o + rows * D, 0, sizeof(float) * (size_t)D);
                }
            for (int64_t r = rows; r < (rows + 2) / 3 * 3; r++) qrow[r] = qrow[0]; /* padding rows: computed, unused */
            int64_t lo = key_start;
            if (window > 0 && p + i0 - window + 1 > lo) lo = p + i0 - window + 1;
            const int64_t hi = p + i1; /* keys [lo, hi) */
            for (int64_t k0 = lo; k0 < hi; k0 += KB) {
                const int64_t kn = hi - k0 < KB ? hi - k0 : KB, kn4 = kn / 4 * 4;
                for (int64_t r = 0; r < rows; r += 3) {
                    for (int64_t c = 0; c < kn4; c += 4) scores_3x4(qrow + r, Kh + (k0 + c) * D, D, s + r * SK + c);
                    for (int64_t c = kn4; c < kn; c++)
                        for (int rr = 0; rr < 3; rr++) {
                            __m256 acc = _mm256_setzero_ps();
                            for (int64_t d = 0; d < D; d += 8)
                                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qrow[r + rr] + d), _mm256_loadu_ps(Kh + (k0 + c) * D + d), acc);
                            s[(r + rr) * SK + c] = hsum(acc);
                        }
                }
                for (int64_t r = 0; r < rows; r++) {
                    /* this row's visible keys within the block: [a, b) */
                    int64_t a = k0, b = pos[r] + 1 < k0 + kn ? pos[r] + 1 : k0 + kn;
                    if (window > 0 && pos[r] - window + 1 > a) a = pos[r] - window + 1;
                    if (a >= b) continue;
                    float *sr = s + r * SK;
                    const int64_t c0 = a - k0, c1 = b - k0;
                    __m256 top = _mm256_set1_ps(-INFINITY);
                    for (int64_t c = c0; c < c1; c += 8) {
                        const __m256 keep = lanes(c1 - c);
                        const __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_mul_ps(_mm256_loadu_ps(sr + c), _mm256_set1_ps(scale)), keep);
                        _mm256_storeu_ps(sr + c, v);
                        top = _mm256_max_ps(top, v);
                    }
                    const float best = hmax(top) > m[r] ? hmax(top) : m[r];
                    const float corr = expf(m[r] - best); /* 0 on the row's first block (m = -inf) */
                    __m256 sum = _mm256_setzero_ps();
                    for (int64_t c = c0; c < c1; c += 8) {
                        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + c), _mm256_set1_ps(best))), lanes(c1 - c));
                        _mm256_storeu_ps(sr + c, e);
                        sum = _mm256_add_ps(sum, e);
                    }
                    const float total = hsum(sum);
                    m[r] = best;
                    l[r] = l[r] * corr + total;
                    float *orow = o + r * D;
                    const __m256 cv = _mm256_set1_ps(corr);
                    for (int64_t d0 = 0; d0 < D; d0 += 64) {
                        __m256 acc[8];
                        for (int v = 0; v < 8; v++) acc[v] = _mm256_mul_ps(_mm256_loadu_ps(orow + d0 + 8 * v), cv);
                        for (int64_t c = a - k0; c < b - k0; c++) {
                            const __m256 pc = _mm256_set1_ps(sr[c]);
                            const float *vrow = Vh + (k0 + c) * D + d0;
                            for (int v = 0; v < 8; v++) acc[v] = _mm256_fmadd_ps(pc, _mm256_loadu_ps(vrow + 8 * v), acc[v]);
                        }
                        for (int v = 0; v < 8; v++) _mm256_storeu_ps(orow + d0 + 8 * v, acc[v]);
                    }
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                const int64_t i = i0 + r / group, j = h * group + r % group;
                float *dst = out + (i * H + j) * D;
                const __m256 inv = _mm256_set1_ps(1.0f / l[r]);
                for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(o + r * D + d), inv));
            }
        }
        free(s), free(o), free(m), free(l), free(qrow), free(pos);
    }
    return failed ? -1 : 0;
}
