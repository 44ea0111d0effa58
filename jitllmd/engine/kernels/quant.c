/* Projections over weights kept in GGUF's own block layout (ggml's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K),
 * and their dequantization. A weight [N, K] is N rows of K / block_elems blocks, each as ggml lays it out.
 *
 * quant_rows: y[t, o] = sum_k x[t, k] * W[o, k], llama.cpp's way. Each x row is quantized once per call, per 32
 * inputs, to int8 (d = amax / 127, q = round-to-nearest-even(x / d), d = 0 -> q = 0), d and d * sum(q) kept in f32;
 * where asked, x is RMSNorm(x) * w or act(gate) * up, made from the given rows as they are quantized (as panels.c does).
 * A row's weights go by groups of 8 x-blocks (eight 32-format blocks, or one K-format superblock), each unpacked
 * once for up to GROUP (WIDE_GROUP) x rows into 8 vectors of codes, in an order x's codes are stored in too (see x_lane). Per
 * row, integer dot products (AVX2: maddubs + madd; VNNI: dpbusd, with AVX-512 two rows at a time in 512-bit vectors) add
 * up in int32 lanes that each belong to one x-block, then one conversion per group to f32, times each block's
 * d_w * d_x, into a vector accumulator. A format's offset or min (Q4_0's -8 d, Q4_1's m, Q4_K's -dmin * m, ...)
 * comes in as offset * (d_x * sum(q)).
 * Signed weights (Q8_0, Q6_K's q - 32): AVX2 takes |w| against x * sign(w) (Q6_K: q against x, less 32 * sum(x));
 * VNNI x + 128 against w, less 128 * sum(w) (Q6_K at one x row on AVX-VNNI: q against x, less 32 * sum(x)). Every
 * (t, o) sums in one order whatever T is and however many threads run: a row's result does not depend on the rows
 * beside it (nor on the build: the integer sums are exact, the f32 steps the same).
 *
 * The error bound against x @ dequant(W).T in exact arithmetic: rounding x to its int8 grid is the only rounding
 * besides f32 sums, and |x_k - d_b q_k| <= d_b / 2, so
 *     |y[t, o] - sum_k x[t, k] W[o, k]| <= sum_k |W[o, k]| * d_b(k) / 2 + e,
 * d_b(k) = amax / 127 of x[t]'s 32-block holding k, e a few f32 ulps of the blocks' partial sums (for the offset
 * formats those are up to d_w * q_max * sum |x| per block, not just sum |W x|).
 *
 * dequant_rows: the rows as f32 (or bf16, rounded to nearest even from the f32), bit for bit gguf.quants.dequantize
 * (the same f32 operations in the same order: d * sc first, then * q, then the min; never fused into an FMA).
 *
 * gemm_rows: quant_rows' product for many rows (a prompt chunk where the CPU has no bf16 units) as an int8 GEMM over
 * panels of 8 weight rows unpacked once, see its section below.
 *
 * bf16_rows (built with AVX512_BF16, and AMX where asked): a prompt chunk's product in bf16, see its section below.
 *
 * x86-64 with AVX2, FMA and F16C; built with AVX-VNNI, the dot products are 256-bit dpbusd; with AVX-512 VL + VNNI +
 * BW, dpbusd (512-bit for a pair of rows) and Q5's fifth bits masked moves. Every build gives the same bits. Built
 * with rows.c; its loops run on pool.c's threads.
 */
#include <immintrin.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "simd.h"

#define GROUP 8 /* x rows per pass over a weight row */
#define QB 32   /* x is quantized per 32 inputs: one block of the 32-formats, a sub-block of the K-formats */
#ifndef PF_DIST
#define PF_DIST 2048 /* bytes ahead of a row's reads to prefetch: 256 .. 4096 measured on Sapphire Rapids, 2048 about the best */
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* VNNI's dpbusd on 256-bit vectors: AVX512-VNNI's (EVEX), or AVX-VNNI's (VEX: Intel's client cores since Alder Lake,
 * which have no AVX-512). Only with AVX-512 do two x rows share 512-bit vectors (pair_dot). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_VNNI 1
#define HAVE_VNNI512 1
#define dpbusd256 _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define HAVE_VNNI 1
#define dpbusd256 _mm256_dpbusd_avx_epi32
#endif
/* 16 rows may share a pass: a group unpacked once for all of them. With AVX-512 VL (32 vector registers) their
 * accumulators in registers (a 16-row step's projections measured 1.17x quicker: SmolLM2 Q8_0, Qwen2.5 Q4_K_M); on
 * AVX2 in memory, as they are for 8 (avx2+fma, 16 rows against two passes of 8, interleaved, the same bits: Q6_K
 * 0.74-0.88x the time, Q4_K 0.82-0.87x, Q5_0 0.87-0.90x, Q8_0 0.90-0.95x). */
#define WIDE_GROUP 16

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_BW 1
#endif

static inline int64_t block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

static inline int is_k(int type) { return type >= Q4_K; }
static inline int64_t block_elems(int type) { return is_k(type) ? 256 : 32; }
/* formats whose weights are d * (code - offset) or d * code + m: their offset term rides on x's d * sum(q) */
static inline int has_offset(int type) { return type != Q8_0 && type != Q6_K; }

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline float f16(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

/* v as it is: stops the compiler fusing a product into a following add (gguf rounds both). */
static inline __m256 settled(__m256 v) {
    __asm__("" : "+v"(v));
    return v;
}

/* ---- one x-block's 32 weight codes as bytes, in element order (for dequantizing) ---- */

/* 16 bytes of nibbles: low nibbles are elements 0..15, high nibbles 16..31 */
static inline __m256i nibbles32(const uint8_t *qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
}

/* 0x10 in byte j where bit j of `bits` is set: Q5's fifth bit */
static inline __m256i bits32(uint32_t bits) {
#ifdef HAVE_BW
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(0x10));
#else
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
#endif
}

/* A 32-format block's codes: unsigned (0..15, 0..31) or, for Q8_0, the signed int8 values. */
static inline __m256i codes32(int type, const uint8_t *b) {
    switch (type) {
    case Q4_0: return nibbles32(b + 2);
    case Q4_1: return nibbles32(b + 4);
    case Q5_0: return _mm256_or_si256(nibbles32(b + 6), bits32(rd32(b + 2)));
    case Q5_1: return _mm256_or_si256(nibbles32(b + 8), bits32(rd32(b + 4)));
    default: return _mm256_loadu_si256((const __m256i *)(b + 2));
    }
}

/* bits `shift` .. of every byte moved to bit 4 .., kept under `mask` */
static inline __m256i bits_to_4(__m256i v, int shift, char mask) {
    return _mm256_and_si256(shift <= 4 ? _mm256_slli_epi16(v, 4 - shift) : _mm256_srli_epi16(v, shift - 4), _mm256_set1_epi8(mask));
}

/* Q4_K / Q5_K sub-block j (0..7) of a superblock b, given ggml's qs vector j / 2 (v: 2c's codes are the low nibbles
 * of qs[32c..], 2c+1's the high); Q5_K's fifth bit of element l is bit j of qh[l]. Unsigned, 0..31. */
static inline __m256i codes_k(int type, __m256i v, const uint8_t *b, int j) {
    const __m256i lo = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
    if (type == Q4_K) return lo;
    return _mm256_or_si256(lo, bits_to_4(_mm256_loadu_si256((const __m256i *)(b + 16)), j, 0x10));
}

/* Q6_K's elements 32j .. 32j + 31 as q - 32 (signed), given ggml's ql vector 2h + (i & 1) (l): half h = j / 4 of the
 * superblock holds ql[64h ..], qh[32h ..]; its quarter i = j % 4 takes ql[64h + 32 (i & 1) + l]'s low (i < 2) or high
 * nibble and bits 2i, 2i + 1 of qh[32h + l]. */
static inline __m256i codes_q6k(__m256i l, const uint8_t *b, int j) {
    const int h = j / 4, i = j % 4;
    const __m256i lo = _mm256_and_si256(i < 2 ? l : _mm256_srli_epi16(l, 4), _mm256_set1_epi8(15));
    const __m256i hi = bits_to_4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)), 2 * i, 0x30);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
}

/* ggml's vector of a K-format superblock b's codes that sub-block j reads */
static inline int k_vector(int type, int j) { return type == Q6_K ? 2 * (j / 4) + (j & 1) : j / 2; }
static inline const uint8_t *k_codes(int type, const uint8_t *b) { return b + (type == Q6_K ? 0 : type == Q5_K ? 48 : 16); }

/* Q4_K / Q5_K's eight 6-bit scales and mins (llama.cpp's get_scale_min_k4: sc j < 4 is q[j] & 63, m j < 4 q[j + 4] & 63;
 * j >= 4 take their low four bits from q[j + 4]'s nibbles and their top two from q[j - 4]'s, q[j]'s top bits), all
 * sixteen at once with two byte shuffles, times d and dmin: the sub-blocks' d * sc and dmin * m. (One at a time in
 * scalar code this was a third of a decode row's work on a Q4_K superblock.) */
static inline void k_scales(const uint8_t *b, __m256 *dsc, __m256 *dmin_m) {
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4)); /* the 12 scale bytes and 4 of the codes after them */
    /* bytes 0-7 sc0..7, 8-15 m0..7: low bits from q[0..3], q[8..11], q[4..7], q[8..11]'s high nibbles */
    const __m128i a = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i lo = _mm_or_si128(_mm_and_si128(a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
                                    _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
    /* the j >= 4 values' top two bits: q[0..3]'s and q[4..7]'s bits 6, 7 moved to 4, 5 */
    const __m128i h = _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i v = _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi16(h, 2), _mm_set1_epi8(0x30)));
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)rd32(b))); /* d, dmin */
    *dsc = _mm256_mul_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
    *dmin_m = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}

/* ---- the layout the dot products run in ----
 *
 * A group of 8 x-blocks (256 inputs: 8 blocks of a 32-format, or one K-format superblock) unpacks into NV = 8
 * vectors of 32 weight codes whose 4-byte lanes each hold 4 codes of ONE x-block: lane L of vector v is elements
 * e .. e + 3 of x-block b (x_lane). x is stored in the same order, so the products of matching vectors add up in
 * int32 lanes that each belong to one x-block over the whole group: one conversion and one FMA per accumulator, row
 * and group, instead of one per block. The 32-formats have one accumulator (lane L: block L); the K-formats two
 * (Q4_K, Q5_K: blocks 0 2 4 6 and 1 3 5 7; Q6_K: 0 1 4 5 and 2 3 6 7, lanes L and L + 4 of a block its halves).
 *
 * x's rows are stored in pairs (rows 2p, 2p + 1), side by side: in a pair's group, vector v of row 2p then of 2p + 1
 * (32 bytes each, so a row's vectors are XV apart); in xd, per accumulator, row 2p's 8 lanes then 2p + 1's; in xs,
 * 8 floats each, then 8 more each (Q6_K's second vector of corrections, q6k_sums). With AVX-512 one 512-bit load is
 * then the same vector of both rows (pair_dot). */
#define NV 8
#define GB 256 /* x codes per group and row */
#define XV 64  /* bytes from a row's x vector to its next: the pair's other row sits between */

/* Where x row t's slot starts in a group's slab of `per_row` items a row (pairs interleaved by `half`). The slabs go
 * group by group (np pairs' worth each), so the rows a pass reads sit together and, with t a constant of an unrolled
 * loop, row t's address is the group's pointer and a constant. */
static inline int64_t x_slot(int64_t t, int64_t per_row, int64_t half) { return t / 2 * 2 * per_row + t % 2 * half; }

static inline int num_acc(int type) { return is_k(type) ? 2 : 1; }

/* One x row (T = 1: a decode step's) goes compact: its vectors XC bytes apart, a group's 256 codes GB apart, xd's
 * and xs's 16 floats a group (an accumulator's 8, then the next's). In the pairs' layout a row's x takes twice its
 * bytes in cache lines: a 1536 x 8960 projection's x (27 KB there, 13 compact) left L1 under each row's weights, and
 * its reloads held up the weights' stream from memory (bench/rows_kernel.py --dims 9216x8960 --tokens 1: 0.59x the
 * time for Q4_K, 0.62x Q6_K, avx2+fma, 2 threads). The kernels take x's vector stride xv (XV or XC, a constant at
 * each call site); the rest of the layout follows from it. */
#define XC 32
static inline int x_fa(int xv) { return xv == XC ? 8 : 16; } /* floats from one accumulator's d (or sums) to the next's */
static inline int64_t x_gq(int xv, int64_t np) { return xv == XC ? GB : np * 2 * GB; } /* a group's codes, np pairs' */
static inline int64_t x_gf(int xv, int64_t np) { return xv == XC ? 16 : np * 32; }     /* a group's floats in xd, xs */

/* vectors a 32-format row's short last group of m blocks packs into (pack_tail) */
static inline int tail_vectors(int64_t m) { return m <= 2 ? 2 : m <= 4 ? 4 : NV; }

static inline void x_lane(int type, int v, int L, int *block, int *elem) {
    static const int q6k[4] = {0, 1, 4, 5};
    if (!is_k(type)) {
        *block = L, *elem = 4 * v;
        return;
    }
    *elem = 4 * (v / 2) + 16 * (L / 4);
    *block = type == Q6_K ? q6k[L % 4] + 2 * (v & 1) : 2 * (L % 4) + (v & 1);
}

/* the x-block of accumulator a's lane L (vector a's: the K-formats' vector v feeds accumulator v & 1) */
static inline int acc_block(int type, int a, int L) {
    int block, elem;
    x_lane(type, a, L, &block, &elem);
    return block;
}

/* With VNNI the signed-weight formats take x + 128 as dpbusd's unsigned operand and subtract 128 * sum(w): exact,
 * without the sign trick's per-row work. */
static inline int x_biased(int type) {
#ifdef HAVE_VNNI
    return type == Q8_0 || type == Q6_K;
#else
    (void)type;
    return 0;
#endif
}

/* AVX-VNNI at one x row (q6k_one) takes Q6_K's codes unsigned (0..63) against x as it is, less 32 * each lane's
 * sum of x (q6k_sums): two dpbusd a vector pair, where x biased needs two more for the codes' sums. */
#if defined(HAVE_VNNI) && !defined(HAVE_VNNI512)
#define Q6K_ONE_PLAIN 1
#else
#define Q6K_ONE_PLAIN 0
#endif

/* whether quant_rows' T rows of x go in biased (x_biased), T known */
static inline int x_biased_at(int type, int64_t T) { return x_biased(type) && !(Q6K_ONE_PLAIN && type == Q6_K && T == 1); }

/* ---- x: quantized per 32 inputs ---- */

/* What x's rows are, made as they are quantized (simd.h's inputs: the pass a separate kernel would make, saved). */

/* An input row's 32 values from element `at` into v: x's own, or made as rows.c's rms_norm_rows and gated_rows
 * make them (the same f32 operations in the same order, so the same bits). x: the row; scale: its 1 / rms (NORMED). */
static inline void input_block(int input, const float *x, int64_t K, int64_t at, const float *norm_w, __m256 scale, __m256 *v) {
    for (int i = 0; i < 4; i++) {
        const int64_t k = at + 8 * i;
        if (input == NORMED) v[i] = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), scale), _mm256_loadu_ps(norm_w + k));
        else if (IS_GATED(input)) v[i] = gate_mul8(input, _mm256_loadu_ps(x + k), _mm256_loadu_ps(x + K + k));
        else v[i] = _mm256_loadu_ps(x + k);
    }
}

/* 32 floats (v: 4 vectors) -> int8 codes in element order; *d = amax / 127, *sum = sum of the codes */
static inline __m256i quantize_block(const __m256 *v, float *d, int *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 0x55));
    *d = _mm_cvtss_f32(m) / 127.0f;
    const float id = *d != 0.0f ? 1.0f / *d : 0.0f;
    __m256i i32[4];
    for (int i = 0; i < 4; i++) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id))); /* nearest, ties to even */
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    *sum = _mm_cvtsi128_si32(s4);
    /* packs interleave the 128-bit lanes: the permute puts the 32 bytes back in order */
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Q6_K without VNNI takes its codes unsigned (0..63) and subtracts 32 * the x codes' sums at each int16 of the maddubs
 * products' sum (group_dot): accumulator a's four vectors' pairs summed, 32 * (x_2j + x_2j+1), in xc's vector a (xc:
 * the row's xs slot, its second vector 16 floats on). Each int16 of q's products then minus its correction is
 * sum((q - 32) x) over 8 products, within 8 * 32 * 127 < 2^15: exact, however the int16 additions on the way wrap. */
static inline void q6k_sums(const int8_t *xg, float *xc, const int xv) {
    for (int a = 0; a < 2; a++) {
        __m256i s = _mm256_setzero_si256();
#ifdef HAVE_VNNI /* q6k_one's at one row (Q6K_ONE_PLAIN): each int32 lane's 32 * sum(x) */
        for (int k = a; k < NV; k += 2) s = dpbusd256(s, _mm256_set1_epi8(32), _mm256_loadu_si256((const __m256i *)(xg + xv * k)));
#else
        for (int k = a; k < NV; k += 2) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_set1_epi8(32), _mm256_loadu_si256((const __m256i *)(xg + xv * k))));
#endif
        _mm256_storeu_si256((__m256i *)(xc + x_fa(xv) * a), s);
    }
}

/* int8 codes as int16 pairs: a dword's bytes 0 and 2 (even) and 1 and 3 (odd), sign-extended */
static inline __m256i even16(__m256i c) { return _mm256_srai_epi16(_mm256_slli_epi16(c, 8), 8); }
static inline __m256i odd16(__m256i c) { return _mm256_srai_epi16(c, 8); }

/* x16 (Q8_0 without VNNI, several rows): a group's 8 code vectors as int16 pairs whose madd sums each 32-bit lane's
 * four products, as maddubs + madd do: even bytes (sign-extended) then odd, vector v's at 2 XV v, the row's slab as
 * xq's with every offset doubled (a pair's other row 64 bytes on). */
static inline void x16_group(const int8_t *xg, int8_t *out) {
    for (int v = 0; v < NV; v++) {
        const __m256i c = _mm256_loadu_si256((const __m256i *)(xg + XV * v));
        _mm256_storeu_si256((__m256i *)(out + 2 * XV * v), even16(c));
        _mm256_storeu_si256((__m256i *)(out + 2 * XV * v + 32), odd16(c));
    }
}

/* One input row of K = 32 nb values (made from x's row as `input` says), laid out for `type` in ng groups at its
 * slots in its pair (x_slot), the groups' slabs np pairs apart: codes xq (vectors XV bytes apart; a 32-format's short
 * last group packed as pack_tail packs the weights), each group's block d in accumulator-lane order (xd: 8 floats an
 * accumulator, 16 apart) and d * sum(q) in block order (xs: 8 floats, or Q6_K's corrections). Missing blocks are 0.
 * xv: XV, or XC for a row alone (T = 1), in the layout XC's comment gives. */
static void quantize_row(int type, int biased, int xv, int input, const float *x, const float *norm_w, float eps, int64_t nb, int64_t ng,
                         int64_t np, int8_t *xq, float *xd, float *xs, int8_t *x16) {
    const int64_t K = nb * QB;
    const int fa = x_fa(xv);
    const int64_t gq = x_gq(xv, np), gf = x_gf(xv, np);
    const __m256 scale = _mm256_set1_ps(input == NORMED ? inv_rms(x, K, eps) : 0.0f);
    int at[8][8]; /* at[block][chunk]: where a block's elements 4 chunk .. 4 chunk + 3 go in its group */
    for (int v = 0; v < NV; v++)
        for (int L = 0; L < 8; L++) {
            int block, elem;
            x_lane(type, v, L, &block, &elem);
            at[block][elem / 4] = xv * v + 4 * L;
        }
    const __m256i bias = _mm256_set1_epi8(biased ? (char)0x80 : 0);
    for (int64_t g = 0; g < ng; g++) {
        float d[8] = {0};
        int8_t *xg = xq + g * gq;
        const int nv = is_k(type) ? NV : tail_vectors(nb - 8 * g);
        for (int v = 0; v < NV; v++) memset(xg + xv * v, biased ? 0x80 : 0, 32);
        for (int j = 0; j < 8 && 8 * g + j < nb; j++) {
            int sum;
            int8_t codes[QB];
            __m256 v[4];
            input_block(input, x, K, (8 * g + j) * QB, norm_w, scale, v);
            _mm256_storeu_si256((__m256i *)codes, _mm256_xor_si256(quantize_block(v, &d[j], &sum), bias));
            for (int c = 0; c < 8; c++) memcpy(xg + (nv < NV ? xv * (c % nv) + 4 * (c / nv * nv + j) : at[j][c]), codes + 4 * c, 4);
            xs[g * gf + j] = d[j] * (float)sum;
        }
        for (int j = (int)(nb - 8 * g); j < 8; j++) xs[g * gf + j] = 0.0f;
        for (int a = 0; a < 2; a++)
            for (int L = 0; L < 8; L++) xd[g * gf + fa * a + L] = a < num_acc(type) ? d[acc_block(type, a, L)] : 0.0f;
        if (type == Q6_K && !biased) q6k_sums(xg, xs + g * gf, xv);
        if (x16) x16_group(xg, x16 + 2 * g * np * 2 * GB);
    }
}

/* ---- a group of weights, unpacked once for all the rows ---- */

typedef struct {
    __m256i w[NV];   /* codes: unsigned (the 4- and 5-bit formats, Q6_K's q without VNNI) or signed (Q8_0, Q6_K's q - 32) */
    __m256i aw[NV];  /* without VNNI, Q8_0: |w|, against x * sign(w) */
    __m256i sc[2];   /* Q6_K: each lane's 16-element scale, per accumulator (int16 pairs; int32 with VNNI) */
    __m256 dw[2];    /* d_w (Q4_K, Q5_K: d * sc) per accumulator lane */
    __m256 off;      /* offset coefficient per x-block, in block order: -8 d, m, -16 d, -dmin * m */
    __m256i corr[2]; /* with VNNI, signed formats: 128 * each lane's sum of weights, per accumulator */
} group_t;

/* In-lane 4 x 4 transpose of 32-bit lanes: v[k]'s lanes 0-3 are lane k of y[0..3]'s low halves, 4-7 of their high. */
static inline void transpose4(const __m256i *y, __m256i *v) {
    const __m256i t0 = _mm256_unpacklo_epi32(y[0], y[1]), t1 = _mm256_unpackhi_epi32(y[0], y[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(y[2], y[3]), t3 = _mm256_unpackhi_epi32(y[2], y[3]);
    v[0] = _mm256_unpacklo_epi64(t0, t2), v[1] = _mm256_unpackhi_epi64(t0, t2);
    v[2] = _mm256_unpacklo_epi64(t1, t3), v[3] = _mm256_unpackhi_epi64(t1, t3);
}
/* The K-formats' 128 code bytes (Q4_K / Q5_K's qs, Q6_K's ql) are held in lane order (formats.py's lanes_): vector i
 * holds, in 32-bit lane k of each 128-bit half, ggml's vector k's dword i of that half, so the dot products load their
 * vectors as they are. Ggml's four vectors (each 32 bytes in element order) from them: their transpose, its own inverse. */
static inline void ggml_vectors(const uint8_t *codes, __m256i *y) {
    __m256i v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_si256((const __m256i *)(codes + 32 * i));
    transpose4(v, y);
}

static inline __m256i load_pair(const uint8_t *lo, const uint8_t *hi) {
    return _mm256_set_m128i(_mm_loadu_si128((const __m128i *)hi), _mm_loadu_si128((const __m128i *)lo));
}

/* Q5_0 / Q5_1: 0x10 in byte e of lane L where bit 4v + e of h's lane L (block L's qh) is set */
static inline __m256i q5_bits(__m256i h, int v) {
    const __m256i pick = _mm256_add_epi8(_mm256_set1_epi8((char)(v / 2)), _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0, 0x04040404,
                                                                                          0x08080808, 0x0c0c0c0c));
    const __m256i s = _mm256_shuffle_epi8(h, pick), bit = _mm256_set1_epi32(v & 1 ? (int)0x80402010 : 0x08040201);
#ifdef HAVE_BW
    return _mm256_maskz_mov_epi8(_mm256_test_epi8_mask(s, bit), _mm256_set1_epi8(0x10));
#else
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(s, bit), bit), _mm256_set1_epi8(0x10));
#endif
}

/* Q5_K: the fifth bits for vectors 2i, 2i + 1 (lane L: sub-blocks 2 (L % 4) and 2 (L % 4) + 1, elements l of dword
 * i + 4 (L / 4)): bits 2 (L % 4) and 2 (L % 4) + 1 of qh[l], moved to bit 4 of w0 and w1 */
static inline __attribute__((always_inline)) void q5k_bits(__m256i qh, const int i, __m256i *w0, __m256i *w1) {
    const __m256i g = i == 0 ? _mm256_shuffle_epi32(qh, 0x00) : i == 1 ? _mm256_shuffle_epi32(qh, 0x55)
                    : i == 2 ? _mm256_shuffle_epi32(qh, 0xaa) : _mm256_shuffle_epi32(qh, 0xff);
    const __m256i s = _mm256_srlv_epi32(g, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    *w0 = _mm256_or_si256(*w0, _mm256_and_si256(_mm256_slli_epi32(s, 4), _mm256_set1_epi8(0x10)));
    *w1 = _mm256_or_si256(*w1, _mm256_and_si256(_mm256_slli_epi32(s, 3), _mm256_set1_epi8(0x10)));
}

/* Q4_K / Q5_K's d * sc per accumulator lane (accumulator 0: sub-blocks 0 2 4 6, 1: 1 3 5 7) */
static inline void k_dw(__m256 dsc, __m256 *dw) {
    dw[0] = _mm256_permutevar8x32_ps(dsc, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    dw[1] = _mm256_permutevar8x32_ps(dsc, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7));
}

/* Q6_K: vectors 2i, 2i + 1 as q (0..63) from ql's nibbles (v: transposed) and qh's bit pairs (ulo, uhi: qh's two
 * halves' dwords interleaved; lane L's half its dword pair) */
static inline __attribute__((always_inline)) void q6k_codes(__m256i v, __m256i ulo, __m256i uhi, const int i, __m256i *lo, __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(15);
    const __m256i g = i == 0 ? _mm256_shuffle_epi32(ulo, 0x50) : i == 1 ? _mm256_shuffle_epi32(ulo, 0xfa)
                    : i == 2 ? _mm256_shuffle_epi32(uhi, 0x50) : _mm256_shuffle_epi32(uhi, 0xfa);
    const __m256i s = _mm256_srlv_epi32(g, _mm256_setr_epi32(0, 2, 0, 2, 0, 2, 0, 2));
    *lo = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_slli_epi32(s, 4), _mm256_set1_epi8(0x30)));
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), _mm256_and_si256(s, _mm256_set1_epi8(0x30)));
}

#ifndef HAVE_VNNI
/* Q6_K's 16-element scales (q: the superblock's 16 bytes of them) for accumulator a's lanes (lane L: sub-block
 * 2 * block + L / 4) as int16 pairs */
static inline __attribute__((always_inline)) __m256i q6k_scales(__m128i q, const int a) {
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(q, a == 0 ? _mm_setr_epi8(0, 0, 2, 2, 8, 8, 10, 10, 1, 1, 3, 3, 9, 9, 11, 11)
                                                           : _mm_setr_epi8(4, 4, 6, 6, 12, 12, 14, 14, 5, 5, 7, 7, 13, 13, 15, 15)));
}
#endif

static const uint8_t zero_block[34]; /* what a row's short last group reads for its missing blocks */

/* The signed formats' parts of a group of nv vectors: with VNNI, 128 * each lane's sum of weights per accumulator;
 * without, |w| */
static inline __attribute__((always_inline)) void sign_parts(const int type, const int nv, group_t *g) {
#ifdef HAVE_VNNI
    if (type == Q8_0 || type == Q6_K) {
        for (int a = 0; a < num_acc(type); a++) {
            __m256i sum = _mm256_setzero_si256();
            for (int k = a; k < nv; k += num_acc(type)) sum = dpbusd256(sum, _mm256_set1_epi8(1), g->w[k]);
            g->corr[a] = _mm256_slli_epi32(sum, 7);
        }
    }
#else
    if (type == Q8_0)
        for (int k = 0; k < nv; k++) g->aw[k] = _mm256_abs_epi8(g->w[k]);
#endif
}

/* A row's short last group of m <= 4 blocks (a 32-format's; m 1 .. 7): what its 8 vectors hold in their live lanes
 * (blocks 0 .. m - 1), packed into nv = 2 (m <= 2) or 4 (m <= 4) vectors, so that a row's products with it take nv
 * dot products instead of 8 (SmolLM2's 576 inputs are 2 groups and 2 blocks: a quarter of its products were zero
 * blocks'). Vector k's lanes 0 .. nv - 1 go to lanes (k / nv) nv .. of vector k % nv; x's tail is stored alike
 * (quantize_row), and a row's int32 sums are folded back onto lanes 0 .. nv - 1 (fold) before anything else: the same
 * integers, so the same bits. */
static inline __attribute__((always_inline)) void pack_tail(const int nv, group_t *g) {
    for (int j = 0; j < nv; j++)
        g->w[j] = nv == 4 ? _mm256_permute2x128_si256(g->w[j], g->w[j + 4], 0x20)
                          : _mm256_permute2x128_si256(_mm256_unpacklo_epi64(g->w[j], g->w[j + 2]), _mm256_unpacklo_epi64(g->w[j + 4], g->w[j + 6]), 0x20);
}

/* The group at b: one K-format superblock, or m 32-format blocks `bytes` apart (m < 8: a row's last group, the rest
 * read as zero blocks, packed into nv = tail_vectors(m) vectors; m and nv are constants 8 for the others, so the
 * choices fold away). */
static inline __attribute__((always_inline)) void unpack_group(const int type, const uint8_t *b, int64_t bytes, const int m, const int nv,
                                                               group_t *g) {
#define BLK(j) ((j) < m ? b + (j) * bytes : zero_block)
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256i y[4], v[4];
    if (type == Q8_0 && nv < NV) { /* a last group of 1 .. 4 blocks: pack_tail's vectors made from those blocks alone */
        __m128i hd = _mm_setzero_si128();
        for (int j = 0; j < nv; j++) hd = _mm_insert_epi16(hd, rd16(BLK(j)), j);
        g->dw[0] = _mm256_cvtph_ps(hd);
        if (nv == 4) { /* vector k: chunk k (codes 4k .. 4k + 3) of blocks 0-3, then chunk k + 4 of each */
            for (int c = 0; c < 4; c++) y[c] = _mm256_loadu_si256((const __m256i *)(BLK(c) + 2));
            transpose4(y, g->w);
        } else { /* each block's chunks in the order 0 2 1 3 per 128-bit half, the two blocks' interleaved: vector 0
                  * [b0 c0, b1 c0, b0 c2, b1 c2 | the same of c4, c6], vector 1 the odd chunks */
            const __m256i c0 = _mm256_shuffle_epi32(_mm256_loadu_si256((const __m256i *)(BLK(0) + 2)), 0xd8);
            const __m256i c1 = _mm256_shuffle_epi32(_mm256_loadu_si256((const __m256i *)(BLK(1) + 2)), 0xd8);
            g->w[0] = _mm256_unpacklo_epi32(c0, c1), g->w[1] = _mm256_unpackhi_epi32(c0, c1);
        }
        sign_parts(type, nv, g);
        return;
    }
    if (type == Q4_K || type == Q5_K) {
        __m256 dsc, dmin_m;
        k_scales(b, &dsc, &dmin_m);
        g->off = _mm256_sub_ps(_mm256_setzero_ps(), dmin_m);
        k_dw(dsc, g->dw);
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_si256((const __m256i *)(k_codes(type, b) + 32 * i)); /* lane order */
        for (int i = 0; i < 4; i++) {
            g->w[2 * i] = _mm256_and_si256(v[i], low4);
            g->w[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v[i], 4), low4);
        }
        if (type == Q5_K) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
            for (int i = 0; i < 4; i++) q5k_bits(qh, i, &g->w[2 * i], &g->w[2 * i + 1]);
        }
    } else if (type == Q6_K) {
        g->dw[0] = g->dw[1] = _mm256_set1_ps(f16(b + 208));
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_si256((const __m256i *)(b + 32 * i)); /* lane order */
        const __m256i h0 = _mm256_loadu_si256((const __m256i *)(b + 128)), h1 = _mm256_loadu_si256((const __m256i *)(b + 160));
        const __m256i ulo = _mm256_unpacklo_epi32(h0, h1), uhi = _mm256_unpackhi_epi32(h0, h1);
        for (int i = 0; i < 4; i++) {
            q6k_codes(v[i], ulo, uhi, i, &g->w[2 * i], &g->w[2 * i + 1]);
#ifdef HAVE_VNNI /* as q - 32 for dpbusd; without, maddubs takes them unsigned and group_dot subtracts the 32s from the sums */
            g->w[2 * i] = _mm256_sub_epi8(g->w[2 * i], _mm256_set1_epi8(32));
            g->w[2 * i + 1] = _mm256_sub_epi8(g->w[2 * i + 1], _mm256_set1_epi8(32));
#endif
        }
#ifdef HAVE_VNNI /* lane L of accumulator a: sub-block 2 * block + L / 4 */
        const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
        g->sc[0] = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 8, 10, 1, 3, 9, 11, 0, 0, 0, 0, 0, 0, 0, 0)));
        g->sc[1] = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc, _mm_setr_epi8(4, 6, 12, 14, 5, 7, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0)));
#else
        for (int a = 0; a < 2; a++) g->sc[a] = q6k_scales(_mm_loadu_si128((const __m128i *)(b + 192)), a);
#endif
    } else {
        /* eight blocks: their d (and m) lane by lane (eight 2-byte stores read back as a vector would stall store
         * forwarding), their codes transposed so that lane L is block L's */
        __m128i hd = _mm_setzero_si128(), hm = _mm_setzero_si128();
        const int with_m = type == Q4_1 || type == Q5_1;
#define LANE(j)                                                      \
    hd = _mm_insert_epi16(hd, rd16(BLK(j)), j);                      \
    if (with_m) hm = _mm_insert_epi16(hm, rd16(BLK(j) + 2), j);
        LANE(0) LANE(1) LANE(2) LANE(3) LANE(4) LANE(5) LANE(6) LANE(7)
#undef LANE
        g->dw[0] = _mm256_cvtph_ps(hd);
        if (with_m) g->off = _mm256_cvtph_ps(hm);
        else if (type == Q4_0) g->off = _mm256_mul_ps(g->dw[0], _mm256_set1_ps(-8.0f));
        else if (type == Q5_0) g->off = _mm256_mul_ps(g->dw[0], _mm256_set1_ps(-16.0f));
        if (type == Q8_0) {
            for (int p = 0; p < 4; p++) y[p] = load_pair(BLK(p) + 2, BLK(p + 4) + 2);
            transpose4(y, g->w);
            for (int p = 0; p < 4; p++) y[p] = load_pair(BLK(p) + 18, BLK(p + 4) + 18);
            transpose4(y, g->w + 4);
        } else {
            const int qs = type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
            for (int p = 0; p < 4; p++) y[p] = load_pair(BLK(p) + qs, BLK(p + 4) + qs);
            transpose4(y, v);
            for (int k = 0; k < 4; k++) {
                g->w[k] = _mm256_and_si256(v[k], low4);
                g->w[k + 4] = _mm256_and_si256(_mm256_srli_epi16(v[k], 4), low4);
            }
            if (type == Q5_0 || type == Q5_1) {
                const int qh = type == Q5_0 ? 2 : 4;
                const __m256i h = _mm256_setr_epi32((int)rd32(BLK(0) + qh), (int)rd32(BLK(1) + qh), (int)rd32(BLK(2) + qh), (int)rd32(BLK(3) + qh),
                                                    (int)rd32(BLK(4) + qh), (int)rd32(BLK(5) + qh), (int)rd32(BLK(6) + qh), (int)rd32(BLK(7) + qh));
                for (int k = 0; k < NV; k++) g->w[k] = _mm256_or_si256(g->w[k], q5_bits(h, k));
            }
        }
    }
    if (nv < NV) pack_tail(nv, g);
    sign_parts(type, nv, g);
#undef BLK
}

static inline __m256i fold(__m256i s, const int nv) {
    if (nv <= 4) s = _mm256_add_epi32(s, _mm256_permute2x128_si256(s, s, 0x01));
    if (nv <= 2) s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0x4e));
    return s;
}

/* A row's products with the group: per accumulator, each lane's int32 sum -> f32 (exact: under 2^24) * d_w * d_x;
 * the first accumulator's start from the offset term; the two added. xg: the row's codes for the group, d: its
 * d per accumulator lane, os: offset * its d * sum(q), xc: Q6_K's corrections without VNNI (q6k_sums). Without VNNI
 * the maddubs pairs add up in int16 as far as they cannot overflow (x codes are within +-127: 4-bit codes 8 vectors,
 * 5-bit 4, Q8_0's 1; Q6_K's q - 32 all 4, q6k_sums).
 * The integer sums are exact and the f32 steps the same in both builds: they give the same bits. (512-bit dpbusd,
 * two vectors of one row at a time, measured no faster on Sapphire Rapids: pairing the vectors costs what it saves;
 * two rows at a time, pair_dot, needs no pairing.) */
static inline __attribute__((always_inline)) __m256 group_dot(const int type, const int nv, const group_t *g, const int8_t *xg, const float *d,
                                                             __m256 os, const float *xc, const int xv) {
    const int na = num_acc(type), fa = x_fa(xv);
#define X(k) _mm256_loadu_si256((const __m256i *)(xg + xv * (k)))
    __m256 part[2];
    for (int a = 0; a < na; a++) {
        __m256i s = _mm256_setzero_si256();
#ifdef HAVE_VNNI
        const int sign = type == Q8_0 || type == Q6_K;
        for (int k = a; k < nv; k += na) s = sign ? dpbusd256(s, X(k), g->w[k]) : dpbusd256(s, g->w[k], X(k));
        if (sign) s = _mm256_sub_epi32(s, g->corr[a]);
        if (type == Q6_K) s = _mm256_mullo_epi32(s, g->sc[a]);
        (void)xc;
#else
        const __m256i ones = _mm256_set1_epi16(1);
        /* each sum a chain, as written: gcc's tree of a row's products, unrolled over the rows, spills */
        if (type == Q8_0) {
            for (int k = 0; k < nv; k++) {
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(g->aw[k], _mm256_sign_epi8(X(k), g->w[k])), ones));
                __asm__("" : "+x"(s));
            }
        } else if (type == Q6_K) { /* q (0..63) times x, the four vectors' int16 sums less 32 sum(x) (q6k_sums), times sc */
            const __m256i lo = _mm256_add_epi16(_mm256_maddubs_epi16(g->w[a], X(a)), _mm256_maddubs_epi16(g->w[a + 2], X(a + 2)));
            const __m256i hi = _mm256_add_epi16(_mm256_maddubs_epi16(g->w[a + 4], X(a + 4)), _mm256_maddubs_epi16(g->w[a + 6], X(a + 6)));
            s = _mm256_madd_epi16(_mm256_sub_epi16(_mm256_add_epi16(lo, hi), _mm256_loadu_si256((const __m256i *)(xc + fa * a))), g->sc[a]);
        } else {
            const int run = type == Q4_0 || type == Q4_1 || type == Q4_K ? 8 : 4; /* vectors per int16 sum */
            for (int k0 = a; k0 < nv; k0 += run * na) {
                __m256i s16 = _mm256_setzero_si256();
                for (int k = k0; k < nv && k < k0 + run * na; k += na) {
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(g->w[k], X(k)));
                    __asm__("" : "+x"(s16));
                }
                s = _mm256_add_epi32(s, _mm256_madd_epi16(s16, ones));
            }
        }
#endif
        if (nv < NV) s = fold(s, nv);
        part[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(g->dw[a], _mm256_loadu_ps(d + fa * a)), a == 0 ? os : _mm256_setzero_ps());
    }
    return na == 1 ? part[0] : _mm256_add_ps(part[0], part[1]);
#undef X
}

#ifndef HAVE_VNNI
/* Q6_K at one x row without VNNI: unpack_group's codes and group_dot's sums a vector pair at a time, each pair's
 * products taken as it is made (the same integers, then the same f32 steps: the same bits). Made whole first, the
 * group's eight vectors, its scales and the accumulator spilled to the stack at one row. */
static inline __attribute__((always_inline)) __m256 q6k_one(const uint8_t *b, const int8_t *xg, const float *d, const float *xc, const int xv) {
    const int fa = x_fa(xv);
    __m256i v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_si256((const __m256i *)(b + 32 * i)); /* lane order */
    const __m256i h0 = _mm256_loadu_si256((const __m256i *)(b + 128)), h1 = _mm256_loadu_si256((const __m256i *)(b + 160));
    const __m256i ulo = _mm256_unpacklo_epi32(h0, h1), uhi = _mm256_unpackhi_epi32(h0, h1);
    __m256i sum[2]; /* accumulator a's int16 sums less its corrections (q6k_sums) */
    for (int i = 0; i < 4; i++) {
        __m256i lo, hi;
        q6k_codes(v[i], ulo, uhi, i, &lo, &hi);
        const __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(xg + xv * (2 * i))));
        const __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xg + xv * (2 * i + 1))));
        if (i == 0) sum[0] = _mm256_sub_epi16(p0, _mm256_loadu_si256((const __m256i *)xc)), sum[1] = _mm256_sub_epi16(p1, _mm256_loadu_si256((const __m256i *)(xc + fa)));
        else sum[0] = _mm256_add_epi16(sum[0], p0), sum[1] = _mm256_add_epi16(sum[1], p1);
    }
    const __m128i scales = _mm_loadu_si128((const __m128i *)(b + 192));
    const __m256 dw = _mm256_set1_ps(f16(b + 208));
    __m256 part[2];
    for (int a = 0; a < 2; a++) {
        const __m256i s = _mm256_madd_epi16(sum[a], q6k_scales(scales, a));
        part[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_loadu_ps(d + fa * a)), _mm256_setzero_ps());
    }
    return _mm256_add_ps(part[0], part[1]);
}

#endif

#ifndef HAVE_VNNI512
/* Q4_K / Q5_K at one x row without AVX-512, likewise: each vector pair's codes (and Q5_K's fifth bits) made and their
 * products added into the accumulator's sum at once (int16 without VNNI, int32 with AVX-VNNI's dpbusd), then
 * group_dot's steps (Q5_K's made whole spilled). */
static inline __attribute__((always_inline)) __m256 k45_one(const int type, const uint8_t *b, const int8_t *xg, const float *d, const float *xs,
                                                            const int xv) {
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256 dsc, dmin_m;
    k_scales(b, &dsc, &dmin_m);
    __m256i v[4], sum[2];
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_si256((const __m256i *)(k_codes(type, b) + 32 * i)); /* lane order */
    const __m256i qh = type == Q5_K ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        __m256i w0 = _mm256_and_si256(v[i], low4), w1 = _mm256_and_si256(_mm256_srli_epi16(v[i], 4), low4);
        if (type == Q5_K) q5k_bits(qh, i, &w0, &w1);
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xg + xv * (2 * i))), x1 = _mm256_loadu_si256((const __m256i *)(xg + xv * (2 * i + 1)));
#ifdef HAVE_VNNI
        sum[0] = dpbusd256(i ? sum[0] : _mm256_setzero_si256(), w0, x0);
        sum[1] = dpbusd256(i ? sum[1] : _mm256_setzero_si256(), w1, x1);
#else
        const __m256i p0 = _mm256_maddubs_epi16(w0, x0), p1 = _mm256_maddubs_epi16(w1, x1);
        sum[0] = i ? _mm256_add_epi16(sum[0], p0) : p0;
        sum[1] = i ? _mm256_add_epi16(sum[1], p1) : p1;
#endif
    }
#ifndef HAVE_VNNI
    for (int a = 0; a < 2; a++) sum[a] = _mm256_madd_epi16(sum[a], _mm256_set1_epi16(1));
#endif
    __m256 dw[2];
    k_dw(dsc, dw);
    /* group_dot's fma(.., .., -dmin_m * xs): the negation exact, so this fmsub's bits */
    const __m256 part0 = _mm256_fmsub_ps(_mm256_cvtepi32_ps(sum[0]), _mm256_mul_ps(dw[0], _mm256_loadu_ps(d)), _mm256_mul_ps(dmin_m, _mm256_loadu_ps(xs)));
    const __m256 part1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[1]), _mm256_mul_ps(dw[1], _mm256_loadu_ps(d + x_fa(xv))), _mm256_setzero_ps());
    return _mm256_add_ps(part0, part1);
}
#endif

#ifndef HAVE_VNNI

/* Q8_0 at one x row without VNNI, likewise: eight blocks' d, then each half of their codes transposed and its products
 * taken (block L's in lane L, summed in int32 in any order: the same integers), then group_dot's f32 steps. */
static inline __attribute__((always_inline)) __m256 q80_one(const uint8_t *b, int64_t bytes, const int8_t *xg, const float *d, const int xv) {
    __m128i hd = _mm_setzero_si128();
#define LANE(j) hd = _mm_insert_epi16(hd, rd16(b + (j) * bytes), j);
    LANE(0) LANE(1) LANE(2) LANE(3) LANE(4) LANE(5) LANE(6) LANE(7)
#undef LANE
    __m256i s = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        __m256i y[4], w[4];
        for (int p = 0; p < 4; p++) y[p] = load_pair(b + p * bytes + 2 + 16 * h, b + (p + 4) * bytes + 2 + 16 * h);
        transpose4(y, w);
        for (int k = 0; k < 4; k++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xg + xv * (4 * h + k)));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w[k]), _mm256_sign_epi8(x, w[k])), _mm256_set1_epi16(1)));
        }
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(_mm256_cvtph_ps(hd), _mm256_loadu_ps(d)), _mm256_setzero_ps());
}
#endif

#if defined(HAVE_VNNI) && !defined(HAVE_VNNI512)
/* AVX-VNNI (16 vector registers) at one x row, the K-formats: as the functions above, each vector's codes made and
 * its dpbusd taken at once, where unpack_group's whole group spilled; the same integer sums and group_dot's f32 steps
 * (the same bits). Q6_K takes its codes unsigned against x as it is, less 32 * each lane's sum of x (Q6K_ONE_PLAIN).
 * Cache-resident, one thread (bench/kernels_vs_llamacpp.py --kernel avx2+vnni, Sapphire Rapids): Q6_K 0.75-0.80x
 * llama.cpp's AVX-VNNI build -> 0.86-0.89x (x biased, the codes' sums by dpbusd alongside; plain x then took 0.84-0.86x
 * that time, bench/rows_kernel.py --dims), Q5_K 1.02-1.08x -> 1.12-1.17x; Q8_0's likewise measured slower than the
 * group's path, so it keeps that. */
static inline __attribute__((always_inline)) __m256 q6k_one(const uint8_t *b, const int8_t *xg, const float *d, const float *xc, const int xv) {
    const int fa = x_fa(xv);
    __m256i v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_si256((const __m256i *)(b + 32 * i)); /* lane order */
    const __m256i h0 = _mm256_loadu_si256((const __m256i *)(b + 128)), h1 = _mm256_loadu_si256((const __m256i *)(b + 160));
    const __m256i ulo = _mm256_unpacklo_epi32(h0, h1), uhi = _mm256_unpackhi_epi32(h0, h1);
    __m256i sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int i = 0; i < 4; i++) {
        __m256i lo, hi;
        q6k_codes(v[i], ulo, uhi, i, &lo, &hi);
        sum[0] = dpbusd256(sum[0], lo, _mm256_loadu_si256((const __m256i *)(xg + xv * (2 * i))));
        sum[1] = dpbusd256(sum[1], hi, _mm256_loadu_si256((const __m256i *)(xg + xv * (2 * i + 1))));
    }
    const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
    const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 8, 10, 1, 3, 9, 11, 0, 0, 0, 0, 0, 0, 0, 0)));
    const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc, _mm_setr_epi8(4, 6, 12, 14, 5, 7, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0)));
    const __m256 dw = _mm256_set1_ps(f16(b + 208));
    __m256 part[2];
    for (int a = 0; a < 2; a++) {
        const __m256i s = _mm256_mullo_epi32(_mm256_sub_epi32(sum[a], _mm256_loadu_si256((const __m256i *)(xc + fa * a))), a ? sc1 : sc0);
        part[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_loadu_ps(d + fa * a)), _mm256_setzero_ps());
    }
    return _mm256_add_ps(part[0], part[1]);
}

#endif

#ifdef HAVE_VNNI512
typedef __m512 pair_acc; /* a pair of x rows' accumulators, the first row's in the low half */

/* A group's weights in both halves of 512-bit vectors, for a pair of x rows at a time */
typedef struct {
    __m512i w[NV], sc[2], corr[2];
    __m512 dw[2], off;
} group2_t;

static inline __m512 both_ps(__m256 v) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v))); }

static inline __attribute__((always_inline)) void widen_group(const int type, const int nv, const group_t *g, group2_t *z) {
    for (int k = 0; k < nv; k++) z->w[k] = _mm512_broadcast_i64x4(g->w[k]);
    for (int a = 0; a < num_acc(type); a++) {
        z->dw[a] = both_ps(g->dw[a]);
        if (type == Q6_K) z->sc[a] = _mm512_broadcast_i64x4(g->sc[a]);
        if (type == Q8_0 || type == Q6_K) z->corr[a] = _mm512_broadcast_i64x4(g->corr[a]);
    }
    if (has_offset(type)) z->off = both_ps(g->off);
}

/* group_dot for a pair of rows, the first in the low half: the same operations lane for lane, so the same bits, in
 * half the instructions (on Zen 4 a 512-bit dpbusd measured about as quick as a 256-bit one). xg, d, xs: the pair's. */
static inline __attribute__((always_inline)) __m512 pair_dot(const int type, const int nv, const group2_t *z, const int8_t *xg, const float *d,
                                                            const float *xs) {
    const int na = num_acc(type), sign = type == Q8_0 || type == Q6_K;
    const __m512 os = has_offset(type) ? _mm512_mul_ps(z->off, _mm512_loadu_ps(xs)) : _mm512_setzero_ps();
    __m512 part[2];
    for (int a = 0; a < na; a++) {
        __m512i s = _mm512_setzero_si512();
        for (int k = a; k < nv; k += na) {
            const __m512i x = _mm512_loadu_si512(xg + XV * k);
            s = sign ? _mm512_dpbusd_epi32(s, x, z->w[k]) : _mm512_dpbusd_epi32(s, z->w[k], x);
        }
        if (sign) s = _mm512_sub_epi32(s, z->corr[a]);
        if (type == Q6_K) s = _mm512_mullo_epi32(s, z->sc[a]);
        if (nv <= 4) s = _mm512_add_epi32(s, _mm512_shuffle_i64x2(s, s, 0xb1)); /* fold, in each row's half */
        if (nv <= 2) s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, 0x4e));
        part[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(z->dw[a], _mm512_loadu_ps(d + 16 * a)), a == 0 ? os : _mm512_setzero_ps());
    }
    return na == 1 ? part[0] : _mm512_add_ps(part[0], part[1]);
}
#else
typedef __m256 pair_acc; /* unused: without AVX-512 each row goes alone */
#endif

#ifndef HAVE_VNNI
/* From this many rows a chunk takes q80_rows; fewer keep the sign trick, whose x needs no second copy (rows_kernel.py,
 * Zen 4, avx2+fma: 2 and 4 rows 5-10% slower through q80_rows, 8 and 16 rows 12% faster) */
#define Q80_WIDE_MIN 6
/* Q8_0 without VNNI, n <= GROUP x rows against a group, from x's int16 pairs (x16_group): vector by vector, each
 * vector's codes made int16 pairs once for all n rows, whose int32 sums stay in registers. Two madds a vector and row
 * where the sign trick takes sign + maddubs + madd, all three on the two pipes that multiply on AMD Zen (a pair of
 * rows' product 1.57 -> 1.23 cycles per 32 codes there). The same integers, then group_dot's f32 steps: the same bits. */
static inline __attribute__((always_inline)) void q80_rows(const int n, const int nv, const group_t *g, const int8_t *x16, const float *xd,
                                                           __m256 *acc) {
    __m256i s[GROUP];
    for (int t = 0; t < n; t++) s[t] = _mm256_setzero_si256();
    for (int k = 0; k < nv; k++) {
        const __m256i even = even16(g->w[k]), odd = odd16(g->w[k]);
        for (int t = 0; t < n; t++) {
            const int8_t *x = x16 + 2 * x_slot(t, GB, 32) + 2 * XV * k;
            s[t] = _mm256_add_epi32(s[t], _mm256_add_epi32(_mm256_madd_epi16(even, _mm256_loadu_si256((const __m256i *)x)),
                                                           _mm256_madd_epi16(odd, _mm256_loadu_si256((const __m256i *)(x + 32)))));
            __asm__("" : "+x"(s[t])); /* s[t] one register: else GCC 12 keeps a sum and its copy, and spills two sums (-4%) */
        }
    }
    for (int t = 0; t < n; t++) {
        const __m256i f = nv < NV ? fold(s[t], nv) : s[t];
        acc[t] = _mm256_add_ps(acc[t], _mm256_fmadd_ps(_mm256_cvtepi32_ps(f), _mm256_mul_ps(g->dw[0], _mm256_loadu_ps(xd + x_slot(t, 16, 8))),
                                                       _mm256_setzero_ps()));
    }
}
#endif

/* The n rows (n, type constants; the first of a pair) against group g, added to their accumulators: with VNNI a
 * pair at a time into acc2 (row 2p's in the low half of acc2[p]), an odd last row alone into acc[n - 1]; without,
 * each row alone into acc[t]. Row t's x at its x_slot. */
static inline __attribute__((always_inline)) void group_rows(const int type, const int n, const int nv, const group_t *grp, const int8_t *xq,
                                                             const float *xd, const float *xs, const int8_t *x16, __m256 *acc, pair_acc *acc2,
                                                             const int xv) {
    int t = 0;
#ifdef HAVE_VNNI512
    if (n >= 2) {
        group2_t z;
        widen_group(type, nv, grp, &z);
#pragma GCC unroll 16
        for (; t + 1 < n; t += 2)
            acc2[t / 2] = _mm512_add_ps(acc2[t / 2], pair_dot(type, nv, &z, xq + x_slot(t, GB, 32), xd + x_slot(t, 16, 8), xs + x_slot(t, 16, 8)));
    }
#else
    (void)acc2;
#endif
#ifndef HAVE_VNNI
    if (type == Q8_0 && n >= Q80_WIDE_MIN) {
        if (n > GROUP) q80_rows(GROUP, nv, grp, x16, xd, acc), q80_rows(n - GROUP, nv, grp, x16 + 2 * x_slot(GROUP, GB, 32), xd + x_slot(GROUP, 16, 8), acc + GROUP);
        else q80_rows(n, nv, grp, x16, xd, acc);
        return;
    }
#else
    (void)x16;
#endif
#pragma GCC unroll 16
    for (; t < n; t++) {
        const __m256 os = has_offset(type) ? _mm256_mul_ps(grp->off, _mm256_loadu_ps(xs + x_slot(t, 16, 8))) : _mm256_setzero_ps();
        acc[t] = _mm256_add_ps(acc[t], group_dot(type, nv, grp, xq + x_slot(t, GB, 32), xd + x_slot(t, 16, 8), os, xs + x_slot(t, 16, 8), xv)); /* xv XC: one row, t = 0 */
    }
}

/* One weight row w (nb x-blocks, ng groups) against n x rows (n and type constants at each call site, so the loops
 * unroll): acc[t] for t < n, the lanes whose sum (hsum) is x row t's product. The next rows' bytes are prefetched
 * PF_DIST ahead: the hardware's prefetcher alone leaves a row's loads waiting on memory while the integer work waits
 * on them. */
static inline __attribute__((always_inline)) void dot_acc(const int type, const int n, const uint8_t *w, int64_t nb, int64_t ng, int64_t np,
                                                          const int8_t *xq, const float *xd, const float *xs, const int8_t *x16, __m256 *acc,
                                                          const int xv) {
    const int64_t bytes = block_bytes(type), full = is_k(type) ? ng : nb / 8;
    const int64_t gq = x_gq(xv, np), gf = x_gf(xv, np);
    pair_acc acc2[WIDE_GROUP / 2];
    group_t grp;
    for (int t = 0; t < n; t++) acc[t] = _mm256_setzero_ps();
#ifdef HAVE_VNNI512
    for (int p = 0; p < n / 2; p++) acc2[p] = _mm512_setzero_ps();
#endif
    const int64_t gbytes = is_k(type) ? bytes : 8 * bytes;
    for (int64_t g = 0; g < full; g++) {
        for (int64_t l = 0; l < gbytes; l += 64) _mm_prefetch((const char *)w + g * gbytes + PF_DIST + l, _MM_HINT_T0);
#ifndef HAVE_VNNI512
        /* one x row: the group's products as its codes are made (Q6_K with AVX-VNNI where x is plain: T = 1, np = 1) */
        if (n == 1 && ((is_k(type) && !(Q6K_ONE_PLAIN && type == Q6_K && np != 1)) || (type == Q8_0 && !x_biased(type)))) {
            const uint8_t *b = w + (is_k(type) ? g : 8 * g) * bytes;
            const int8_t *q = xq + g * gq;
            const float *d = xd + g * gf, *s = xs + g * gf;
#ifdef HAVE_VNNI
            acc[0] = _mm256_add_ps(acc[0], type == Q6_K ? q6k_one(b, q, d, s, xv) : k45_one(type, b, q, d, s, xv));
#else
            acc[0] = _mm256_add_ps(acc[0], type == Q6_K ? q6k_one(b, q, d, s, xv) : type == Q8_0 ? q80_one(b, bytes, q, d, xv) : k45_one(type, b, q, d, s, xv));
#endif
            continue;
        }
#endif
        unpack_group(type, w + (is_k(type) ? g : 8 * g) * bytes, bytes, 8, NV, &grp);
        group_rows(type, n, NV, &grp, xq + g * gq, xd + g * gf, xs + g * gf, x16 ? x16 + 2 * g * np * 2 * GB : NULL, acc, acc2, xv);
    }
    if (full < ng) { /* a 32-format row's short last group, packed where it fits fewer vectors */
        const int m = (int)(nb - 8 * full), nv = tail_vectors(m);
        const int8_t *q = xq + full * gq;
        const float *d = xd + full * gf, *s = xs + full * gf;
        const int8_t *q16 = x16 ? x16 + 2 * full * np * 2 * GB : NULL;
        const uint8_t *b = w + 8 * full * bytes;
        if (nv == 2) unpack_group(type, b, bytes, m, 2, &grp), group_rows(type, n, 2, &grp, q, d, s, q16, acc, acc2, xv);
        else if (nv == 4) unpack_group(type, b, bytes, m, 4, &grp), group_rows(type, n, 4, &grp, q, d, s, q16, acc, acc2, xv);
        else unpack_group(type, b, bytes, m, NV, &grp), group_rows(type, n, NV, &grp, q, d, s, q16, acc, acc2, xv);
    }
#ifdef HAVE_VNNI512
    for (int p = 0; p < n / 2; p++) acc[2 * p] = _mm512_castps512_ps256(acc2[p]), acc[2 * p + 1] = _mm512_extractf32x8_ps(acc2[p], 1);
#endif
}

static inline __attribute__((always_inline)) void dot_rows(const int type, const int n, const uint8_t *w, int64_t nb, int64_t ng, int64_t np,
                                                           const int8_t *xq, const float *xd, const float *xs, const int8_t *x16, float *y,
                                                           int64_t ldy, const float *r, int64_t ldr, const int xv) {
    __m256 acc[WIDE_GROUP];
    dot_acc(type, n, w, nb, ng, np, xq, xd, xs, x16, acc, xv); /* then y[t * ldy] for t < n, plus r[t * ldr] where r is given */
    if (r)
        for (int t = 0; t < n; t++) y[t * ldy] = r[t * ldr] + hsum(acc[t]);
    else
        for (int t = 0; t < n; t++) y[t * ldy] = hsum(acc[t]);
}

typedef void (*row_fn)(const uint8_t *, int64_t, int64_t, const int8_t *, const float *, const float *, const int8_t *, float *, int64_t,
                       const float *, int64_t, int64_t);

/* One weight row against all T x rows: WIDE_GROUP at a time while as many are left, then GROUP at a time. */
#define ROW_FN(NAME, TYPE)                                                                                                 \
    static void NAME(const uint8_t *w, int64_t nb, int64_t ng, const int8_t *xq, const float *xd, const float *xs,         \
                     const int8_t *x16, float *y, int64_t ldy, const float *r, int64_t ldr, int64_t T) {                   \
        const int64_t np = (T + 1) / 2;                                                                                    \
        for (int64_t t0 = 0, n; t0 < T; t0 += n) {                                                                         \
            const int8_t *q = xq + x_slot(t0, GB, 32); /* t0 even: a pair's first row */                                  \
            const float *d = xd + x_slot(t0, 16, 8), *s = xs + x_slot(t0, 16, 8);                                           \
            const int8_t *q16 = x16 ? x16 + 2 * x_slot(t0, GB, 32) : NULL;                                                \
            float *yt = y + t0 * ldy;                                                                                      \
            const float *rt = r ? r + t0 * ldr : NULL;                                                                     \
            n = T - t0 >= WIDE_GROUP ? WIDE_GROUP : T - t0 < GROUP ? T - t0 : GROUP;                    \
            switch (n) {                                                                                                   \
            case 1: dot_rows(TYPE, 1, w, nb, ng, np, q, d, s, q16, yt, ldy, rt, ldr, XV); break;                                          \
            case 2: dot_rows(TYPE, 2, w, nb, ng, np, q, d, s, q16, yt, ldy, rt, ldr, XV); break;                                          \
            case 3: dot_rows(TYPE, 3, w, nb, ng, np, q, d, s, q16, yt, ldy, rt, ldr, XV); break;                                          \
            case 4: dot_rows(TYPE, 4, w, nb, ng, np, q, d, s, q16, yt, ldy, rt, ldr, XV); break;                                          \
            case 5: dot_rows(TYPE, 5, w, nb, ng, np, q, d, s, q16, yt, ldy, rt, ldr, XV); break;                                          \
            case 6: dot_rows(TYPE, 6, w, nb, ng, np, q, d, s, q16, yt, ldy, rt, ldr, XV); break;                                          \
            case 7: dot_rows(TYPE, 7, w, nb, ng, np, q, d, s, q16, yt, ldy, rt, ldr, XV); break;                                          \
            case 8: dot_rows(TYPE, 8, w, nb, ng, np, q, d, s, q16, yt, ldy, rt, ldr, XV); break;                                          \
            default: dot_rows(TYPE, WIDE_GROUP, w, nb, ng, np, q, d, s, q16, yt, ldy, rt, ldr, XV); break;          \
            }                                                                                                              \
        }                                                                                                                  \
    }

ROW_FN(row_q4_0, Q4_0)
ROW_FN(row_q4_1, Q4_1)
ROW_FN(row_q5_0, Q5_0)
ROW_FN(row_q5_1, Q5_1)
ROW_FN(row_q8_0, Q8_0)
ROW_FN(row_q4_k, Q4_K)
ROW_FN(row_q5_k, Q5_K)
ROW_FN(row_q6_k, Q6_K)

/* hsum of four vectors, lane r of the result v[r]'s: the same additions in the same order as hsum's (lo + hi, then
 * lanes 0 + 2 and 1 + 3, then those two), four rows at once. */
static inline __m128 hsum4(const __m256 *v) {
    const __m256 s01 = _mm256_add_ps(_mm256_permute2f128_ps(v[0], v[1], 0x20), _mm256_permute2f128_ps(v[0], v[1], 0x31)); /* [v0 lo+hi | v1's] */
    const __m256 s23 = _mm256_add_ps(_mm256_permute2f128_ps(v[2], v[3], 0x20), _mm256_permute2f128_ps(v[2], v[3], 0x31));
    /* per 128-bit lane (rows 0, 2 low; 1, 3 high): [s_a 0 + 2, s_a 1 + 3, s_b 0 + 2, s_b 1 + 3] */
    const __m256 e = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, 0x44), _mm256_shuffle_ps(s01, s23, 0xee));
    const __m256 h = _mm256_add_ps(_mm256_shuffle_ps(e, e, 0x88), _mm256_shuffle_ps(e, e, 0xdd)); /* [r0, r2, r0, r2 | r1, r3, ..] */
    return _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

typedef void (*one_fn)(const uint8_t *, int64_t, int64_t, int64_t, const int8_t *, const float *, const float *, float *, const float *,
                       int64_t);

/* `count` consecutive weight rows (row_bytes apart) against one x row: y[o] (+ r[o]) for o < count. Each row's lanes
 * as dot_rows takes them, four rows' sums reduced together (hsum4): one call and one reduction's latency per four
 * rows where row_fn paid them per row (SmolLM2's 576-input rows are 18 blocks: its set-up and hsum were a fifth of
 * a row's time). The same bits as row_fn's. */
#define ONE_FN(NAME, TYPE)                                                                                                 \
    static void NAME(const uint8_t *w, int64_t row_bytes, int64_t nb, int64_t ng, const int8_t *xq, const float *xd,      \
                     const float *xs, float *y, const float *r, int64_t count) {                                           \
        int64_t o = 0;                                                                                                     \
        for (; o + 4 <= count; o += 4) {                                                                                   \
            __m256 acc[4];                                                                                                 \
            for (int i = 0; i < 4; i++) dot_acc(TYPE, 1, w + (o + i) * row_bytes, nb, ng, 1, xq, xd, xs, NULL, acc + i, XC); \
            const __m128 s = hsum4(acc);                                                                                   \
            _mm_storeu_ps(y + o, r ? _mm_add_ps(_mm_loadu_ps(r + o), s) : s);                                              \
        }                                                                                                                  \
        for (; o < count; o++) dot_rows(TYPE, 1, w + o * row_bytes, nb, ng, 1, xq, xd, xs, NULL, y + o, 0, r ? r + o : NULL, 0, XC); \
    }

ONE_FN(one_q4_0, Q4_0)
ONE_FN(one_q4_1, Q4_1)
ONE_FN(one_q5_0, Q5_0)
ONE_FN(one_q5_1, Q5_1)
ONE_FN(one_q8_0, Q8_0)
ONE_FN(one_q4_k, Q4_K)
ONE_FN(one_q5_k, Q5_K)
ONE_FN(one_q6_k, Q6_K)

/* A format's kernels: rows (any T) and one (T = 1); both NULL for a type quant_rows does not know. */
typedef struct {
    row_fn rows;
    one_fn one;
} row_kernels;

static row_kernels row_kernel(int type) {
    switch (type) {
    case Q4_0: return (row_kernels){row_q4_0, one_q4_0};
    case Q4_1: return (row_kernels){row_q4_1, one_q4_1};
    case Q5_0: return (row_kernels){row_q5_0, one_q5_0};
    case Q5_1: return (row_kernels){row_q5_1, one_q5_1};
    case Q8_0: return (row_kernels){row_q8_0, one_q8_0};
    case Q4_K: return (row_kernels){row_q4_k, one_q4_k};
    case Q5_K: return (row_kernels){row_q5_k, one_q5_k};
    case Q6_K: return (row_kernels){row_q6_k, one_q6_k};
    default: return (row_kernels){NULL, NULL};
    }
}

/* y[t * ldy + o] = (r[t * ldr + o] +) a[t] . W[o] for W N rows of `type` (K a multiple of its block), y's rows ldy
 * floats apart, r (a residual, or with ldr 0 a bias) added where given, where a
 * is x [T, K] (input PLAIN), RMSNorm(x) * norm_w with epsilon eps (NORMED) or act(gate) * up of x [T, 2K] (GATED: silu, GATED_GELU: gelu);
 * x f32 contiguous. Returns 0, -1 without memory for x's codes, -2 for a type it does not know. */
typedef struct {
    row_fn fn;
    one_fn one; /* T = 1 */
    const float *x, *norm_w, *r;
    const uint8_t *W;
    float *y;
    int8_t *xq, *x16; /* x16: Q8_0's x as int16 pairs (x16_group), where several rows go without VNNI; else NULL */
    float *xd, *xs, eps;
    int64_t T, K, N, ldy, ldr, nb, ng, row_bytes;
    int type, input;
} rows_job;

#define ROWS_PER_ITEM 4          /* output rows per pool item: a few microseconds of work at one x row */
#define SMALL_PRODUCT (1 << 15)  /* fewer multiply-adds than this (a few microseconds): one thread, no hand-off */

static void quantize_item(void *arg, int64_t t) {
    const rows_job *j = arg;
    quantize_row(j->type, x_biased_at(j->type, j->T), j->T == 1 ? XC : XV, j->input, j->x + t * (IS_GATED(j->input) ? 2 * j->K : j->K), j->norm_w, j->eps,
                 j->nb, j->ng, (j->T + 1) / 2, j->xq + x_slot(t, GB, 32), j->xd + x_slot(t, 16, 8), j->xs + x_slot(t, 16, 8),
                 j->x16 ? j->x16 + 2 * x_slot(t, GB, 32) : NULL);
}

static void rows_item(void *arg, int64_t i) {
    const rows_job *j = arg;
    const int64_t end = (i + 1) * ROWS_PER_ITEM < j->N ? (i + 1) * ROWS_PER_ITEM : j->N;
    if (j->T == 1) {
        const int64_t o = i * ROWS_PER_ITEM;
        j->one(j->W + o * j->row_bytes, j->row_bytes, j->nb, j->ng, j->xq, j->xd, j->xs, j->y + o, j->r ? j->r + o : NULL, end - o);
        return;
    }
    for (int64_t o = i * ROWS_PER_ITEM; o < end; o++)
        j->fn(j->W + o * j->row_bytes, j->nb, j->ng, j->xq, j->xd, j->xs, j->x16, j->y + o, j->ldy, j->r ? j->r + o : NULL, j->ldr, j->T);
}

/* y[t * ldy + o] = (r[t * ldr + o] +) a[t] . W[o] for W N rows of `type` (K a multiple of its block), y's rows ldy
 * floats apart, r (a residual, or with ldr 0 a bias) added where given, where a
 * is x [T, K] (input PLAIN), RMSNorm(x) * norm_w with epsilon eps (NORMED) or act(gate) * up of x [T, 2K] (GATED: silu, GATED_GELU: gelu);
 * x f32 contiguous. On pool.c's threads (x's rows, then W's rows by ROWS_PER_ITEM). Returns 0, -1 without memory
 * for x's codes, -2 for a type it does not know. */
int quant_rows(const float *x, const uint8_t *W, float *y, int64_t T, int64_t K, int64_t N, int64_t ldy, int type, int input, const float *norm_w,
               float eps, const float *r, int64_t ldr, int threads) {
    const row_kernels kern = row_kernel(type);
    if (!kern.rows) return -2;
    const int64_t nb = K / QB, ng = (nb + 7) / 8, row_bytes = K / block_elems(type) * block_bytes(type);
    const int64_t slots = (T + 1) / 2 * 2 * ng; /* rows' groups, T rounded up to pairs */
#ifdef HAVE_VNNI
    const int wide = 0;
#else
    const int wide = type == Q8_0 && T >= Q80_WIDE_MIN;
#endif
    /* 64-byte aligned: x's 32-byte vectors never straddle two cache lines (slots * GB, xd's and xs's sizes are multiples of 32) */
    char *buf = aligned_alloc(64, ((size_t)slots * (GB + 32 * sizeof(float) + (wide ? 2 * GB : 0)) + 63) / 64 * 64);
    if (!buf) return -1;
    rows_job job = {.fn = kern.rows, .one = kern.one, .x = x, .norm_w = norm_w, .r = r, .W = W, .y = y, .xq = (int8_t *)buf, .eps = eps,
                    .T = T, .K = K, .N = N, .ldy = ldy, .ldr = ldr, .nb = nb, .ng = ng, .row_bytes = row_bytes, .type = type, .input = input};
    job.xd = (float *)(buf + slots * GB);
    job.xs = job.xd + slots * 16;
    job.x16 = wide ? (int8_t *)(job.xs + slots * 16) : NULL;
    /* up to 31 rows quantized by the caller alone: a hand-off and its barrier cost more than the rows (a step of 8 or 16
     * decode rows +7%, SmolLM2 Q8_0 avx2+fma, 2 threads; was 8) */
    pool_for(T, T >= 32 ? threads : 1, quantize_item, &job);
    pool_for((N + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM, T * N * K >= SMALL_PRODUCT ? threads : 1, rows_item, &job);
    free(buf);
    return 0;
}

/* ---- many rows at once: an int8 GEMM (prompt chunks where the CPU has no bf16 units) ----
 *
 * gemm_rows: quant_rows' product for many x rows: x quantized per 32 inputs exactly as there (quantize_block: the
 * same codes and d, so the same error bound), the integer sums the same exact numbers; the f32 steps after them go
 * in another order (per block rather than per group), so a row's result is within f32 rounding of quant_rows', and
 * depends on its own row only (not on T, the rows beside it, the threads or the build).
 *
 * A pool item is a panel of GM_NR weight rows. Its codes are unpacked once into a scratch in the layout the
 * microkernel reads: per 32-block, 8 steps of 32 bytes, step s holding codes 4s .. 4s + 3 of each of the panel's rows
 * (an 8 x 8 transpose of dwords); beside them, per block, the rows' scales (d, or a K-format's d * sc) and offsets
 * (Q4_0's -8 d, Q5_0's -16 d, Q4_1 / Q5_1's m, Q4_K / Q5_K's -dmin * m). Then every GM_MR x rows run over it: each
 * step's 32 bytes against each x row's 4 codes broadcast, u8 codes times s8 x (maddubs; the signed formats Q8_0 and
 * Q6_K as |w| times x * sign(w), or with VNNI biased: gm_biased), summed in int16 for as many steps as cannot overflow (15 * 127 * 2 * 8 < 2^15),
 * then in int32 lanes, one per weight row (VNNI: dpbusd, straight into int32), converted once per block (per 16
 * inputs for Q6_K, whose scales are per 16) and scaled by d_w * d_x into an f32 accumulator per x row; an offset
 * comes in as offset * (d_x * sum(q_x)) once per block. Formats whose sums fit a register for the whole block take
 * two panels an item (gm_pairs: each x broadcast feeds both; 3 x rows a tile), +25-30% at 128-512 rows on AVX2.
 */
#define GM_MR 4 /* x rows per tile: 4 f32 accumulators, 4 int16 and 4 int32 sums in 16 AVX2 registers */
#define GM_NR 8 /* weight rows per panel: one f32 vector of outputs */

static inline int gm_signed(int type) { return type == Q8_0 || type == Q6_K; }
/* steps (4 codes each) whose maddubs pairs can add up in int16: u8 code max * 127 * 2 * steps < 2^15 */
static inline int gm_flush(int type) {
    switch (type) {
    case Q4_0: case Q4_1: case Q4_K: return 8; /* 15 */
    case Q5_0: case Q5_1: case Q5_K: return 4; /* 31 */
    case Q6_K: return 4;                       /* |q - 32| <= 32 */
    default: return 1;                         /* Q8_0: |q| <= 128 */
    }
}
static inline int gm_scales(int type) { return type == Q6_K ? 2 : 1; } /* scales per 32-block */
/* With VNNI the signed formats' codes go in biased, unsigned (Q8_0's w + 128, Q6_K's q), as dpbusd's unsigned operand,
 * and bias * the x codes' sum over each scale's inputs comes off every sum: the same integers, without the sign
 * trick's two instructions per row and step (and Q8_0 then in panel pairs): a Q8_0 GEMM 2.0-2.3x quicker on avx2+vnni,
 * 1.6-1.7x on avx512+vnni (Sapphire Rapids). */
static inline int gm_biased(int type) {
#ifdef HAVE_VNNI
    return gm_signed(type);
#else
    (void)type;
    return 0;
#endif
}
static inline int gm_bias(int type) { return type == Q8_0 ? 128 : 32; }
/* Q8_0 without VNNI multiplies int16 pairs instead (gm_wide): the panel's codes sign-extended at unpacking, each step
 * an even vector (a row's codes 4s and 4s + 2 in its dword) and an odd one (4s + 1, 4s + 3), x's codes kept as int16
 * in that order (x16); a step and row is then two vpmaddwd where the sign trick takes vpsignb, vpmaddubsw, vpmaddwd,
 * all on the pipes that multiply (AMD Zen). The same integer sums: the same bits. */
static inline int gm_wide(int type) {
#ifdef HAVE_VNNI
    (void)type;
    return 0;
#else
    return type == Q8_0;
#endif
}

/* 8 rows' dwords transposed: r[s] holds dword s of each of the 8 rows, row i in dword i */
static inline void transpose8_epi32(__m256i *r) {
    const __m256 a0 = _mm256_unpacklo_ps(_mm256_castsi256_ps(r[0]), _mm256_castsi256_ps(r[1]));
    const __m256 a1 = _mm256_unpackhi_ps(_mm256_castsi256_ps(r[0]), _mm256_castsi256_ps(r[1]));
    const __m256 a2 = _mm256_unpacklo_ps(_mm256_castsi256_ps(r[2]), _mm256_castsi256_ps(r[3]));
    const __m256 a3 = _mm256_unpackhi_ps(_mm256_castsi256_ps(r[2]), _mm256_castsi256_ps(r[3]));
    const __m256 a4 = _mm256_unpacklo_ps(_mm256_castsi256_ps(r[4]), _mm256_castsi256_ps(r[5]));
    const __m256 a5 = _mm256_unpackhi_ps(_mm256_castsi256_ps(r[4]), _mm256_castsi256_ps(r[5]));
    const __m256 a6 = _mm256_unpacklo_ps(_mm256_castsi256_ps(r[6]), _mm256_castsi256_ps(r[7]));
    const __m256 a7 = _mm256_unpackhi_ps(_mm256_castsi256_ps(r[6]), _mm256_castsi256_ps(r[7]));
    const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xee);
    const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xee);
    const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xee);
    const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xee);
    r[0] = _mm256_castps_si256(_mm256_permute2f128_ps(b0, b4, 0x20));
    r[1] = _mm256_castps_si256(_mm256_permute2f128_ps(b1, b5, 0x20));
    r[2] = _mm256_castps_si256(_mm256_permute2f128_ps(b2, b6, 0x20));
    r[3] = _mm256_castps_si256(_mm256_permute2f128_ps(b3, b7, 0x20));
    r[4] = _mm256_castps_si256(_mm256_permute2f128_ps(b0, b4, 0x31));
    r[5] = _mm256_castps_si256(_mm256_permute2f128_ps(b1, b5, 0x31));
    r[6] = _mm256_castps_si256(_mm256_permute2f128_ps(b2, b6, 0x31));
    r[7] = _mm256_castps_si256(_mm256_permute2f128_ps(b3, b7, 0x31));
}

typedef struct {
    const uint8_t *W;
    float *y;
    const float *add;
    const int8_t *xq; /* [T][K] codes */
    const float *xd;  /* [T][nb] d */
    const float *xs;  /* [T][nb] d * sum(q) */
    const int32_t *xc; /* gm_biased: [T][nb * gm_scales] bias * sum(q) over each scale's inputs */
    const int16_t *x16; /* gm_wide: [T][K] codes as int16, each 4 in the order 0, 2, 1, 3 */
    const float *x, *norm_w;
    float eps;
    int64_t T, K, N, ldy, ld_add, nb, row_bytes;
    int type, input;
    atomic_int failed; /* a worker without memory for its panel scratch */
} gemm_job;

static void gemm_quantize_item(void *arg, int64_t t) {
    const gemm_job *j = arg;
    const float *x = j->x + t * (IS_GATED(j->input) ? 2 * j->K : j->K);
    const __m256 scale = _mm256_set1_ps(j->input == NORMED ? inv_rms(x, j->K, j->eps) : 0.0f);
    int8_t *xq = (int8_t *)j->xq + t * j->K;
    float *xd = (float *)j->xd + t * j->nb, *xs = (float *)j->xs + t * j->nb;
    for (int64_t b = 0; b < j->nb; b++) {
        __m256 v[4];
        int sum;
        input_block(j->input, x, j->K, b * QB, j->norm_w, scale, v);
        const __m256i q = quantize_block(v, &xd[b], &sum);
        _mm256_storeu_si256((__m256i *)(xq + b * QB), q);
        xs[b] = xd[b] * (float)sum;
        if (gm_wide(j->type)) {
            const __m256i order = _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15, 0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12,
                                                   14, 13, 15);
            const __m256i o = _mm256_shuffle_epi8(q, order);
            int16_t *x16 = (int16_t *)j->x16 + t * j->K + b * QB;
            _mm256_storeu_si256((__m256i *)x16, _mm256_cvtepi8_epi16(_mm256_castsi256_si128(o)));
            _mm256_storeu_si256((__m256i *)(x16 + 16), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(o, 1)));
        }
        if (gm_biased(j->type)) {
            const int per = QB / gm_scales(j->type);
            int32_t *xc = (int32_t *)j->xc + (t * j->nb + b) * gm_scales(j->type);
            for (int h = 0; h < gm_scales(j->type); h++) {
                int part = 0;
                for (int e = h * per; e < (h + 1) * per; e++) part += xq[b * QB + e];
                xc[h] = gm_bias(j->type) * part;
            }
        }
    }
}

#ifndef GM_PF_ROWS
#define GM_PF_ROWS 16 /* rows ahead a panel's unpacking prefetches: a pool item's runs are consecutive, the next rows its own */
#endif

static const uint8_t zero_super[256]; /* a panel's missing rows' superblocks: zero scales, so nothing they sum counts */

/* gemm_unpack of a K-format panel, a superblock at a time: each lane-order vector i (formats.py's lanes_) of the 8
 * rows transposed as dwords gives, in its dword d = 4 h + k, codes 4 (i + 4 h) .. of the sub-blocks in lane k (two: a
 * nibble each) for every row, which is the layout's step i + 4 h of those blocks; the fifth (Q5_K) and top two (Q6_K)
 * bits likewise from the rows' qh transposed. Four transposes a superblock, where codes in ggml's order took eight. */
static inline __attribute__((always_inline)) void gemm_unpack_k(const int type, const gemm_job *j, int64_t o0, uint8_t *codes, float *sc, float *off) {
    const int64_t bytes = block_bytes(type);
    const __m256i low4 = _mm256_set1_epi8(15);
    const int64_t ahead = GM_PF_ROWS * j->row_bytes; /* the same bytes of the rows GM_PF_ROWS on: a later panel's */
    for (int64_t q = 0; q < j->nb / 8; q++) {
        const uint8_t *p[GM_NR];
        for (int r = 0; r < GM_NR; r++) {
            p[r] = o0 + r < j->N ? j->W + (o0 + r) * j->row_bytes + q * bytes : zero_super;
            if (o0 + r < j->N)
                for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch((const char *)p[r] + l + ahead, _MM_HINT_T0);
            if (type == Q6_K) {
                const float d = f16(p[r] + 208);
                for (int s = 0; s < 16; s++) sc[(q * 16 + s) * GM_NR + r] = d * (float)(int8_t)p[r][192 + s];
                for (int s = 0; s < 8; s++) off[(q * 8 + s) * GM_NR + r] = 0.0f;
            } else {
                __m256 dsc, dmin_m;
                float ksc[8], kmin[8];
                k_scales(p[r], &dsc, &dmin_m);
                _mm256_storeu_ps(ksc, dsc);
                _mm256_storeu_ps(kmin, dmin_m);
                for (int s = 0; s < 8; s++) sc[(q * 8 + s) * GM_NR + r] = ksc[s], off[(q * 8 + s) * GM_NR + r] = -kmin[s];
            }
        }
        __m256i hb[2][GM_NR]; /* the rows' qh transposed: Q5_K's 32 bytes, Q6_K's two halves */
        for (int h = 0; h < (type == Q6_K ? 2 : type == Q5_K ? 1 : 0); h++) {
            for (int r = 0; r < GM_NR; r++) hb[h][r] = _mm256_loadu_si256((const __m256i *)(p[r] + (type == Q6_K ? 128 + 32 * h : 16)));
            transpose8_epi32(hb[h]);
        }
        uint8_t *out = codes + q * 8 * 8 * 32; /* block 8q + jb, step s at ((8q + jb) * 8 + s) * 32 */
        for (int i = 0; i < 4; i++) {
            __m256i t[GM_NR];
            for (int r = 0; r < GM_NR; r++) t[r] = _mm256_loadu_si256((const __m256i *)(k_codes(type, p[r]) + 32 * i));
            transpose8_epi32(t);
            for (int dw = 0; dw < 8; dw++) {
                const int k = dw % 4, step = i + 4 * (dw / 4);
                /* the lane's sub-blocks: Q4_K / Q5_K's 2k (low nibbles) and 2k + 1; Q6_K's ggml vector k is half k / 2's
                 * ql[32 (k & 1) ..], its low nibbles sub-block 4 (k / 2) + (k & 1), its high that + 2 */
                const int jl = type == Q6_K ? 4 * (k / 2) + (k & 1) : 2 * k, jh = type == Q6_K ? jl + 2 : jl + 1;
                __m256i lo = _mm256_and_si256(t[dw], low4), hi = _mm256_and_si256(_mm256_srli_epi16(t[dw], 4), low4);
                if (type == Q5_K) {
                    lo = _mm256_or_si256(lo, bits_to_4(hb[0][step], jl, 0x10));
                    hi = _mm256_or_si256(hi, bits_to_4(hb[0][step], jh, 0x10));
                } else if (type == Q6_K) {
                    lo = _mm256_or_si256(lo, bits_to_4(hb[jl / 4][step], 2 * (jl % 4), 0x30));
                    hi = _mm256_or_si256(hi, bits_to_4(hb[jh / 4][step], 2 * (jh % 4), 0x30));
                    if (!gm_biased(type)) lo = _mm256_sub_epi8(lo, _mm256_set1_epi8(32)), hi = _mm256_sub_epi8(hi, _mm256_set1_epi8(32));
                }
                _mm256_storeu_si256((__m256i *)(out + (jl * 8 + step) * 32), lo);
                _mm256_storeu_si256((__m256i *)(out + (jh * 8 + step) * 32), hi);
            }
        }
    }
}

/* The panel of weight rows o0 .. o0 + 7 (those past N zero), unpacked: codes [nb][8 steps][32 bytes], scales
 * [nb][gm_scales][8], offsets [nb][8]. Without prefetching, a few x rows' GEMM waited on memory: the hardware
 * follows 8-16 interleaved row streams poorly. */
static inline __attribute__((always_inline)) void gemm_unpack(const int type, const gemm_job *j, int64_t o0, uint8_t *codes, float *sc, float *off) {
    if (is_k(type)) {
        gemm_unpack_k(type, j, o0, codes, sc, off);
        return;
    }
    const int64_t bytes = block_bytes(type);
    const uint8_t *row[GM_NR];
    for (int r = 0; r < GM_NR; r++) row[r] = o0 + r < j->N ? j->W + (o0 + r) * j->row_bytes : NULL;
    const int64_t ahead = GM_PF_ROWS * j->row_bytes; /* the same bytes of the rows GM_PF_ROWS on: a later panel's */
    for (int64_t b = 0; b < j->nb; b++) {
        __m256i c[GM_NR];
        for (int r = 0; r < GM_NR; r++) {
            float s0 = 0.0f, m = 0.0f;
            if (row[r] && (b * bytes) % 64 < bytes) /* each 64-byte line once (prefetches never fault) */
                _mm_prefetch((const char *)row[r] + b * bytes + ahead, _MM_HINT_T0);
            if (!row[r]) {
                c[r] = _mm256_setzero_si256();
            } else {
                const uint8_t *p = row[r] + b * bytes;
                c[r] = codes32(type, p);
                if (gm_biased(type)) c[r] = _mm256_xor_si256(c[r], _mm256_set1_epi8((char)0x80));
                s0 = f16(p);
                m = type == Q4_0 ? -8.0f * s0 : type == Q5_0 ? -16.0f * s0 : (type == Q4_1 || type == Q5_1) ? f16(p + 2) : 0.0f;
            }
            sc[b * GM_NR + r] = s0;
            off[b * GM_NR + r] = m;
        }
        transpose8_epi32(c);
        if (gm_wide(type))
            for (int s = 0; s < 8; s++) {
                _mm256_storeu_si256((__m256i *)(codes + (b * 8 + s) * 64), even16(c[s]));
                _mm256_storeu_si256((__m256i *)(codes + (b * 8 + s) * 64 + 32), odd16(c[s]));
            }
        else
            for (int s = 0; s < 8; s++) _mm256_storeu_si256((__m256i *)(codes + (b * 8 + s) * 32), c[s]);
    }
}

/* y row t, outputs o0 .. o0 + 7 (those below N): v (+ add's) */
static inline void gemm_store(const gemm_job *j, int64_t t, int64_t o0, __m256 v) {
    const int64_t n = j->N - o0 < GM_NR ? j->N - o0 : GM_NR;
    if (n <= 0) return;
    float *y = j->y + t * j->ldy + o0;
    if (j->add) {
        const float *a = j->add + t * j->ld_add + o0;
        if (n == GM_NR) v = _mm256_add_ps(_mm256_loadu_ps(a), v);
        else {
            float tmp[GM_NR] = {0};
            memcpy(tmp, a, (size_t)n * sizeof(float));
            v = _mm256_add_ps(_mm256_loadu_ps(tmp), v);
        }
    }
    if (n == GM_NR) _mm256_storeu_ps(y, v);
    else {
        float tmp[GM_NR];
        _mm256_storeu_ps(tmp, v);
        memcpy(y, tmp, (size_t)n * sizeof(float));
    }
}

/* y rows t0 .. t0 + m - 1, outputs o0 .. o0 + 7 (those below N), from the unpacked panel */
static inline __attribute__((always_inline)) void gemm_tile(const int type, const int m, const gemm_job *j, int64_t t0, int64_t o0, const uint8_t *codes,
                                                            const float *sc, const float *off) {
    const int flush = gm_flush(type), sgn = gm_signed(type) && !gm_biased(type), per = 8 / gm_scales(type);
    (void)flush; /* VNNI sums straight into int32 */
    const int64_t K = j->K, nb = j->nb;
    const int8_t *xq = j->xq + t0 * K;
    const float *xd = j->xd + t0 * nb, *xs = j->xs + t0 * nb;
    const int32_t *xc = gm_biased(type) ? j->xc + t0 * nb * gm_scales(type) : NULL;
    __m256 acc[GM_MR];
    __m256i s32[GM_MR], s16[GM_MR];
    (void)s16;
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i *c = (const __m256i *)(codes + b * 256);
        for (int r = 0; r < m; r++) s32[r] = s16[r] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            const __m256i w = _mm256_loadu_si256(c + s);
            const __m256i aw = sgn ? _mm256_abs_epi8(w) : w;
            for (int r = 0; r < m; r++) {
                int32_t four;
                memcpy(&four, xq + r * K + b * QB + 4 * s, 4);
                __m256i xb = _mm256_set1_epi32(four);
                if (sgn) xb = _mm256_sign_epi8(xb, w);
#ifdef HAVE_VNNI
                s32[r] = dpbusd256(s32[r], aw, xb);
#else
                const __m256i p = _mm256_maddubs_epi16(aw, xb);
                if (flush == 1) s32[r] = _mm256_add_epi32(s32[r], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
                else s16[r] = _mm256_add_epi16(s16[r], p);
#endif
            }
#ifndef HAVE_VNNI
            if (flush > 1 && (s + 1) % flush == 0)
                for (int r = 0; r < m; r++) {
                    s32[r] = _mm256_add_epi32(s32[r], _mm256_madd_epi16(s16[r], _mm256_set1_epi16(1)));
                    s16[r] = _mm256_setzero_si256();
                }
#endif
            if ((s + 1) % per == 0) {
                const __m256 dw = _mm256_loadu_ps(sc + (b * gm_scales(type) + s / per) * GM_NR);
                if (gm_biased(type))
                    for (int r = 0; r < m; r++) s32[r] = _mm256_sub_epi32(s32[r], _mm256_set1_epi32(xc[(r * nb + b) * gm_scales(type) + s / per]));
                for (int r = 0; r < m; r++) {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), _mm256_mul_ps(dw, _mm256_broadcast_ss(xd + r * nb + b)), acc[r]);
                    s32[r] = _mm256_setzero_si256();
                }
            }
        }
        if (has_offset(type)) {
            const __m256 o = _mm256_loadu_ps(off + b * GM_NR);
            for (int r = 0; r < m; r++) acc[r] = _mm256_fmadd_ps(o, _mm256_broadcast_ss(xs + r * nb + b), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) gemm_store(j, t0 + r, o0, acc[r]);
}

/* A format of unsigned codes with one scale per 32-block runs two panels at once (16 weight rows): each x broadcast
 * then feeds two products. With VNNI, or without for the 4-bit formats (Q4_0, Q4_1, Q4_K) whose int16 sums last the
 * whole block, 3 x rows a tile keep 6 f32 accumulators and 6 integer sums in the 16 registers; the 5-bit ones (Q5_0,
 * Q5_1, Q5_K) without VNNI add their int16 sums into int32 after 4 steps, 2 x rows a tile (4 more registers). Per
 * output the same integer sums and the same f32 operations in the same order as gemm_tile's: the same bits. */
#define GM_MR2 3
static inline int gm_pairs(int type) {
#ifdef HAVE_VNNI
    return (!gm_signed(type) || gm_biased(type)) && gm_scales(type) == 1;
#else
    return gm_flush(type) >= 4 && !gm_signed(type) && gm_scales(type) == 1;
#endif
}
/* x rows a pair tile takes */
static inline int gm_mr2(int type) {
#ifdef HAVE_VNNI
    (void)type;
    return GM_MR2;
#else
    return gm_flush(type) == 8 ? GM_MR2 : 2;
#endif
}

static inline __attribute__((always_inline)) void gemm_tile2(const int type, const int m, const gemm_job *j, int64_t t0, int64_t o0,
                                                             const uint8_t *codes, const float *sc, const float *off, const uint8_t *codes1,
                                                             const float *sc1, const float *off1) {
    const int64_t K = j->K, nb = j->nb;
    const int8_t *xq = j->xq + t0 * K;
    const float *xd = j->xd + t0 * nb, *xs = j->xs + t0 * nb;
    const int32_t *xc = gm_biased(type) ? j->xc + t0 * nb : NULL; /* one scale per block here */
    (void)xc;
#ifndef HAVE_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
    const int half = gm_flush(type) == 4; /* the first 4 steps' int16 sums go to int32 (t0, t1) before they overflow */
#endif
    __m256 a0[GM_MR2], a1[GM_MR2];
    for (int r = 0; r < m; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i *c0 = (const __m256i *)(codes + b * 256), *c1 = (const __m256i *)(codes1 + b * 256);
        __m256i h0[GM_MR2], h1[GM_MR2];
#ifndef HAVE_VNNI
        __m256i t0[2], t1[2];
#endif
        for (int r = 0; r < m; r++) h0[r] = h1[r] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
#ifndef HAVE_VNNI
            if (half && s == 4)
                for (int r = 0; r < m && r < 2; r++) {
                    t0[r] = _mm256_madd_epi16(h0[r], ones), t1[r] = _mm256_madd_epi16(h1[r], ones);
                    h0[r] = h1[r] = _mm256_setzero_si256();
                }
#endif
            const __m256i w0 = _mm256_loadu_si256(c0 + s), w1 = _mm256_loadu_si256(c1 + s);
            for (int r = 0; r < m; r++) {
                int32_t four;
                memcpy(&four, xq + r * K + b * QB + 4 * s, 4);
                const __m256i xb = _mm256_set1_epi32(four);
#ifdef HAVE_VNNI
                h0[r] = dpbusd256(h0[r], w0, xb);
                h1[r] = dpbusd256(h1[r], w1, xb);
#else
                h0[r] = _mm256_add_epi16(h0[r], _mm256_maddubs_epi16(w0, xb));
                h1[r] = _mm256_add_epi16(h1[r], _mm256_maddubs_epi16(w1, xb));
#endif
                __asm__("" : "+x"(h0[r]), "+x"(h1[r])); /* summed as they come: gcc's tree of all 8 steps' products spills */
            }
        }
        const __m256 d0 = _mm256_loadu_ps(sc + b * GM_NR), d1 = _mm256_loadu_ps(sc1 + b * GM_NR);
        for (int r = 0; r < m; r++) {
            const __m256 dx = _mm256_broadcast_ss(xd + r * nb + b);
#ifdef HAVE_VNNI
            __m256i i0 = h0[r], i1 = h1[r];
            if (gm_biased(type)) {
                const __m256i c = _mm256_set1_epi32(xc[r * nb + b]);
                i0 = _mm256_sub_epi32(i0, c), i1 = _mm256_sub_epi32(i1, c);
            }
#else
            __m256i i0 = _mm256_madd_epi16(h0[r], ones), i1 = _mm256_madd_epi16(h1[r], ones);
            if (half && r < 2) i0 = _mm256_add_epi32(t0[r], i0), i1 = _mm256_add_epi32(t1[r], i1);
#endif
            a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(d0, dx), a0[r]);
            a1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(d1, dx), a1[r]);
        }
        if (has_offset(type)) {
            const __m256 f0 = _mm256_loadu_ps(off + b * GM_NR), f1 = _mm256_loadu_ps(off1 + b * GM_NR);
            for (int r = 0; r < m; r++) {
                const __m256 sx = _mm256_broadcast_ss(xs + r * nb + b);
                a0[r] = _mm256_fmadd_ps(f0, sx, a0[r]);
                a1[r] = _mm256_fmadd_ps(f1, sx, a1[r]);
            }
        }
    }
    for (int r = 0; r < m; r++) {
        gemm_store(j, t0 + r, o0, a0[r]);
        gemm_store(j, t0 + r, o0 + GM_NR, a1[r]);
    }
}

/* gm_wide's two panels at once: each x broadcast feeds both panels' products (the 16 registers: 2 x 2 weight vectors,
 * 2 x m int32 sums, the f32 accumulators spill and come back once a block). Per output gemm_tile's integer sums and f32
 * steps: the same bits. */
static inline __attribute__((always_inline)) void gemm_tile2w(const int m, const gemm_job *j, int64_t t0, int64_t o0, const uint8_t *codes,
                                                              const float *sc, const uint8_t *codes1, const float *sc1) {
    const int64_t K = j->K, nb = j->nb;
    const float *xd = j->xd + t0 * nb;
    __m256 a0[GM_MR2], a1[GM_MR2];
    for (int r = 0; r < m; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i *c0 = (const __m256i *)(codes + b * 512), *c1 = (const __m256i *)(codes1 + b * 512);
        __m256i h0[GM_MR2], h1[GM_MR2];
        for (int r = 0; r < m; r++) h0[r] = h1[r] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            __m256i e0 = _mm256_load_si256(c0 + 2 * s), o0v = _mm256_load_si256(c0 + 2 * s + 1);
            __m256i e1 = _mm256_load_si256(c1 + 2 * s), o1v = _mm256_load_si256(c1 + 2 * s + 1);
            /* in registers: else GCC takes them as the madds' memory operands, three loads each a step where the core
             * loads two 256-bit vectors a cycle (Zen 4), as many as it multiplies (0.91-0.94x the time, T = 128) */
            __asm__("" : "+x"(e0), "+x"(o0v), "+x"(e1), "+x"(o1v));
            for (int r = 0; r < m; r++) {
                const int16_t *x = j->x16 + (t0 + r) * K + b * QB + 4 * s;
                int32_t e, o;
                memcpy(&e, x, 4), memcpy(&o, x + 2, 4);
                const __m256i xe = _mm256_set1_epi32(e), xo = _mm256_set1_epi32(o);
                h0[r] = _mm256_add_epi32(h0[r], _mm256_add_epi32(_mm256_madd_epi16(e0, xe), _mm256_madd_epi16(o0v, xo)));
                h1[r] = _mm256_add_epi32(h1[r], _mm256_add_epi32(_mm256_madd_epi16(e1, xe), _mm256_madd_epi16(o1v, xo)));
                __asm__("" : "+x"(h0[r]), "+x"(h1[r]));
            }
        }
        const __m256 d0 = _mm256_loadu_ps(sc + b * GM_NR), d1 = _mm256_loadu_ps(sc1 + b * GM_NR);
        for (int r = 0; r < m; r++) {
            const __m256 dx = _mm256_broadcast_ss(xd + r * nb + b);
            a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h0[r]), _mm256_mul_ps(d0, dx), a0[r]);
            a1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h1[r]), _mm256_mul_ps(d1, dx), a1[r]);
        }
    }
    for (int r = 0; r < m; r++) {
        gemm_store(j, t0 + r, o0, a0[r]);
        gemm_store(j, t0 + r, o0 + GM_NR, a1[r]);
    }
}

static __thread uint8_t *gm_scratch;
static __thread size_t gm_scratch_bytes;

static inline __attribute__((always_inline)) void gemm_panel(const int type, const gemm_job *j, int64_t p) {
    const int pairs = gm_pairs(type) || gm_wide(type), panels = pairs ? 2 : 1;
    const int64_t nb = j->nb, o0 = p * GM_NR * panels;
    const size_t cb = gm_wide(type) ? 512 : 256; /* a block's unpacked codes */
    const size_t one = (size_t)nb * (cb + (gm_scales(type) + 1) * GM_NR * sizeof(float)), need = one * panels;
    if (need > gm_scratch_bytes) {
        free(gm_scratch);
        gm_scratch = aligned_alloc(64, (need + 63) / 64 * 64);
        gm_scratch_bytes = gm_scratch ? need : 0;
        if (!gm_scratch) {
            atomic_store_explicit(&((gemm_job *)j)->failed, 1, memory_order_relaxed);
            return;
        }
    }
    uint8_t *codes = gm_scratch;
    float *sc = (float *)(codes + nb * cb), *off = sc + nb * gm_scales(type) * GM_NR;
    gemm_unpack(type, j, o0, codes, sc, off);
    int64_t t = 0;
    if (pairs) {
        uint8_t *codes1 = gm_scratch + one; /* one is a multiple of 64: nb * (cb + 64) */
        float *sc1 = (float *)(codes1 + nb * cb), *off1 = sc1 + nb * GM_NR;
        gemm_unpack(type, j, o0 + GM_NR, codes1, sc1, off1);
        if (gm_wide(type)) {
            for (; t + GM_MR2 <= j->T; t += GM_MR2) gemm_tile2w(GM_MR2, j, t, o0, codes, sc, codes1, sc1);
            switch (j->T - t) {
            case 2: gemm_tile2w(2, j, t, o0, codes, sc, codes1, sc1); break;
            case 1: gemm_tile2w(1, j, t, o0, codes, sc, codes1, sc1); break;
            default: break;
            }
            return;
        }
        if (gm_mr2(type) == GM_MR2) {
            for (; t + GM_MR2 <= j->T; t += GM_MR2) gemm_tile2(type, GM_MR2, j, t, o0, codes, sc, off, codes1, sc1, off1);
        } else {
            for (; t + 2 <= j->T; t += 2) gemm_tile2(type, 2, j, t, o0, codes, sc, off, codes1, sc1, off1);
        }
        switch (j->T - t) {
        case 2: gemm_tile2(type, 2, j, t, o0, codes, sc, off, codes1, sc1, off1); break;
        case 1: gemm_tile2(type, 1, j, t, o0, codes, sc, off, codes1, sc1, off1); break;
        default: break;
        }
        return;
    }
    for (; t + GM_MR <= j->T; t += GM_MR) gemm_tile(type, GM_MR, j, t, o0, codes, sc, off);
    switch (j->T - t) {
    case 3: gemm_tile(type, 3, j, t, o0, codes, sc, off); break;
    case 2: gemm_tile(type, 2, j, t, o0, codes, sc, off); break;
    case 1: gemm_tile(type, 1, j, t, o0, codes, sc, off); break;
    default: break;
    }
}

#define GEMM_FN(NAME, TYPE) \
    static void NAME(void *arg, int64_t p) { gemm_panel(TYPE, arg, p); }
GEMM_FN(gemm_q4_0, Q4_0)
GEMM_FN(gemm_q4_1, Q4_1)
GEMM_FN(gemm_q5_0, Q5_0)
GEMM_FN(gemm_q5_1, Q5_1)
GEMM_FN(gemm_q8_0, Q8_0)
GEMM_FN(gemm_q4_k, Q4_K)
GEMM_FN(gemm_q5_k, Q5_K)
GEMM_FN(gemm_q6_k, Q6_K)

/* quant_rows' product (same arguments, same meaning) as an int8 GEMM, for many rows: see this section's head.
 * Returns 0, -1 without memory, -2 for a type it does not know. */
int gemm_rows(const float *x, const uint8_t *W, float *y, int64_t T, int64_t K, int64_t N, int64_t ldy, int type, int input, const float *norm_w,
              float eps, const float *r, int64_t ldr, int threads) {
    void (*fn)(void *, int64_t);
    switch (type) {
    case Q4_0: fn = gemm_q4_0; break;
    case Q4_1: fn = gemm_q4_1; break;
    case Q5_0: fn = gemm_q5_0; break;
    case Q5_1: fn = gemm_q5_1; break;
    case Q8_0: fn = gemm_q8_0; break;
    case Q4_K: fn = gemm_q4_k; break;
    case Q5_K: fn = gemm_q5_k; break;
    case Q6_K: fn = gemm_q6_k; break;
    default: return -2;
    }
    const int64_t nb = K / QB;
    const size_t xbytes = (size_t)T * K, x16bytes = gm_wide(type) ? (size_t)T * K * sizeof(int16_t) : 0;
    char *buf = malloc(xbytes + (size_t)T * (2 * nb * sizeof(float) + nb * gm_scales(type) * sizeof(int32_t)) + 64 + x16bytes);
    if (!buf) return -1;
    gemm_job job = {.W = W, .y = y, .add = r, .xq = (int8_t *)buf, .x = x, .norm_w = norm_w, .eps = eps, .T = T, .K = K, .N = N, .ldy = ldy,
                    .ld_add = ldr, .nb = nb, .row_bytes = K / block_elems(type) * block_bytes(type), .type = type, .input = input};
    job.xd = (float *)(buf + (xbytes + 63) / 64 * 64);
    job.xs = job.xd + T * nb;
    job.xc = (const int32_t *)(job.xs + T * nb);
    job.x16 = x16bytes ? (const int16_t *)(job.xc + T * nb * gm_scales(type)) : NULL; /* 4-byte aligned */
    pool_for(T, T >= 8 ? threads : 1, gemm_quantize_item, &job);
    const int64_t rows = GM_NR * (gm_pairs(type) || gm_wide(type) ? 2 : 1); /* weight rows per item */
    pool_for((N + rows - 1) / rows, threads, fn, &job);
    free(buf);
    return atomic_load_explicit(&job.failed, memory_order_relaxed) ? -1 : 0;
}

/* ---- dequantization ---- */

/* 32 values a * q (+ b where with_b) from signed codes q, a_lo for elements 0..15 and a_hi for 16..31, to out
 * (f32, or bf16 where bf16) at element `at`. */
static inline void emit32(__m256i q, __m256 a_lo, __m256 a_hi, __m256 b, int with_b, void *out, int64_t at, int bf16) {
    const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int c = 0; c < 4; c++) {
        const __m128i bytes = c & 1 ? _mm_srli_si128(halves[c / 2], 8) : halves[c / 2];
        __m256 v = settled(_mm256_mul_ps(c < 2 ? a_lo : a_hi, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))));
        if (with_b) v = _mm256_add_ps(v, b);
        if (bf16) _mm_storeu_si128((__m128i *)((uint16_t *)out + at + 8 * c), bf16x8(v));
        else _mm256_storeu_ps((float *)out + at + 8 * c, v);
    }
}

/* One row (type a constant at each call site) to out at element `at`. */
/* A K-format superblock sb's 8 sub-blocks: codes q[j] (signed, element order) and their weights a * q + b (a_lo for
 * elements 0-15, a_hi for 16-31; b, the mins' -(dmin * m), only where the format has them: returns whether) */
static inline __attribute__((always_inline)) int k_super(const int type, const uint8_t *sb, __m256i *q, float *a_lo, float *a_hi, float *b) {
    __m256i y[4];
    ggml_vectors(k_codes(type, sb), y);
    if (type == Q6_K) {
        const float d = f16(sb + 208);
        for (int j = 0; j < 8; j++) {
            q[j] = codes_q6k(y[k_vector(type, j)], sb, j);
            a_lo[j] = d * (float)(int8_t)sb[192 + 2 * j], a_hi[j] = d * (float)(int8_t)sb[193 + 2 * j], b[j] = 0.0f;
        }
        return 0;
    }
    __m256 dsc, dmin_m;
    k_scales(sb, &dsc, &dmin_m);
    _mm256_storeu_ps(a_lo, dsc);
    _mm256_storeu_ps(a_hi, dsc);
    _mm256_storeu_ps(b, _mm256_sub_ps(_mm256_setzero_ps(), dmin_m)); /* d q - dmin m = d q + (-(dmin m)) exactly */
    for (int j = 0; j < 8; j++) q[j] = codes_k(type, y[k_vector(type, j)], sb, j);
    return 1;
}

static inline __attribute__((always_inline)) void dequant_row(const int type, const uint8_t *w, int64_t K, void *out, int64_t at, int bf16) {
    const int64_t bytes = block_bytes(type);
    if (is_k(type)) {
        for (int64_t s = 0; s < K / 256; s++, at += 256) {
            __m256i q[8];
            float a_lo[8], a_hi[8], b[8];
            const int with_b = k_super(type, w + s * bytes, q, a_lo, a_hi, b);
            for (int j = 0; j < 8; j++)
                emit32(q[j], _mm256_set1_ps(a_lo[j]), _mm256_set1_ps(a_hi[j]), _mm256_set1_ps(b[j]), with_b, out, at + 32 * j, bf16);
        }
        return;
    }
    for (int64_t j = 0; j < K / QB; j++, at += QB) {
        const uint8_t *b = w + j * bytes;
        const __m256 d = _mm256_set1_ps(f16(b));
        __m256i q = codes32(type, b);
        if (type == Q4_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
        if (type == Q5_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
        const int with_m = type == Q4_1 || type == Q5_1;
        emit32(q, d, d, with_m ? _mm256_set1_ps(f16(b + 2)) : d, with_m, out, at, bf16);
    }
}

typedef struct {
    const uint8_t *W;
    const int64_t *ids;
    void *out;
    int64_t K, row_bytes;
    int type, bf16;
} dequant_job;

static void dequant_item(void *arg, int64_t o) {
    const dequant_job *j = arg;
    const uint8_t *w = j->W + (j->ids ? j->ids[o] : o) * j->row_bytes;
    const int64_t K = j->K, bf16 = j->bf16;
    switch (j->type) {
    case Q4_0: dequant_row(Q4_0, w, K, j->out, o * K, bf16); break;
    case Q4_1: dequant_row(Q4_1, w, K, j->out, o * K, bf16); break;
    case Q5_0: dequant_row(Q5_0, w, K, j->out, o * K, bf16); break;
    case Q5_1: dequant_row(Q5_1, w, K, j->out, o * K, bf16); break;
    case Q8_0: dequant_row(Q8_0, w, K, j->out, o * K, bf16); break;
    case Q4_K: dequant_row(Q4_K, w, K, j->out, o * K, bf16); break;
    case Q5_K: dequant_row(Q5_K, w, K, j->out, o * K, bf16); break;
    default: dequant_row(Q6_K, w, K, j->out, o * K, bf16); break;
    }
}

/* W's N rows of `type` (K a multiple of its block) -> out [N, K] f32, or bf16 where bf16, row by row on pool.c's
 * threads; with ids, W's rows ids[0 .. N) (a token embedding's lookup: gathered here, not by a torch index of its own
 * threads). Returns 0, or -2 for a type it does not know. */
int dequant_rows(const uint8_t *W, const int64_t *ids, void *out, int64_t N, int64_t K, int type, int bf16, int threads) {
    if (!block_bytes(type)) return -2;
    dequant_job job = {.W = W, .ids = ids, .out = out, .K = K, .row_bytes = K / block_elems(type) * block_bytes(type), .type = type, .bf16 = bf16};
    pool_for(N, threads, dequant_item, &job);
    return 0;
}

/* ---- prompt chunks in bf16: AMX tiles, or AVX512_BF16's dot products ----
 *
 * bf16_rows: y[t * ldy + o] = (add +) sum_k bf16(x[t, k]) * bf16(W[o, k]), the products exact in f32 and summed in
 * f32: x rounded to bf16 (to nearest even), W dequantized as dequant_rows gives it and rounded the same way. A bf16
 * model's rounding, on the units CPUs have for it: where the build has AMX (and the OS grants its tile state) the
 * products run in tiles, else with AVX512_BF16's vdpbf16ps. Each (t, o) sums its K in one order whatever T and the
 * threads: a row's result does not depend on the rows beside it (the two units sum in their own orders).
 *
 * W goes by panels of NP = 32 rows (an item of the pool): dequantized to bf16, then packed in the pairs layout both
 * units read, panel[k / 32][half][pair][16 rows][2]: per 32 inputs and 16 rows, 16 vectors of 64 bytes, vector r
 * holding inputs 2r, 2r + 1 of each row (an AMX B tile). Every 32 (AMX) or MR (vdpbf16ps) rows of x then run
 * against the whole panel. x comes rounded (bf16_round: [Tp, K] bf16, Tp = T rounded up to 32, the rest zero), once
 * for every product that reads the same rows (a layer's MLP slices, a projection's runs). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16 1
#include <sys/syscall.h>
#include <unistd.h>

#define NP 32 /* W rows per panel */
#define MR 12 /* x rows per pass of vdpbf16ps: 24 accumulators, 2 panel vectors */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#endif

#ifdef HAVE_AMX
static int amx_granted = -1; /* the OS's answer to our request for AMX tile state: -1 not asked, 0 refused, 1 granted */
#endif

/* 2: AMX tiles (built with them, and the OS grants their state to this process), 1: vdpbf16ps, 0: not built for bf16 */
int bf16_rows_kind(void) {
#ifdef HAVE_AMX
    if (amx_granted < 0) amx_granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    if (amx_granted) return 2;
#endif
    return 1;
}

/* x's rows made (as `input` says) and rounded to bf16: [Tp, K], the rows past T zero */
typedef struct {
    const float *x, *norm_w;
    uint16_t *xb;
    float eps;
    int64_t T, K;
    int input;
} round_job;

/* Input row t (zeros past T), made from x's row as `input` says (the f32 values rms_norm_rows and gated_rows
 * make), rounded to bf16 into xb */
static void bf16_x_item(void *arg, int64_t t) {
    const round_job *j = arg;
    const int64_t K = j->K;
    uint16_t *dst = j->xb + t * K;
    const float *x = j->x + t * (IS_GATED(j->input) ? 2 * K : K);
    const __m256 scale = _mm256_set1_ps(t < j->T && j->input == NORMED ? inv_rms(x, K, j->eps) : 0.0f);
    for (int64_t k = 0; k < K; k += 32) {
        __m512i v = _mm512_setzero_si512();
        if (t < j->T) {
            __m256 in[4];
            input_block(j->input, x, K, k, j->norm_w, scale, in);
            const __m512 lo = _mm512_insertf32x8(_mm512_castps256_ps512(in[0]), in[1], 1), hi = _mm512_insertf32x8(_mm512_castps256_ps512(in[2]), in[3], 1);
            v = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        }
        _mm512_storeu_si512(dst + k, v);
    }
}

/* A run of W's rows of one type: its panels are items first_item .. first_item + ceil(rows / NP) - 1 of the pool, its
 * outputs y's columns col .. col + rows - 1 */
typedef struct {
    const uint8_t *W;
    int64_t row_bytes, rows, col, first_item;
    int type;
} bf16_run;

typedef struct {
    const uint16_t *xb;
    const float *add;
    float *y;
    const bf16_run *runs;
    int64_t T, Tp, K, ldy, ld_add;
    int nruns, amx;
    _Atomic int failed;
} bf16_job;

/* rows t0 .. t0 + 15 of a 16-column block c ([16][16] f32, row-major, ld 16 floats) to y, add added, columns < n */
static inline void bf16_store(const bf16_job *j, const float *c, int64_t t0, int64_t rows, int64_t o, int n) {
    const __mmask16 m = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
    for (int64_t r = 0; r < rows && t0 + r < j->T; r++) {
        __m512 v = _mm512_loadu_ps(c + 16 * r);
        if (j->add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, j->add + (t0 + r) * j->ld_add + o));
        _mm512_mask_storeu_ps(j->y + (t0 + r) * j->ldy + o, m, v);
    }
}

#ifdef HAVE_AMX
/* tiles 0-3: C (rows 0-15 x columns 0-15, 0-15 x 16-31, 16-31 x 0-15, 16-31 x 16-31); 4, 5: x's rows; 6, 7: W's */
static void amx_panel(const bf16_job *j, const uint8_t *panel, int64_t o, int n) {
    amx_tiles_16x64();
    const int64_t K = j->K, steps = K / 32, lda = 2 * K;
    float c[4][256];
    for (int64_t t0 = 0; t0 < j->Tp; t0 += 32) {
        const uint16_t *a = j->xb + t0 * K;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; s++) {
            const uint8_t *b = panel + s * 2048;
            _tile_loadd(4, a + 32 * s, lda);
            _tile_loadd(5, a + 16 * K + 32 * s, lda);
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + 1024, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        bf16_store(j, c[0], t0, 16, o, n);
        if (n > 16) bf16_store(j, c[1], t0, 16, o + 16, n - 16);
        bf16_store(j, c[2], t0 + 16, 16, o, n);
        if (n > 16) bf16_store(j, c[3], t0 + 16, 16, o + 16, n - 16);
    }
    _tile_release();
}
#endif

/* x rows t0 .. t0 + R - 1 (R <= MR, a constant at each call) against the panel: vdpbf16ps, pairs in order */
static inline __attribute__((always_inline)) void dp_rows(const bf16_job *j, const uint8_t *panel, int64_t t0, const int R, int64_t o, int n) {
    __m512 acc[MR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t K = j->K;
    const uint32_t *a = (const uint32_t *)(j->xb + t0 * K); /* x's pairs as dwords */
    for (int64_t p = 0; p < K / 2; p++) {
        const uint8_t *b = panel + (p / 16) * 2048 + (p % 16) * 64;
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 1024);
        for (int r = 0; r < R; r++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[r * K / 2 + p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
        }
    }
    float c[2][MR * 16];
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(c[0] + 16 * r, acc[r][0]);
        _mm512_storeu_ps(c[1] + 16 * r, acc[r][1]);
    }
    bf16_store(j, c[0], t0, R, o, n);
    if (n > 16) bf16_store(j, c[1], t0, R, o + 16, n - 16);
}

static void dp_panel(const bf16_job *j, const uint8_t *panel, int64_t o, int n) {
    int64_t t0 = 0;
    for (; t0 + MR <= j->T; t0 += MR) dp_rows(j, panel, t0, MR, o, n);
    for (; t0 < j->T; t0 += 4) dp_rows(j, panel, t0, 4, o, n); /* xb's zero rows pad the last 4 */
}

static inline __m512 settled512(__m512 v) {
    __asm__("" : "+v"(v));
    return v;
}

/* 32 codes q (signed bytes) as bf16 in order: the f32 values dequant_rows makes (the same operations: a * q, then + b,
 * never fused; a_lo for the first 16, a_hi the rest), rounded to nearest even. */
static inline __attribute__((always_inline)) __m512i codes_bf16(__m256i q, float a_lo, float a_hi, float b, const int with_b) {
    __m512 lo = settled512(_mm512_mul_ps(_mm512_set1_ps(a_lo), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)))));
    __m512 hi = settled512(_mm512_mul_ps(_mm512_set1_ps(a_hi), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)))));
    if (with_b) lo = _mm512_add_ps(lo, _mm512_set1_ps(b)), hi = _mm512_add_ps(hi, _mm512_set1_ps(b));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* A 32-format's block at blk as 32 bf16 (codes_bf16) */
static inline __attribute__((always_inline)) __m512i block_bf16(const int type, const uint8_t *blk) {
    __m256i q = codes32(type, blk);
    if (type == Q4_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
    if (type == Q5_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    const float d = f16(blk);
    const int with_m = type == Q4_1 || type == Q5_1;
    return codes_bf16(q, d, d, with_m ? f16(blk + 2) : 0.0f, with_m);
}

/* The panel of W's rows w (n of them, the rest zero) in the pairs layout, 32 inputs at a time: 16 rows' blocks,
 * transposed as dwords (input pairs). A K-format's a superblock at a time (k_super), 8 blocks of the 16 rows. */
static inline __attribute__((always_inline)) void pack_panel(const int type, const uint8_t *w, int64_t row_bytes, int n, int64_t K, uint8_t *panel) {
    if (is_k(type)) {
        for (int64_t q = 0; q < K / 256; q++)
            for (int h = 0; h < 2; h++) {
                __m512i in[8][16], out[16];
                for (int r = 0; r < 16; r++) {
                    __m256i c[8];
                    float a_lo[8], a_hi[8], b[8];
                    const int with_b = 16 * h + r < n ? k_super(type, w + (16 * h + r) * row_bytes + q * block_bytes(type), c, a_lo, a_hi, b) : 0;
                    for (int j = 0; j < 8; j++) in[j][r] = 16 * h + r < n ? codes_bf16(c[j], a_lo[j], a_hi[j], b[j], with_b) : _mm512_setzero_si512();
                }
                for (int j = 0; j < 8; j++) {
                    transpose16(in[j], out);
                    for (int r = 0; r < 16; r++) _mm512_storeu_si512(panel + (8 * q + j) * 2048 + h * 1024 + r * 64, out[r]);
                }
            }
        return;
    }
    for (int64_t s = 0; s < K / 32; s++)
        for (int h = 0; h < 2; h++) {
            __m512i in[16], out[16];
            for (int r = 0; r < 16; r++) in[r] = 16 * h + r < n ? block_bf16(type, w + (16 * h + r) * row_bytes + s * block_bytes(type)) : _mm512_setzero_si512();
            transpose16(in, out);
            for (int r = 0; r < 16; r++) _mm512_storeu_si512(panel + s * 2048 + h * 1024 + r * 64, out[r]);
        }
}

/* A run's W rows o .. o + NP - 1 (fewer at the end: zero rows), dequantized to bf16 and packed; then every row of x */
static void bf16_panel_item(void *arg, int64_t item) {
    bf16_job *j = arg;
    const bf16_run *run = j->runs;
    while (run + 1 < j->runs + j->nruns && item >= run[1].first_item) run++;
    const int64_t K = j->K, o = (item - run->first_item) * NP;
    const int n = (int)(run->rows - o < NP ? run->rows - o : NP);
    uint8_t *panel = aligned_alloc(64, (size_t)(NP * K * 2));
    if (panel == NULL) {
        atomic_store_explicit(&j->failed, 1, memory_order_relaxed);
        return;
    }
    const uint8_t *w = run->W + o * run->row_bytes;
    switch (run->type) {
    case Q4_0: pack_panel(Q4_0, w, run->row_bytes, n, K, panel); break;
    case Q4_1: pack_panel(Q4_1, w, run->row_bytes, n, K, panel); break;
    case Q5_0: pack_panel(Q5_0, w, run->row_bytes, n, K, panel); break;
    case Q5_1: pack_panel(Q5_1, w, run->row_bytes, n, K, panel); break;
    case Q8_0: pack_panel(Q8_0, w, run->row_bytes, n, K, panel); break;
    case Q4_K: pack_panel(Q4_K, w, run->row_bytes, n, K, panel); break;
    case Q5_K: pack_panel(Q5_K, w, run->row_bytes, n, K, panel); break;
    default: pack_panel(Q6_K, w, run->row_bytes, n, K, panel); break;
    }
#ifdef HAVE_AMX
    if (j->amx) amx_panel(j, panel, run->col + o, n);
    else
#endif
        dp_panel(j, panel, run->col + o, n);
    free(panel);
}

/* x [T, K] (input PLAIN), RMSNorm(x) * norm_w with epsilon eps (NORMED) or act(gate) * up of x [T, 2K] (GATED: silu, GATED_GELU: gelu),
 * as quant_rows takes them, f32 contiguous -> xb [Tp, K] bf16 (to nearest even), Tp = T rounded up to 32, the rows
 * past T zero: bf16_rows's input. Returns 0, -2 for K not a multiple of 32. */
int bf16_round(const float *x, uint16_t *xb, int64_t T, int64_t K, int input, const float *norm_w, float eps, int threads) {
    if (K % 32) return -2;
    const int64_t Tp = (T + 31) / 32 * 32;
    round_job job = {.x = x, .norm_w = norm_w, .xb = xb, .eps = eps, .T = T, .K = K, .input = input};
    pool_for(Tp, Tp >= 8 ? threads : 1, bf16_x_item, &job);
    return 0;
}

/* y[t * ldy + c] = (add[t * ld_add + c] +) xb[t] . bf16(W[o]) for the rows o of nruns runs of W side by side (run r:
 * rows[r] rows of types[r] at W[r], each w_stride[r] bytes after the last (0: K's bytes; more: K columns of wider
 * rows), its outputs the columns after the runs before it), xb bf16_round's [Tp, K] (T rows used); add a residual
 * [T, columns] (ld_add the columns) or a bias (ld_add 0), or NULL. The panels of every run share one pool. Returns
 * 0, -1 without memory, -2 for a type it does not know or K not a multiple of 32 and of its block. */
int bf16_rows(const uint16_t *xb, int64_t T, int64_t K, int nruns, const uint8_t *const *W, const int64_t *w_stride, const int64_t *rows,
              const int *types, float *y, int64_t ldy, const float *add, int64_t ld_add, int threads) {
    bf16_run runs[8];
    if (nruns < 1 || nruns > 8 || K % 32) return -2;
    int64_t col = 0, items = 0;
    for (int r = 0; r < nruns; r++) {
        if (!block_bytes(types[r]) || K % block_elems(types[r])) return -2;
        runs[r] = (bf16_run){.W = W[r], .row_bytes = w_stride[r] ? w_stride[r] : K / block_elems(types[r]) * block_bytes(types[r]), .rows = rows[r],
                             .col = col, .first_item = items, .type = types[r]};
        col += rows[r];
        items += (rows[r] + NP - 1) / NP;
    }
    bf16_job job = {.xb = xb, .add = add, .y = y, .runs = runs, .T = T, .Tp = (T + 31) / 32 * 32, .K = K, .ldy = ldy, .ld_add = ld_add,
                    .nruns = nruns, .amx = bf16_rows_kind() == 2};
    pool_for(items, threads, bf16_panel_item, &job);
    return atomic_load_explicit(&job.failed, memory_order_relaxed) ? -1 : 0;
}
#else
int bf16_rows_kind(void) { return 0; }

int bf16_round(const float *x, uint16_t *xb, int64_t T, int64_t K, int input, const float *norm_w, float eps, int threads) {
    (void)x, (void)xb, (void)T, (void)K, (void)input, (void)norm_w, (void)eps, (void)threads;
    return -3;
}

int bf16_rows(const uint16_t *xb, int64_t T, int64_t K, int nruns, const uint8_t *const *W, const int64_t *w_stride, const int64_t *rows,
              const int *types, float *y, int64_t ldy, const float *add, int64_t ld_add, int threads) {
    (void)xb, (void)T, (void)K, (void)nruns, (void)W, (void)w_stride, (void)rows, (void)types, (void)y, (void)ldy, (void)add, (void)ld_add;
    (void)threads;
    return -3;
}
#endif
