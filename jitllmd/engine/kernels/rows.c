/* Few-row projections for x86 CPUs with AVX2 and FMA: y[t, o] = sum_k x[t, k] * W[o, k], for a handful of rows t
 * (the decode rows of a step). Each weight row is read once for every x row, so a step of 8 rows costs about what
 * one row costs while the weights stream from memory; MKL's small-M sgemm reads them far slower (bench/decode.py).
 *
 * Every (t, o) is summed in the same order whatever the number of rows, so a row's result does not depend on
 * which rows share its step. W is f32, or bf16 widened to f32 in registers (a bf16 value is an f32's top half).
 * Built by jitllmd/engine/kernels/build.py with -O3 -mavx2 -mfma; the loops run on pool.c's threads (pool.h).
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "simd.h"

#define GROUP 8 /* x rows per pass over a weight row: 8 accumulators, 1 weight and 1 x register */

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

#define OUTS_PER_ITEM 16 /* weight rows per pool item: a few microseconds of work at one x row */

/* rows_f32 / rows_bf16: the weight rows OUTS_PER_ITEM at a time, as pool.c's items. */
#define ROWS_KERNEL(NAME, DOT, WTYPE)                                                                         \
    typedef struct {                                                                                          \
        const float *x;                                                                                       \
        const WTYPE *W;                                                                                       \
        float *y;                                                                                             \
        int64_t T, K, O;                                                                                      \
    } NAME##_job;                                                                                             \
                                                                                                              \
    static void NAME##_item(void *arg, int64_t i) {                                                           \
        const NAME##_job *j = arg;                                                                            \
        const int64_t T = j->T, K = j->K, O = j->O;                                                           \
        const int64_t end = (i + 1) * OUTS_PER_ITEM < O ? (i + 1) * OUTS_PER_ITEM : O;                        \
        for (int64_t o = i * OUTS_PER_ITEM; o < end; o++) {                                                   \
            const WTYPE *w = j->W + o * K;                                                                    \
            for (int64_t t0 = 0; t0 < T; t0 += GROUP) {                                                       \
                const float *xt = j->x + t0 * K;                                                              \
                float *yt = j->y + t0 * O + o;                                                                \
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
    }                                                                                                         \
                                                                                                              \
    void NAME(const float *x, const WTYPE *W, float *y, int64_t T, int64_t K, int64_t O, int threads) {      \
        NAME##_job job = {.x = x, .W = W, .y = y, .T = T, .K = K, .O = O};                                    \
        pool_for((O + OUTS_PER_ITEM - 1) / OUTS_PER_ITEM, threads, NAME##_item, &job);                        \
    }

DOT_ROWS(dot_f32, float, load_f32)
DOT_ROWS(dot_bf16, uint16_t, load_bf16)

/* K must be a multiple of 8 (the caller checks); x, W and y are contiguous. On pool.c's threads. */
ROWS_KERNEL(rows_f32, dot_f32, float)
ROWS_KERNEL(rows_bf16, dot_bf16, uint16_t)

typedef struct {
    const float *q;
    float *out;
    const int64_t *k_ptrs, *v_ptrs, *lengths, *starts, *tables;
    int64_t H, group, D;
    float scale;
    _Atomic int failed; /* set by an item that found no memory for its scores */
} attend_job;

/* n f16 values widened to f32 (exactly), four vectors a step by pointer steps: one a step at indexed addresses was
 * ~40% of a decode row's attention (bench/attend_kernel.py: D = 64 heads 0.79-0.87x the time, 0.91-0.96x from memory). */
static inline void widen_f16(float *dst, const uint16_t *src, int64_t n) {
    const uint16_t *end = src + n;
    for (; end - src >= 32; src += 32, dst += 32)
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(dst + 8 * k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 8 * k))));
    for (; end - src >= 8; src += 8, dst += 8) _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src)));
    for (; src < end; src++, dst++) *dst = _cvtsh_ss(*src);
}

/* n rows of a q8_0 cache (simd.h: D int8, then D / 32 f16 scales) widened to f32 rows of D: each value its block's
 * scale times its integer, one f32 product (exactly what the torch reference computes). D a multiple of 32. */
static inline void widen_q8(float *dst, const uint8_t *src, int64_t n, int64_t D) {
    const int64_t rb = D + D / 16;
    for (int64_t r = 0; r < n; r++, src += rb, dst += D) {
        const int8_t *q = (const int8_t *)src;
        const uint16_t *scale = (const uint16_t *)(src + D);
        for (int64_t b = 0; b < D / 32; b++) {
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(scale[b]));
            for (int k = 0; k < 4; k++) {
                const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 32 * b + 8 * k))));
                _mm256_storeu_ps(dst + 32 * b + 8 * k, _mm256_mul_ps(d, v));
            }
        }
    }
}

/* n bf16 values widened to f32 (exactly: a bf16 value is an f32's top half). */
static inline void widen_bf16(float *dst, const uint16_t *src, int64_t n) { /* as widen_f16 */
    const uint16_t *end = src + n;
    for (; end - src >= 32; src += 32, dst += 32)
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(dst + 8 * k, load_bf16(src + 8 * k));
    for (; end - src >= 8; src += 8, dst += 8) _mm256_storeu_ps(dst, load_bf16(src));
    for (; src < end; src++, dst++) {
        const uint32_t bits = (uint32_t)*src << 16;
        memcpy(dst, &bits, 4);
    }
}

/* n rows of a narrower cache (f16, bf16, q8_0) from `src` widened to f32. */
static inline void widen_rows(float *dst, const void *src, int64_t n, int64_t D, int kind) {
    if (kind == KV_F16)
        widen_f16(dst, (const uint16_t *)src, n * D);
    else if (kind == KV_BF16)
        widen_bf16(dst, (const uint16_t *)src, n * D);
    else
        widen_q8(dst, (const uint8_t *)src, n, D);
}

/* hsum of each of 8 vectors at once, lane j of the result hsum(v[j]) bit for bit: the same additions in the same
 * tree ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)), done for eight keys across lanes. */
static inline __m256 hsum8(const __m256 v[8]) {
    __m256 s[4]; /* s[j]: lo + hi of v[j] in the low half, of v[j + 4] in the high half */
    for (int j = 0; j < 4; j++) s[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[j], v[j + 4], 0x20), _mm256_permute2f128_ps(v[j], v[j + 4], 0x31));
    const __m256 a = _mm256_add_ps(_mm256_unpacklo_ps(s[0], s[1]), _mm256_unpackhi_ps(s[0], s[1]));
    const __m256 b = _mm256_add_ps(_mm256_unpacklo_ps(s[2], s[3]), _mm256_unpackhi_ps(s[2], s[3]));
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE));
}

/* One (row, kv head) of attend_rows: for each of the kv head's `group` query heads, softmax(q K^T * scale) V over the
 * row's keys, for an f16 or f32 cache and a head size DC known at compile time (64, 128) or 0 (a->D, any multiple of
 * 8). The heads take each block of keys (a page's, KV_PAGE at most) in turn while it is in L1, so K and V come from
 * memory once for all of them.
 * Each score is hsum of its own lane-wise sums over D, eight keys reduced at once (hsum8); e^x is exp8_neg's (within
 * 2 ulp of libm's expf, eight keys at a time: libm's one key at a time was most of a decode step's attention); each
 * head's weighted values are summed key by key in order (in registers within a block where DC is known): the same
 * bits as one head and one key at a time. */
static inline __attribute__((always_inline)) void attend_group(attend_job *a, int64_t item, const int kind, const int64_t DC) {
    const int64_t Hkv = a->H / a->group, g = a->group, D = DC ? DC : a->D, r = item / Hkv, h = item % Hkv, rb = kv_row_bytes(kind, D);
    const int32_t *table = (const int32_t *)a->tables[r];
    const char *K = (const char *)a->k_ptrs[r], *V = (const char *)a->v_ptrs[r];
    const int wide_rows = kind != KV_F32;
    const float *q = a->q + (r * a->H + h * g) * D; /* the group's query heads, adjacent */
    float *out = a->out + (r * a->H + h * g) * D;
    const int64_t s = a->starts[r], L = a->lengths[r], n = L - s;
    const float scale = a->scale;
    /* head jj's scores, then weights: p + jj * n; on the stack unless long (a worker's stack is the OS default) */
    const size_t p_bytes = (size_t)(g * n) * sizeof(float);
    float *p = p_bytes <= (64 << 10) ? (float *)__builtin_alloca(p_bytes) : malloc(p_bytes), *heap = p_bytes <= (64 << 10) ? NULL : p;
    if (p == NULL) {
        atomic_store_explicit(&a->failed, 1, memory_order_relaxed);
        return;
    }
    float *best = (float *)__builtin_alloca((size_t)g * sizeof(float));
    /* a narrower cache's block of keys (then of values) widened once, exactly, for every head to read */
    float *wide = wide_rows ? (float *)__builtin_alloca((size_t)(KV_PAGE * D) * sizeof(float)) : NULL;
    for (int64_t jj = 0; jj < g; jj++) best[jj] = -INFINITY;
    for (int64_t b0 = s, b1; b0 < L; b0 = b1) {
        b1 = kv_run(b0, L);
        const int64_t at = kv_byte(table, Hkv, h, b0, rb);
        const float *kb = wide_rows ? wide : (const float *)(K + at); /* key i's row at kb + (i - b0) * D */
        if (wide_rows) widen_rows(wide, K + at, b1 - b0, D, kind);
        for (int64_t jj = 0; jj < g; jj++) {
            const float *qj = q + jj * D;
            float *pj = p + jj * n; /* key i's score at pj[i - s] */
            __m256 top = _mm256_set1_ps(best[jj]);
            int64_t i = b0;
            for (; i + 8 <= b1; i += 8) {
                __m256 acc[8];
                for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
                for (int64_t d = 0; d < D; d += 8) {
                    const __m256 qd = _mm256_loadu_ps(qj + d);
                    for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kb + (i - b0 + k) * D + d), acc[k]);
                }
                const __m256 score = _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale));
                _mm256_storeu_ps(pj + i - s, score);
                top = _mm256_max_ps(top, score);
            }
            __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
            t = _mm_max_ps(t, _mm_movehl_ps(t, t));
            float m = _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 0x55)));
            for (; i < b1; i++) {
                __m256 acc = _mm256_setzero_ps();
                for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qj + d), _mm256_loadu_ps(kb + (i - b0) * D + d), acc);
                const float score = hsum(acc) * scale;
                pj[i - s] = score;
                if (score > m) m = score;
            }
            best[jj] = m;
        }
    }
    float *inv = best; /* each head's maximum, then 1 / its sum */
    for (int64_t jj = 0; jj < g; jj++) {
        float *pj = p + jj * n;
        const __m256 shift = _mm256_set1_ps(best[jj]);
        __m256 sum = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= n; k += 8) {
            const __m256 e = exp8_neg(_mm256_sub_ps(_mm256_loadu_ps(pj + k), shift));
            _mm256_storeu_ps(pj + k, e);
            sum = _mm256_add_ps(sum, e);
        }
        float total = hsum(sum);
        if (k < n) { /* the last few keys: the same lanes' arithmetic, on a padded vector */
            float tail[8] = {0};
            memcpy(tail, pj + k, (size_t)(n - k) * sizeof(float));
            _mm256_storeu_ps(tail, exp8_neg(_mm256_sub_ps(_mm256_loadu_ps(tail), shift)));
            for (int64_t t = 0; t < n - k; t++) total += pj[k + t] = tail[t];
        }
        inv[jj] = 1.0f / total;
    }
    for (int64_t i = 0; i < g * D; i += 8) _mm256_storeu_ps(out + i, _mm256_setzero_ps());
    for (int64_t b0 = s, b1; b0 < L; b0 = b1) {
        b1 = kv_run(b0, L);
        const int64_t at = kv_byte(table, Hkv, h, b0, rb);
        const float *vb = wide_rows ? wide : (const float *)(V + at); /* value k's row at vb + (k - b0) * D */
        if (wide_rows) widen_rows(wide, V + at, b1 - b0, D, kind);
        for (int64_t jj = 0; jj < g; jj++) {
            const float *pj = p + jj * n; /* key k's weight at pj[k - s] */
            float *o = out + jj * D;
            if (DC) { /* this head's output in registers through the block */
                __m256 acc[DC ? DC / 8 : 1];
                for (int64_t d = 0; d < D / 8; d++) acc[d] = _mm256_loadu_ps(o + 8 * d);
                for (int64_t k = b0; k < b1; k++) {
                    const __m256 pk = _mm256_set1_ps(pj[k - s]);
                    for (int64_t d = 0; d < D / 8; d++) acc[d] = _mm256_fmadd_ps(pk, _mm256_loadu_ps(vb + (k - b0) * D + 8 * d), acc[d]);
                }
                for (int64_t d = 0; d < D / 8; d++) _mm256_storeu_ps(o + 8 * d, acc[d]);
            } else {
                for (int64_t k = b0; k < b1; k++) {
                    const __m256 pk = _mm256_set1_ps(pj[k - s]);
                    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pk, _mm256_loadu_ps(vb + (k - b0) * D + d), _mm256_loadu_ps(o + d)));
                }
            }
        }
    }
    for (int64_t jj = 0; jj < g; jj++) {
        const __m256 iv = _mm256_set1_ps(inv[jj]);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + jj * D + d, _mm256_mul_ps(_mm256_loadu_ps(out + jj * D + d), iv));
    }
    free(heap);
}

#define ATTEND_ITEM(KIND, DC) \
    static void attend_item_##KIND##_##DC(void *arg, int64_t item) { attend_group(arg, item, KIND, DC); }
ATTEND_ITEM(0, 0)
ATTEND_ITEM(0, 64)
ATTEND_ITEM(0, 128)
ATTEND_ITEM(1, 0)
ATTEND_ITEM(1, 64)
ATTEND_ITEM(1, 128)
ATTEND_ITEM(2, 0)
ATTEND_ITEM(2, 64)
ATTEND_ITEM(2, 128)
ATTEND_ITEM(3, 0)
ATTEND_ITEM(3, 64)
ATTEND_ITEM(3, 128)

/* n f32 values to f16, rounded to nearest even as torch's .half() rounds them. n is a multiple of 8. */
static inline void to_f16(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* n f32 values to bf16, rounded to nearest even as torch's .bfloat16() rounds them. n is a multiple of 8. */
static inline void to_bf16(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) _mm_storeu_si128((__m128i *)(dst + i), bf16x8(_mm256_loadu_ps(src + i)));
}

/* A row of D f32 values to a q8_0 row (simd.h): per block of 32, scale = amax / 127, each q = value * (1 / scale)
 * rounded to nearest even (0 where the block is all 0), the scale stored as f16 (nearest even). D a multiple of 32. */
static inline void to_q8(uint8_t *dst, const float *src, int64_t D) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < D / 32; b++) {
        const float *x = src + 32 * b;
        __m256 m = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * k)));
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        const float amax = _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 0x55)));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int8_t *q = (int8_t *)dst + 32 * b;
        for (int k = 0; k < 4; k++) {
            const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), _mm256_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256i i32 = _mm256_cvtps_epi32(v);
            const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
            _mm_storel_epi64((__m128i *)(q + 8 * k), _mm_packs_epi16(i16, i16));
        }
        ((uint16_t *)(dst + D))[b] = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    }
}

/* Decode attention for a step's single-token rows in one call. Row r's new key and value (k_new[r], v_new[r]:
 * [Hkv, D]) are written at position lengths[r] - 1 of its own session's cache (k_ptrs[r], v_ptrs[r]: the layer's pages
 * [pages, Hkv, KV_PAGE] rows of `kind` (simd.h: f32, f16 or bf16 rounded to nearest, q8_0); tables[r]: the address of its int32
 * page table, simd.h kv_byte);
 * then its query heads q[r] [H, D] attend to positions starts[r] .. lengths[r] - 1 (each
 * row and kv head one item on pool.c's threads). Query head j reads kv head j / (H / Hkv), as grouped-query attention
 * repeats them. D is a multiple of 8. Returns 0, or -1 without memory for the scores. */
int attend_rows(const float *q, const float *k_new, const float *v_new, float *out, const int64_t *k_ptrs,
                 const int64_t *v_ptrs, const int64_t *lengths, const int64_t *starts, const int64_t *tables, int64_t R,
                 int64_t H, int64_t Hkv, int64_t D, float scale, int kind, int threads) {
    const int64_t rb = kv_row_bytes(kind, D);
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t at = kv_byte((const int32_t *)tables[r], Hkv, h, lengths[r] - 1, rb);
            uint8_t *kd = (uint8_t *)k_ptrs[r] + at, *vd = (uint8_t *)v_ptrs[r] + at;
            const float *ks = k_new + (r * Hkv + h) * D, *vs = v_new + (r * Hkv + h) * D;
            if (kind == KV_F16) {
                to_f16((uint16_t *)kd, ks, D);
                to_f16((uint16_t *)vd, vs, D);
            } else if (kind == KV_BF16) {
                to_bf16((uint16_t *)kd, ks, D);
                to_bf16((uint16_t *)vd, vs, D);
            } else if (kind == KV_Q8) {
                to_q8(kd, ks, D);
                to_q8(vd, vs, D);
            } else {
                memcpy(kd, ks, (size_t)D * sizeof(float));
                memcpy(vd, vs, (size_t)D * sizeof(float));
            }
        }
    }
    attend_job job = {q, out, k_ptrs, v_ptrs, lengths, starts, tables, H, H / Hkv, D, scale, 0};
    static void (*const items[4][3])(void *, int64_t) = {{attend_item_0_0, attend_item_0_64, attend_item_0_128},
                                                         {attend_item_1_0, attend_item_1_64, attend_item_1_128},
                                                         {attend_item_2_0, attend_item_2_64, attend_item_2_128},
                                                         {attend_item_3_0, attend_item_3_64, attend_item_3_128}};
    pool_for(R * Hkv, threads, items[kind][D == 64 ? 1 : D == 128 ? 2 : 0], &job);
    return atomic_load_explicit(&job.failed, memory_order_relaxed) ? -1 : 0;
}

#define ROWS_PER_ITEM 8 /* x rows per pool item of the row-wise kernels below: about a microsecond of work */

/* What rms_norm_rows, rope_rows and gated_rows pass their items; each uses the fields it names. */
typedef struct {
    const float *x, *w, *cos, *sin, *r;
    float *y;
    int64_t T, D, stride, heads;
    float eps;
    int input;
} rows_job;

/* The x rows of pool item i. */
static inline int64_t item_end(int64_t i, int64_t T) { return (i + 1) * ROWS_PER_ITEM < T ? (i + 1) * ROWS_PER_ITEM : T; }

/* y = (r +) x * rsqrt(mean(x^2) + eps) * w for the D-float rows (t, h) at t * stride + h * D of x, y and r alike
 * (h < heads); y may be x. */
static void rms_norm_item(void *arg, int64_t i) {
    const rows_job *j = arg;
    const int64_t D = j->D;
    for (int64_t t = i * ROWS_PER_ITEM, end = item_end(i, j->T); t < end; t++) {
        for (int64_t h = 0; h < j->heads; h++) {
            const int64_t at = t * j->stride + h * D;
            const float *xt = j->x + at;
            float *yt = j->y + at;
            const __m256 scale = _mm256_set1_ps(inv_rms(xt, D, j->eps));
            for (int64_t d = 0; d < D; d += 8) {
                __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xt + d), scale), _mm256_loadu_ps(j->w + d));
                if (j->r) v = _mm256_add_ps(_mm256_loadu_ps(j->r + at + d), v);
                _mm256_storeu_ps(yt + d, v);
            }
        }
    }
}

/* RMSNorm of f32 rows, as Hugging Face computes it in f32: x * rsqrt(mean(x^2) + eps) * w. D is a multiple of 8.
 * A step's few rows in one call where torch's fused norm costs tens of microseconds per call; a prompt's rows split
 * between pool.c's threads. */
void rms_norm_rows(const float *x, const float *w, float *y, int64_t T, int64_t D, float eps, int threads) {
    rows_job job = {.x = x, .w = w, .y = y, .T = T, .D = D, .stride = D, .heads = 1, .eps = eps};
    pool_for((T + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM, T >= 64 ? threads : 1, rms_norm_item, &job);
}

/* y = r + RMSNorm(x) * w, rows_norm_rows's values added to a residual stream r [T, D] (y may be x or r): a norm of
 * a sublayer's output before it joins the stream (Gemma's), one pass. */
void rms_norm_add_rows(const float *x, const float *w, const float *r, float *y, int64_t T, int64_t D, float eps, int threads) {
    rows_job job = {.x = x, .w = w, .r = r, .y = y, .T = T, .D = D, .stride = D, .heads = 1, .eps = eps};
    pool_for((T + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM, T >= 64 ? threads : 1, rms_norm_item, &job);
}

/* RMSNorm in place of each head of x [T, heads, D] (rows `stride` floats apart, heads adjacent: q's or k's heads in
 * a qkv product's rows), by one weight [D]: q/k norms, with rms_norm_rows's values. */
void rms_norm_heads(float *x, int64_t stride, const float *w, int64_t T, int64_t heads, int64_t D, float eps, int threads) {
    rows_job job = {.x = x, .w = w, .y = x, .T = T, .D = D, .stride = stride, .heads = heads, .eps = eps};
    pool_for((T + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM, T >= 16 ? threads : 1, rms_norm_item, &job);
}

static void rope_item(void *arg, int64_t i) {
    const rows_job *j = arg;
    const int64_t D = j->D, half = D / 2;
    for (int64_t t = i * ROWS_PER_ITEM, end = item_end(i, j->T); t < end; t++) {
        const float *c = j->cos + t * D, *s = j->sin + t * D;
        for (int64_t h = 0; h < j->heads; h++) {
            float *xh = j->y + t * j->stride + h * D;
            for (int64_t d = 0; d < half; d += 8) {
                const __m256 x1 = _mm256_loadu_ps(xh + d), x2 = _mm256_loadu_ps(xh + half + d);
                _mm256_storeu_ps(xh + d, _mm256_fmadd_ps(x2, _mm256_loadu_ps(s + d), _mm256_mul_ps(x1, _mm256_loadu_ps(c + d))));
                _mm256_storeu_ps(xh + half + d, _mm256_fmadd_ps(x1, _mm256_loadu_ps(s + half + d), _mm256_mul_ps(x2, _mm256_loadu_ps(c + half + d))));
            }
        }
    }
}

/* Rotate-half RoPE in place on f32 rows: x [T, heads, D] (row stride `stride` floats, heads adjacent in a row), cos
 * [T, D], sin [T, D] with its first half negated: x' = x * cos + (x's halves swapped) * sin. D is a multiple of 16.
 * A prompt's rows split between pool.c's threads. */
void rope_rows(float *x, int64_t stride, const float *cos, const float *sin, int64_t T, int64_t heads, int64_t D, int threads) {
    rows_job job = {.cos = cos, .sin = sin, .y = x, .T = T, .D = D, .stride = stride, .heads = heads};
    pool_for((T + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM, T >= 16 ? threads : 1, rope_item, &job);
}

static void gated_item(void *arg, int64_t i) {
    const rows_job *j = arg;
    const int64_t I = j->D;
    for (int64_t t = i * ROWS_PER_ITEM, end = item_end(i, j->T); t < end; t++) {
        const float *g = j->x + t * 2 * I, *u = g + I;
        float *o = j->y + t * I;
        for (int64_t k = 0; k < I; k += 8) _mm256_storeu_ps(o + k, gate_mul8(j->input, _mm256_loadu_ps(g + k), _mm256_loadu_ps(u + k)));
    }
}

/* The gated MLP's activation: out[t, i] = act(gu[t, i]) * gu[t, I + i], act silu (input GATED) or gelu's tanh form
 * (GATED_GELU), as simd.h makes them; one pass over a [T, 2I] gate_up product instead of three. I is a multiple of 8. A
 * prompt's rows split between pool.c's threads. */
void gated_rows(const float *gu, float *out, int64_t T, int64_t I, int input, int threads) {
    rows_job job = {.x = gu, .y = out, .T = T, .D = I, .input = input};
    pool_for((T + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM, T >= 16 ? threads : 1, gated_item, &job);
}

/* Attention for a chunk of one session's tokens (a prompt, or a prompt's later chunk), flash-style: no score matrix
 * is ever whole. Query i of the chunk (q[i]: [H, D]) is at position p + i and sees the keys at positions
 * max(key_start, p + i - window + 1) .. p + i (window 0: no window) of its session's cache: the layer's pages K, V
 * ([pages, Hkv, KV_PAGE] rows of `kind`: f32, f16 or q8_0, each block of keys widened once per item; the chunk's own keys
 * already written) through its page table (simd.h kv_at); q's rows
 * are q_stride floats apart (q may be a view into qkv's rows). Query head j reads kv head j / (H / Hkv). D is a
 * multiple of 4.
 *
 * Work items, run on pool.c's threads each with its own scratch, are (kv head, block of QB queries): the item's
 * R = group * QB query rows (query-major: the group's heads of one query are adjacent) share each block of keys: the
 * keys one page holds, so the blocks fall at fixed positions and a query's result does not depend on its chunk.
 * Everything runs across rows, eight to a vector, so no step needs a horizontal sum or a per-row loop:
 *   scores   S[c][r] = K[c] . (q_r * scale)              a register tile of 4 keys (broadcast) x 24 rows, over D
 *   softmax  the rows' running maximum m and sum l, P[c][r] = e^(S[c][r] - m_r), masked keys 0
 *   output   O[d][r] = O[d][r] * corr_r + sum_c V[c][d] P[c][r]   4 dims (broadcast) x 24 rows, over the keys
 * and O / l goes out transposed once per item. */
#define QB 16
#define KB KV_PAGE /* keys per block: a page's */

/* S[j][v] = sum_d k_j[d] * qt[d][v] for nj (1..4) keys k_j = k + j * D and nv (1..3) vectors of 8 rows. */
static inline __attribute__((always_inline)) void score_tile(const float *k, int64_t D, const float *qt, int64_t RP, float *s, const int nj, const int nv) {
    __m256 acc[4][3];
    for (int j = 0; j < nj; j++)
        for (int v = 0; v < nv; v++) acc[j][v] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m256 y[3];
        for (int v = 0; v < nv; v++) y[v] = _mm256_loadu_ps(qt + d * RP + 8 * v);
        for (int j = 0; j < nj; j++) {
            const __m256 x = _mm256_broadcast_ss(k + j * D + d);
            for (int v = 0; v < nv; v++) acc[j][v] = _mm256_fmadd_ps(x, y[v], acc[j][v]);
        }
    }
    for (int j = 0; j < nj; j++)
        for (int v = 0; v < nv; v++) _mm256_storeu_ps(s + j * RP + 8 * v, acc[j][v]);
}

/* O[j][v] = O[j][v] * corr[v] + sum_c vr[c * D + j] * pt[c][v] for 4 dims and nv (1..3) vectors of 8 rows. */
static inline __attribute__((always_inline)) void pv_tile(const float *vr, int64_t D, const float *pt, int64_t RP, int64_t kn, float *o, const float *corr,
                                                          const int nv) {
    __m256 acc[4][3];
    for (int v = 0; v < nv; v++) {
        const __m256 cv = _mm256_loadu_ps(corr + 8 * v);
        for (int j = 0; j < 4; j++) acc[j][v] = _mm256_mul_ps(_mm256_loadu_ps(o + j * RP + 8 * v), cv);
    }
    for (int64_t c = 0; c < kn; c++) {
        __m256 y[3];
        for (int v = 0; v < nv; v++) y[v] = _mm256_loadu_ps(pt + c * RP + 8 * v);
        for (int j = 0; j < 4; j++) {
            const __m256 x = _mm256_broadcast_ss(vr + c * D + j);
            for (int v = 0; v < nv; v++) acc[j][v] = _mm256_fmadd_ps(x, y[v], acc[j][v]);
        }
    }
    for (int j = 0; j < 4; j++)
        for (int v = 0; v < nv; v++) _mm256_storeu_ps(o + j * RP + 8 * v, acc[j][v]);
}

#define BY_VECTORS(nv, call) \
    switch (nv) {            \
        case 1: call(1); break; \
        case 2: call(2); break; \
        default: call(3); break; \
    }

typedef struct {
    const float *q;
    const void *K, *V; /* the layer's pages [pages, Hkv, KV_PAGE] rows of `kind` (simd.h) */
    const int32_t *table; /* the session's page table (simd.h kv_at) */
    float *out;
    int64_t q_stride, n, H, Hkv, D, p, key_start, window, group, blocks, RP, kind;
    float scale;
    _Atomic int failed; /* set by an item that found no memory for its scratch */
} chunk_job;

/* One item of attend_chunk: kv head item / blocks, a block of QB queries, with its own scratch. */
static void chunk_item(void *arg, int64_t item) {
    chunk_job *job = arg;
    const float *q = job->q;
    float *out = job->out;
    const int64_t q_stride = job->q_stride, n = job->n, H = job->H, Hkv = job->Hkv, D = job->D, p = job->p;
    const int64_t key_start = job->key_start, window = job->window, group = job->group, blocks = job->blocks, RP = job->RP;
    const float scale = job->scale;
    /* qt, ot [D][RP], st [KB][RP], then m, l, corr, last, first [RP]: each a multiple of 8 floats, so all 32-byte
     * aligned; then, for a narrower cache, a block of keys and one of values widened to f32 [KB][D] */
    float *qt = aligned_alloc(32, sizeof(float) * (size_t)((2 * D + KB + 5) * RP + (job->kind != KV_F32 ? 2 * KB * D : 0)));
    if (qt == NULL) {
        atomic_store_explicit(&job->failed, 1, memory_order_relaxed);
        return;
    }
    float *ot = qt + D * RP, *st = ot + D * RP, *m = st + KB * RP, *l = m + RP, *corr = l + RP;
    int32_t *last = (int32_t *)(corr + RP), *first = last + RP;
    float *kf = (float *)(first + RP), *vf = kf + KB * D;
    /* each head's blocks last to first: the items claimed last are the lightest (fewest keys), so the threads finish
     * together */
    const int64_t h = item / blocks, i0 = (blocks - 1 - item % blocks) * QB, i1 = i0 + QB < n ? i0 + QB : n;
    const int64_t R = (i1 - i0) * group, rp = (R + 7) / 8 * 8, nvec = rp / 8;
    /* rows r = (i - i0) * group + j: q * scale transposed to qt[d][r], each row's visible keys [first, last] */
    for (int64_t r = 0; r < rp; r++) {
        const int64_t i = i0 + (r < R ? r : R - 1) / group, j = (r < R ? r : R - 1) % group;
        const float *qr = q + i * q_stride + (h * group + j) * D;
        for (int64_t d = 0; d < D; d++) qt[d * rp + r] = r < R ? qr[d] * scale : 0.0f;
        last[r] = (int32_t)(p + i);
        first[r] = (int32_t)(window > 0 && p + i - window + 1 > key_start ? p + i - window + 1 : key_start);
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(ot, 0, sizeof(float) * (size_t)(D * rp));
    const int64_t lo = first[0], hi = p + i1; /* the item's keys [lo, hi) */
    for (int64_t k0 = lo, kn; k0 < hi; k0 += kn) {
        kn = kv_run(k0, hi) - k0; /* a block of keys is what one page holds of them */
        const int64_t at = kv_byte(job->table, Hkv, h, k0, kv_row_bytes((int)job->kind, D));
        const float *kb, *vb; /* this block's keys and values, f32 */
        if (job->kind != KV_F32) {
            widen_rows(kf, (const char *)job->K + at, kn, D, (int)job->kind);
            widen_rows(vf, (const char *)job->V + at, kn, D, (int)job->kind);
            kb = kf;
            vb = vf;
        } else {
            kb = (const float *)((const char *)job->K + at);
            vb = (const float *)((const char *)job->V + at);
        }
        /* every row sees every key of this block: no mask */
        const int full = k0 + kn - 1 <= p + i0 && k0 >= first[R - 1];
        for (int64_t v0 = 0; v0 < nvec; v0 += 3) {
            const int nv = (int)(nvec - v0 < 3 ? nvec - v0 : 3);
            int64_t c = 0;
#define SCORE4(NV) score_tile(kb + c * D, D, qt + 8 * v0, rp, st + c * rp + 8 * v0, 4, NV)
            for (; c + 4 <= kn; c += 4) BY_VECTORS(nv, SCORE4)
#undef SCORE4
#define SCORE1(NV) score_tile(kb + c * D, D, qt + 8 * v0, rp, st + c * rp + 8 * v0, 1, NV)
            for (; c < kn; c++) BY_VECTORS(nv, SCORE1)
#undef SCORE1
        }
        for (int64_t v = 0; v < nvec; v++) {
            float *sv = st + 8 * v;
            const __m256i hi_v = _mm256_load_si256((const __m256i *)(last + 8 * v)), lo_v = _mm256_load_si256((const __m256i *)(first + 8 * v));
            __m256 top = _mm256_set1_ps(-INFINITY);
            if (full) {
                for (int64_t c = 0; c < kn; c++) top = _mm256_max_ps(top, _mm256_load_ps(sv + c * rp));
            } else {
                for (int64_t c = 0; c < kn; c++) {
                    const __m256i key = _mm256_set1_epi32((int32_t)(k0 + c));
                    const __m256i hidden = _mm256_or_si256(_mm256_cmpgt_epi32(key, hi_v), _mm256_cmpgt_epi32(lo_v, key));
                    const __m256 s = _mm256_blendv_ps(_mm256_load_ps(sv + c * rp), _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(hidden));
                    _mm256_store_ps(sv + c * rp, s);
                    top = _mm256_max_ps(top, s);
                }
            }
            const __m256 old = _mm256_load_ps(m + 8 * v), best = _mm256_max_ps(old, top);
            /* rows that have seen no key yet keep m = -inf: subtract 0 there, not -inf */
            const __m256 none = _mm256_cmp_ps(best, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
            const __m256 shift = _mm256_blendv_ps(best, _mm256_setzero_ps(), none);
            _mm256_store_ps(corr + 8 * v, exp8_neg(_mm256_sub_ps(old, shift))); /* tiny, not 0, on a row's first keys: o, l are 0 there */
            _mm256_store_ps(m + 8 * v, best);
            __m256 sum = _mm256_setzero_ps();
            for (int64_t c = 0; c < kn; c++) {
                const __m256 s = _mm256_load_ps(sv + c * rp);
                __m256 e = exp8_neg(_mm256_sub_ps(s, shift));
                if (!full) e = _mm256_and_ps(e, _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
                _mm256_store_ps(sv + c * rp, e);
                sum = _mm256_add_ps(sum, e);
            }
            _mm256_store_ps(l + 8 * v, _mm256_fmadd_ps(_mm256_load_ps(l + 8 * v), _mm256_load_ps(corr + 8 * v), sum));
        }
        for (int64_t d = 0; d < D; d += 4)
            for (int64_t v0 = 0; v0 < nvec; v0 += 3) {
                const int nv = (int)(nvec - v0 < 3 ? nvec - v0 : 3);
#define PV(NV) pv_tile(vb + d, D, st + 8 * v0, rp, kn, ot + d * rp + 8 * v0, corr + 8 * v0, NV)
                BY_VECTORS(nv, PV)
#undef PV
            }
    }
    for (int64_t r = 0; r < R; r++) {
        float *dst = out + ((i0 + r / group) * H + h * group + r % group) * D;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) dst[d] = ot[d * rp + r] * inv;
    }
    free(qt);
}

int attend_chunk(const float *q, int64_t q_stride, const void *K, const void *V, float *out, int64_t n, int64_t H, int64_t Hkv, int64_t D,
                 const int32_t *table, int64_t p, int64_t key_start, int64_t window, float scale, int kind, int threads) {
    const int64_t group = H / Hkv, blocks = (n + QB - 1) / QB;
    chunk_job job = {.q = q, .K = K, .V = V, .table = table, .out = out, .q_stride = q_stride, .n = n, .H = H, .Hkv = Hkv, .D = D, .p = p,
                     .key_start = key_start, .window = window, .group = group, .blocks = blocks, .RP = (group * QB + 7) / 8 * 8, .kind = kind, .scale = scale};
    pool_for(Hkv * blocks, threads, chunk_item, &job);
    return atomic_load_explicit(&job.failed, memory_order_relaxed) ? -1 : 0;
}
