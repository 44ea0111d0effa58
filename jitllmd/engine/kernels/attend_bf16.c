/* A prompt chunk's attention in bf16 on AMX tiles: the attention of a model whose prompt projections multiply in
 * bf16 (quant.c's bf16_rows), built where the variant has AMX and run where the OS grants its tile state.
 *
 * attend_chunk_bf16 takes what rows.c's attend_chunk takes and answers the same attention with a bf16 model's
 * rounding: q * scale and the keys rounded to bf16 (nearest even), their products summed in f32 (the scores); the
 * softmax in f32; its weights P and the values rounded to bf16, P . V summed in f32 into the f32 output. Keys go by
 * blocks of AB = 32 at fixed positions (block b: keys 32 b .. 32 b + 31), the online softmax (running maximum m,
 * sum l, rescaling corr) one block at a time, so a query's result depends only on it and the keys it sees: not on
 * the chunk it came in, the queries beside it, or the threads. A block a query sees none of leaves it unchanged
 * (corr = 1, P = 0).
 *
 * Two passes on pool.c's threads: the chunk's keys and values are rounded and packed once per kv head and block
 * into the pairs layout AMX's B tiles read (keys: [D / 32][2 halves][16 pairs of dims][16 keys][2], values:
 * [D / 16][16 pairs of keys][16 dims][2]); then items (kv head, AQ queries) run their group * AQ query rows against
 * the blocks they see: scores in tiles, the softmax in AVX-512 per row, P . V in tiles onto the rows' f32 output.
 * D a multiple of 32. */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)

int bf16_rows_kind(void); /* quant.c's: 2 where AMX tiles run */

#define AB 32 /* keys per block */
#define AQ 32 /* queries per item */

/* exp8_neg on 16 floats: the same operations, so the same bits lane by lane */
static inline __m512 exp16_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365478515625f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 p;
    EXP_POLY(_mm512, __m512, x, n, p);
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

typedef struct {
    const float *q;
    const void *K, *V; /* [pages, Hkv, KV_PAGE] rows of `kind` (simd.h: f32, f16, bf16, q8_0) */
    const int32_t *table; /* the session's pages (simd.h kv_at) */
    float *out;
    uint16_t *kt, *vt; /* packed: [Hkv][nb][AB * D] each */
    int64_t q_stride, n, H, Hkv, D, p, key_start, window, group, qblocks, b0, nb, klo, khi;
    float scale;
    int kind;
    _Atomic int failed;
} abf_job;

/* 16 values of a cache row from element d as f32 (zeros for a key outside [klo, khi)) */
static inline __m512 cache16(const abf_job *j, const void *base, int64_t h, int64_t key, int64_t d) {
    if (key < j->klo || key >= j->khi) return _mm512_setzero_ps();
    const char *row = (const char *)base + kv_byte(j->table, j->Hkv, h, key, kv_row_bytes(j->kind, j->D));
    if (j->kind == KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d)));
    if (j->kind == KV_BF16) /* an f32's top half */
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d))), 16));
    if (j->kind == KV_Q8) { /* 16 values of one block of 32: its scale times each integer */
        const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d))));
        return _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(((const uint16_t *)(row + j->D))[d / 32])), v);
    }
    return _mm512_loadu_ps((const float *)row + d);
}

/* Keys and values of kv head item / nb, block b0 + item % nb, rounded and packed */
static void pack_item(void *arg, int64_t item) {
    abf_job *j = arg;
    const int64_t D = j->D, h = item / j->nb, blk = item % j->nb, k0 = (j->b0 + blk) * AB;
    uint8_t *kt = (uint8_t *)(j->kt + (h * j->nb + blk) * AB * D), *vt = (uint8_t *)(j->vt + (h * j->nb + blk) * AB * D);
    for (int64_t s = 0; s < D / 32; s++)
        for (int half = 0; half < 2; half++) {
            __m512i in[16], out[16];
            for (int r = 0; r < 16; r++) {
                const int64_t key = k0 + 16 * half + r;
                in[r] = (__m512i)_mm512_cvtne2ps_pbh(cache16(j, j->K, h, key, 32 * s + 16), cache16(j, j->K, h, key, 32 * s));
            }
            transpose16(in, out);
            for (int r = 0; r < 16; r++) _mm512_storeu_si512(kt + s * 2048 + half * 1024 + r * 64, out[r]);
        }
    /* values: tile g (dims 16 g ..), row r: (V[2r][d], V[2r + 1][d]) for its 16 dims */
    const __m512i zip = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    for (int64_t g = 0; g < D / 16; g++)
        for (int r = 0; r < 16; r++) {
            const __m256bh a = _mm512_cvtneps_pbh(cache16(j, j->V, h, k0 + 2 * r, 16 * g)), b = _mm512_cvtneps_pbh(cache16(j, j->V, h, k0 + 2 * r + 1, 16 * g));
            const __m512i v = _mm512_permutex2var_epi16(_mm512_castsi256_si512((__m256i)a), zip, _mm512_castsi256_si512((__m256i)b));
            _mm512_storeu_si512(vt + g * 1024 + r * 64, v);
        }
}

/* One item: kv head item / qblocks, queries i0 .. i1 - 1 (the heaviest first), rows r = (i - i0) * group + head */
static void query_item(void *arg, int64_t item) {
    abf_job *j = arg;
    const int64_t D = j->D, group = j->group, h = item / j->qblocks;
    const int64_t i0 = (j->qblocks - 1 - item % j->qblocks) * AQ, i1 = i0 + AQ < j->n ? i0 + AQ : j->n;
    const int64_t R = (i1 - i0) * group, Rp = (R + 15) / 16 * 16;
    /* qb [Rp][D] bf16, pb [Rp][AB] bf16, o [Rp][D], st [Rp][AB], m, l [Rp] f32, first, last [Rp] */
    const size_t bytes = (size_t)Rp * (2 * D + 2 * AB + 4 * D + 4 * AB + 16);
    uint8_t *mem = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (mem == NULL) {
        atomic_store_explicit(&j->failed, 1, memory_order_relaxed);
        return;
    }
    uint16_t *qb = (uint16_t *)mem, *pb = qb + Rp * D;
    float *o = (float *)(pb + Rp * AB), *st = o + Rp * D, *m = st + Rp * AB, *l = m + Rp;
    int64_t lo = INT64_MAX;
    int32_t *first = (int32_t *)(l + Rp), *last = first + Rp;
    for (int64_t r = 0; r < Rp; r++) {
        const int64_t rr = r < R ? r : R - 1, i = i0 + rr / group, head = h * group + rr % group;
        const float *qr = j->q + i * j->q_stride + head * D;
        for (int64_t d = 0; d < D; d += 32) {
            const __m512 a = r < R ? _mm512_mul_ps(_mm512_loadu_ps(qr + d), _mm512_set1_ps(j->scale)) : _mm512_setzero_ps();
            const __m512 b = r < R ? _mm512_mul_ps(_mm512_loadu_ps(qr + d + 16), _mm512_set1_ps(j->scale)) : _mm512_setzero_ps();
            _mm512_storeu_si512(qb + r * D + d, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
        last[r] = (int32_t)(j->p + i);
        first[r] = (int32_t)(j->window > 0 && j->p + i - j->window + 1 > j->key_start ? j->p + i - j->window + 1 : j->key_start);
        if (first[r] < lo) lo = first[r];
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(o, 0, sizeof(float) * (size_t)(Rp * D));
    amx_tiles_16x64();
    const int64_t bfirst = lo / AB, blast = (j->p + i1 - 1) / AB;
    for (int64_t b = bfirst; b <= blast; b++) {
        const uint8_t *kt = (const uint8_t *)(j->kt + (h * j->nb + b - j->b0) * AB * D), *vt = (const uint8_t *)(j->vt + (h * j->nb + b - j->b0) * AB * D);
        /* scores: rows g .. g + 15 against the block's two halves of 16 keys */
        for (int64_t g = 0; g < Rp; g += 16) {
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t s = 0; s < D / 32; s++) {
                _tile_loadd(2, qb + g * D + 32 * s, 2 * D);
                _tile_loadd(3, kt + s * 2048, 64);
                _tile_loadd(4, kt + s * 2048 + 1024, 64);
                _tile_dpbf16ps(0, 2, 3);
                _tile_dpbf16ps(1, 2, 4);
            }
            _tile_stored(0, st + g * AB, 4 * AB);
            _tile_stored(1, st + g * AB + 16, 4 * AB);
        }
        /* the softmax's step, row by row: keys outside [first, last] hidden */
        const __m512i keys0 = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(b * AB)), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        const __m512i keys1 = _mm512_add_epi32(keys0, _mm512_set1_epi32(16));
        for (int64_t r = 0; r < Rp; r++) {
            const __m512i f = _mm512_set1_epi32(first[r]), e = _mm512_set1_epi32(last[r]);
            const __mmask16 see0 = _mm512_cmpge_epi32_mask(keys0, f) & _mm512_cmple_epi32_mask(keys0, e);
            const __mmask16 see1 = _mm512_cmpge_epi32_mask(keys1, f) & _mm512_cmple_epi32_mask(keys1, e);
            if (!(see0 | see1)) { /* no key of this block: unchanged */
                _mm256_storeu_si256((__m256i *)(pb + r * AB), _mm256_setzero_si256());
                _mm256_storeu_si256((__m256i *)(pb + r * AB + 16), _mm256_setzero_si256());
                continue;
            }
            const __m512 s0 = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), see0, st + r * AB);
            const __m512 s1 = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), see1, st + r * AB + 16);
            const float top = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
            const float best = m[r] > top ? m[r] : top; /* finite: the row sees a key here */
            /* e^(m - best): exactly 1 where the maximum holds (so not computed) */
            const float corr = best > m[r] ? _mm_cvtss_f32(_mm512_castps512_ps128(exp16_neg(_mm512_set1_ps(m[r] - best)))) : 1.0f;
            const __m512 p0 = _mm512_maskz_mov_ps(see0, exp16_neg(_mm512_sub_ps(s0, _mm512_set1_ps(best))));
            const __m512 p1 = _mm512_maskz_mov_ps(see1, exp16_neg(_mm512_sub_ps(s1, _mm512_set1_ps(best))));
            l[r] = l[r] * corr + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
            m[r] = best;
            _mm512_storeu_si512(pb + r * AB, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            if (corr != 1.0f)
                for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), _mm512_set1_ps(corr)));
        }
        /* o += P . V: rows g .. g + 15, 32 dims (two tiles) at a time */
        for (int64_t g = 0; g < Rp; g += 16) {
            _tile_loadd(2, pb + g * AB, 2 * AB);
            for (int64_t c = 0; c < D / 16; c += 2) {
                float *oc = o + g * D + 16 * c;
                _tile_loadd(0, oc, 4 * D);
                _tile_loadd(1, oc + 16, 4 * D);
                _tile_loadd(3, vt + c * 1024, 64);
                _tile_loadd(4, vt + (c + 1) * 1024, 64);
                _tile_dpbf16ps(0, 2, 3);
                _tile_dpbf16ps(1, 2, 4);
                _tile_stored(0, oc, 4 * D);
                _tile_stored(1, oc + 16, 4 * D);
            }
        }
    }
    _tile_release();
    for (int64_t r = 0; r < R; r++) {
        float *dst = j->out + ((i0 + r / group) * j->H + h * group + r % group) * D;
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), inv));
    }
    free(mem);
}

/* attend_chunk's arguments and result (rows.c), in bf16 on AMX tiles. Returns 0, -1 without memory, -2 where it
 * cannot run (no AMX granted, or D not a multiple of 32). */
int attend_chunk_bf16(const float *q, int64_t q_stride, const void *K, const void *V, float *out, int64_t n, int64_t H, int64_t Hkv, int64_t D,
                      const int32_t *table, int64_t p, int64_t key_start, int64_t window, float scale, int kind, int threads) {
    if (bf16_rows_kind() != 2 || D % 32 || n < 1) return -2;
    const int64_t first = window > 0 && p - window + 1 > key_start ? p - window + 1 : key_start; /* the chunk's first query's first key */
    const int64_t b0 = first / AB, nb = (p + n - 1) / AB - b0 + 1;
    abf_job job = {.q = q, .K = K, .V = V, .out = out, .q_stride = q_stride, .n = n, .H = H, .Hkv = Hkv, .D = D, .table = table, .p = p,
                   .key_start = key_start, .window = window, .group = H / Hkv, .qblocks = (n + AQ - 1) / AQ, .b0 = b0, .nb = nb, .klo = first,
                   .khi = p + n, .scale = scale, .kind = kind};
    job.kt = aligned_alloc(64, (size_t)(2 * Hkv * nb * AB * D) * sizeof(uint16_t));
    if (job.kt == NULL) return -1;
    job.vt = job.kt + Hkv * nb * AB * D;
    pool_for(Hkv * nb, threads, pack_item, &job);
    pool_for(Hkv * job.qblocks, threads, query_item, &job);
    free(job.kt);
    return atomic_load_explicit(&job.failed, memory_order_relaxed) ? -1 : 0;
}

#else
int attend_chunk_bf16(const float *q, int64_t q_stride, const void *K, const void *V, float *out, int64_t n, int64_t H, int64_t Hkv, int64_t D,
                      const int32_t *table, int64_t p, int64_t key_start, int64_t window, float scale, int kind, int threads) {
    (void)q, (void)q_stride, (void)K, (void)V, (void)out, (void)n, (void)H, (void)Hkv, (void)D, (void)table, (void)p, (void)key_start;
    (void)window, (void)scale, (void)kind, (void)threads;
    return -2;
}
#endif
