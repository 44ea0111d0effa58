/* Vector helpers the kernels share (rows.c, panels.c, quant.c, attend_bf16.c): AVX2 + FMA, 8 floats to a vector;
 * AVX-512 ones where the build has it. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* Session K/V in pages (engine/pages.py): a layer's cache is [pages][Hkv][KV_PAGE] rows, and a session's page table
 * (int32, one entry per KV_PAGE positions) names the page each run of KV_PAGE positions is in. The attention kernels
 * take keys a page at a time: within one, a kv head's keys are adjacent rows. A row is one position's D values of one
 * kv head: f32, f16, bf16, or q8_0 (KV_Q8: D int8 then D / 32 f16 scales, value i = scale[i / 32] * q[i], llama.cpp's
 * block rule: scale amax / 127, q the value / scale rounded to nearest even). */
#define KV_PAGE 64
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8 = 2, KV_BF16 = 3 }; /* a cache's kind */

/* Bytes of one row of a cache of `kind`. */
static inline int64_t kv_row_bytes(int kind, int64_t D) { return kind == KV_F32 ? 4 * D : kind == KV_Q8 ? D + D / 16 : 2 * D; }

/* f32 -> bf16, to nearest even (NaN stays a quiet NaN), as torch's .bfloat16() rounds */
static inline __m128i bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* The byte where position pos of kv head h starts, rows of row_bytes. */
static inline int64_t kv_byte(const int32_t *table, int64_t Hkv, int64_t h, int64_t pos, int64_t row_bytes) {
    return (((int64_t)table[pos / KV_PAGE] * Hkv + h) * KV_PAGE + pos % KV_PAGE) * row_bytes;
}

/* The element where position pos of kv head h starts in an f32 or f16 cache. */
static inline int64_t kv_at(const int32_t *table, int64_t Hkv, int64_t h, int64_t pos, int64_t D) { return kv_byte(table, Hkv, h, pos, D); }

/* The end of the run of positions from pos that one page holds, at most end. */
static inline int64_t kv_run(int64_t pos, int64_t end) {
    const int64_t stop = (pos / KV_PAGE + 1) * KV_PAGE;
    return stop < end ? stop : end;
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
    return _mm_cvtss_f32(s);
}

/* Cephes' expf core for either vector width (P: _mm256 or _mm512): x - n ln 2 (ln 2 in two parts), then a
 * degree-5 polynomial p in it, so that e^x = p * 2^n; T the vector type. */
#define EXP_POLY(P, T, x, n, p)                                                            \
    do {                                                                                   \
        T r_ = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                             \
        r_ = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r_);                           \
        T c_ = P##_set1_ps(1.9875691500e-4f);                                              \
        c_ = P##_fmadd_ps(c_, r_, P##_set1_ps(1.3981999507e-3f));                          \
        c_ = P##_fmadd_ps(c_, r_, P##_set1_ps(8.3334519073e-3f));                          \
        c_ = P##_fmadd_ps(c_, r_, P##_set1_ps(4.1665795894e-2f));                          \
        c_ = P##_fmadd_ps(c_, r_, P##_set1_ps(1.6666665459e-1f));                          \
        c_ = P##_fmadd_ps(c_, r_, P##_set1_ps(5.0000001201e-1f));                          \
        p = P##_fmadd_ps(c_, P##_mul_ps(r_, r_), P##_add_ps(r_, P##_set1_ps(1.0f)));       \
    } while (0)

/* Cephes' expf on 8 floats already in [-87.3, 88.7]: e^x = p * 2^n, n = round(x / ln 2). Returns p; n goes to *n. */
static inline __m256 exp8_parts(__m256 x, __m256 *n) {
    *n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 p;
    EXP_POLY(_mm256, __m256, x, *n, p);
    return p;
}

/* e^x for 8 floats, within 2 ulp of libm over [-87.3, 88.7], clamped beyond. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f)), _mm256_set1_ps(88.72283935546875f));
    __m256 n;
    __m256 p = exp8_parts(x, &n);
    /* 2^n: n + 127 in the exponent field; n = 128 (x near 88.7) is split as 2 * 2^127 */
    __m256i e = _mm256_cvtps_epi32(n);
    __m256i big = _mm256_cmpgt_epi32(e, _mm256_set1_epi32(127));
    e = _mm256_sub_epi32(e, _mm256_and_si256(big, _mm256_set1_epi32(1)));
    __m256 two_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
    p = _mm256_mul_ps(p, two_n);
    return _mm256_blendv_ps(p, _mm256_add_ps(p, p), _mm256_castsi256_ps(big));
}

/* e^x for x <= 0 (a softmax's shifted scores): exp8 without its overflow path. */
static inline __m256 exp8_neg(__m256 x) {
    __m256 n;
    const __m256 p = exp8_parts(_mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f)), &n);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* silu(g) * u = g / (1 + e^-g) * u, the gated MLP's activation (Llama's). */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))), u);
}

/* gelu(g) * u with GELU's tanh form (Gemma's): 0.5 g (1 + tanh(z)), z = sqrt(2 / pi) (g + 0.044715 g^3), which is
 * g / (1 + e^-2z), silu's shape. */
static inline __m256 gelu_mul8(__m256 g, __m256 u) {
    const __m256 minus_2z = _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(-0.0713548162726f), _mm256_set1_ps(-1.5957691216057308f)));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(minus_2z))), u);
}

/* What the kernels make of their input rows (panels.c's and quant.c's `input`, rows.c's gated_rows): x itself, RMSNorm(x) * w, or
 * the gated MLP's activation of x [T, 2K] (gate then up in each row), silu's or gelu's. */
enum { PLAIN = 0, NORMED = 1, GATED = 2, GATED_GELU = 3 };
#define IS_GATED(input) ((input) >= GATED)

/* act(g) * u for a gated input (GATED: silu, GATED_GELU: gelu), subnormal results flushed to zero (as the bf16
 * conversion reads them: the f32 rows and their bf16 rounding agree; a far negative gate makes them, gelu's often) */
static inline __m256 gate_mul8(int input, __m256 g, __m256 u) {
    const __m256 r = input == GATED_GELU ? gelu_mul8(g, u) : silu_mul8(g, u);
    const __m256 normal = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), r), _mm256_set1_ps(1.17549435e-38f), _CMP_GE_OQ);
    return _mm256_and_ps(r, normal);
}

/* 1 / sqrt(mean(x^2) + eps) over a row of D floats (D a multiple of 8): RMSNorm's scale, as Hugging Face computes it in f32. */
static inline float inv_rms(const float *x, int64_t D, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 v = _mm256_loadu_ps(x + d);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    return 1.0f / sqrtf(hsum(acc) / (float)D + eps);
}

#ifdef __AVX512F__
/* 16 vectors of 16 dwords transposed: out[j] dword i = in[i] dword j */
static inline void transpose16(const __m512i *in, __m512i *out) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
    }
    /* u[4i + c]'s 128-bit lane L: column 4L + c of rows 4i .. 4i + 3 */
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
        const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
        out[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        out[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
        out[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        out[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
    }
}
#endif

#if defined(__AMX_TILE__)
/* AMX palette 1 with all eight tiles 16 rows of 64 bytes (bf16: 16 x 32; f32: 16 x 16), loaded for this thread: the
 * one shape quant.c's and attend_bf16.c's tiles take */
static inline void amx_tiles_16x64(void) {
    struct {
        uint8_t palette, start;
        uint8_t reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg = {.palette = 1};
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}
#endif
