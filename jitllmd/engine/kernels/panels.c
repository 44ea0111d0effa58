/* f32 projections over weights stored as column panels, for x86 CPUs with AVX2 and FMA: y[m, n] = sum_k x[m, k] *
 * W[n, k] for any number of rows m, a prompt's hundreds or a decode step's one.
 *
 * The layout. A weight [N, K] is rewritten in place (same bytes, same size) as panels of PANEL = 24 outputs: panel p
 * holds outputs p*24 .. p*24 + w - 1 (w = 24, or what is left for the last one) as [K][w], so one k's 24 weights are
 * three adjacent vectors. The product then runs as a BLIS-style GEMM: a block of x rows is packed once into
 * [k][4] groups, and a 4 x 24 register tile (12 accumulators) sweeps K with three weight loads and four broadcasts
 * per step. No weight is repacked per call: on 2-core Zen 3 this reaches ~185 GFLOP/s where MKL's sgemm, which
 * packs the weight on every call, reaches ~145 (bench/decode.py, "prompt").
 *
 * Every output (m, n) is summed in the same order (K in blocks of KC, each block's partial sum added to the last)
 * whatever M is and however the work is split between threads: a row's result does not depend on the rows that
 * share its step.
 * Built by jitllmd/engine/kernels/build.py with rows.c; the loops run on pool.c's threads (pool.h).
 */
#include <immintrin.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "simd.h"

#define PANEL 24 /* outputs per panel: three 8-float vectors */
#define GROUP 4  /* x rows per register tile */
#define KC 256   /* K per block: a panel's block (24 KB) stays in L1 while the row groups pass */
#define MC 144   /* x rows per packed block (144 KB, in L2) */
#define FMA _mm256_fmadd_ps

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

typedef struct {
    float *W;
    const float *tmp;
    int64_t N, K;
} pack_job;

/* Panel p of pack_panels. */
static void pack_item(void *arg, int64_t p) {
    const pack_job *j = arg;
    const int64_t K = j->K, n0 = p * PANEL, w = min64(PANEL, j->N - n0);
    float *dst = j->W + n0 * K;
    for (int64_t c = 0; c < w; c++) {
        const float *src = j->tmp + (n0 + c) * K;
        for (int64_t k = 0; k < K; k++) dst[k * w + c] = src[k];
    }
}

/* W [N, K] row-major -> the panel layout, in W's own storage; tmp holds N * K floats for the copy. The panels are
 * pool.c's items. */
void pack_panels(float *W, float *tmp, int64_t N, int64_t K, int threads) {
    memcpy(tmp, W, (size_t)(N * K) * sizeof(float));
    pack_job job = {.W = W, .tmp = tmp, .N = N, .K = K};
    pool_for((N + PANEL - 1) / PANEL, threads, pack_item, &job);
}

/* One tile: rows n (1..4) of packed a ([kc][4]) against a full panel's block b ([kc][24]); c has row stride ldc. */
static inline __attribute__((always_inline)) void tile(int64_t kc, const float *a, const float *b, float *c, const float *rc, int64_t ldc, int first,
                                                       const int n) {
    __m256 acc[GROUP][3];
    /* The tile's output rows (and the residual's) are read or written only after the K loop, and are rarely in cache
     * (a wide product's rows are megabytes apart): fetched now, their misses overlap the FMAs (~4% of a prompt). */
    for (int r = 0; r < n; r++) {
        acc[r][0] = acc[r][1] = acc[r][2] = _mm256_setzero_ps();
        const float *cr = c + r * ldc;
        __builtin_prefetch(cr, 1, 3);
        __builtin_prefetch(cr + 16, 1, 3);
        __builtin_prefetch(cr + 23, 1, 3);
        if (first && rc) {
            _mm_prefetch((const char *)(rc + r * ldc), _MM_HINT_T0);
            _mm_prefetch((const char *)(rc + r * ldc + 16), _MM_HINT_T0);
            _mm_prefetch((const char *)(rc + r * ldc + 23), _MM_HINT_T0);
        }
    }
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8), b2 = _mm256_loadu_ps(b + 16);
        for (int r = 0; r < n; r++) {
            const __m256 x = _mm256_broadcast_ss(a + r);
            acc[r][0] = FMA(x, b0, acc[r][0]);
            acc[r][1] = FMA(x, b1, acc[r][1]);
            acc[r][2] = FMA(x, b2, acc[r][2]);
        }
        a += GROUP;
        b += PANEL;
    }
    for (int r = 0; r < n; r++) {
        float *cr = c + r * ldc;
        const float *base = first ? (rc ? rc + r * ldc : NULL) : cr; /* what this block's sum adds to */
        for (int v = 0; v < 3; v++) {
            const __m256 s = base ? _mm256_add_ps(_mm256_loadu_ps(base + 8 * v), acc[r][v]) : acc[r][v];
            _mm256_storeu_ps(cr + 8 * v, s);
        }
    }
}

/* The last panel when narrower than 24 (w outputs): plain loops, same summation order per output. */
static void tile_narrow(int64_t kc, const float *a, const float *b, int64_t w, float *c, const float *rc, int64_t ldc, int first, int n) {
    float acc[GROUP][PANEL];
    memset(acc, 0, sizeof(acc));
    for (int64_t k = 0; k < kc; k++)
        for (int r = 0; r < n; r++)
            for (int64_t j = 0; j < w; j++) acc[r][j] = __builtin_fmaf(a[k * GROUP + r], b[k * w + j], acc[r][j]);
    for (int r = 0; r < n; r++)
        for (int64_t j = 0; j < w; j++) {
            const int64_t at = r * ldc + j;
            c[at] = first ? (rc ? rc[at] + acc[r][j] : acc[r][j]) : c[at] + acc[r][j];
        }
}

/* What the product's rows are, made from x as they are packed (simd.h's inputs: the pass a separate kernel would make,
 * saved; NORMED with inv[m] its rows' 1 / rms). */

/* Rows [0, rows) of the product's input, columns pc .. pc + kc, into groups of four: [rows/4][kc][4], zero padded.
 * NORMED and GATED need kc a multiple of 8. */
static void pack_rows(const float *x, float *ap, int64_t rows, int64_t K, int64_t pc, int64_t kc, int input, const float *norm_w, const float *inv) {
    for (int64_t g = 0; g < rows; g += GROUP) {
        float *dst = ap + g * kc;
        const int n = (int)min64(GROUP, rows - g);
        if (input == PLAIN) {
            for (int64_t k = 0; k < kc; k++) {
                for (int r = 0; r < n; r++) dst[k * GROUP + r] = x[(g + r) * K + pc + k];
                for (int r = n; r < GROUP; r++) dst[k * GROUP + r] = 0.0f;
            }
            continue;
        }
        for (int64_t k = 0; k < kc; k += 8) {
            __m256 v[GROUP]; /* the group's rows at columns k .. k + 7, then transposed to [k][4] */
            for (int r = 0; r < GROUP; r++) {
                if (r >= n) {
                    v[r] = _mm256_setzero_ps();
                } else if (input == NORMED) {
                    const float *xr = x + (g + r) * K + pc + k;
                    v[r] = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr), _mm256_set1_ps(inv[g + r])), _mm256_loadu_ps(norm_w + pc + k));
                } else {
                    const float *xr = x + (g + r) * 2 * K + pc + k;
                    v[r] = gate_mul8(input, _mm256_loadu_ps(xr), _mm256_loadu_ps(xr + K));
                }
            }
            const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
            const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
            const __m256 c0 = _mm256_shuffle_ps(t0, t2, 0x44), c1 = _mm256_shuffle_ps(t0, t2, 0xEE); /* columns 0 1 | 4 5 */
            const __m256 c2 = _mm256_shuffle_ps(t1, t3, 0x44), c3 = _mm256_shuffle_ps(t1, t3, 0xEE); /* columns 2 3 | 6 7 */
            float *d = dst + k * GROUP;
            _mm256_storeu_ps(d, _mm256_permute2f128_ps(c0, c1, 0x20));
            _mm256_storeu_ps(d + 8, _mm256_permute2f128_ps(c2, c3, 0x20));
            _mm256_storeu_ps(d + 16, _mm256_permute2f128_ps(c0, c1, 0x31));
            _mm256_storeu_ps(d + 24, _mm256_permute2f128_ps(c2, c3, 0x31));
        }
    }
}

/* y rows [ic, ic + mc) x panels [p0, p1), K block pc .. pc + kc, the rows packed in ap ([mc/4][kc][4]). */
static void tiles(const float *ap, const float *P, const float *res, float *y, int64_t ic, int64_t mc, int64_t p0, int64_t p1, int64_t N, int64_t K,
                  int64_t pc, int64_t kc) {
    const int first = pc == 0;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * PANEL, w = min64(PANEL, N - n0);
        const float *b = P + n0 * K + pc * w;
        /* the next panel's block, fetched into L2 a share per tile while this one's tiles run */
        const int64_t nw = p + 1 < p1 ? min64(PANEL, N - n0 - PANEL) : 0;
        const char *nb = (const char *)(P + (n0 + PANEL) * K + pc * nw);
        const int64_t lines = nw * kc * 4 / 64, num_tiles = (mc + GROUP - 1) / GROUP, per = (lines + num_tiles - 1) / num_tiles;
        for (int64_t g = 0; g < mc; g += GROUP) {
            for (int64_t l = g / GROUP * per; l < (g / GROUP + 1) * per && l < lines; l++) _mm_prefetch(nb + l * 64, _MM_HINT_T1);
            const float *a = ap + g * kc;
            float *c = y + (ic + g) * N + n0;
            const float *rc = res ? res + (ic + g) * N + n0 : NULL;
            const int n = (int)min64(GROUP, mc - g);
            if (w < PANEL) tile_narrow(kc, a, b, w, c, rc, N, first, n);
            else switch (n) {
                case 1: tile(kc, a, b, c, rc, N, first, 1); break;
                case 2: tile(kc, a, b, c, rc, N, first, 2); break;
                case 3: tile(kc, a, b, c, rc, N, first, 3); break;
                default: tile(kc, a, b, c, rc, N, first, 4); break;
            }
        }
    }
}

typedef struct {
    const float *x, *P, *res, *norm_w;
    float *y, *inv, *packed; /* inv: rows' 1 / rms (NORMED), by row; packed: every row, every K block (panel_item) */
    int64_t M, N, K, panels, rows_per_item;
    float eps;
    int input;
    _Atomic int failed; /* set by an item that found no memory for its packed rows */
} panel_job;

/* y rows [i * rows_per_item, ...) (at most MC) x all panels: packs its rows per K block into its own buffer. */
static void row_item(void *arg, int64_t i) {
    panel_job *j = arg;
    const int64_t K = j->K, m0 = i * j->rows_per_item, mc = min64(j->M - m0, j->rows_per_item);
    float *ap = aligned_alloc(64, sizeof(float) * (MC + GROUP) * KC);
    if (ap == NULL) {
        atomic_store_explicit(&j->failed, 1, memory_order_relaxed);
        return;
    }
    if (j->input == NORMED)
        for (int64_t m = m0; m < m0 + mc; m++) j->inv[m] = inv_rms(j->x + m * K, K, j->eps);
    for (int64_t pc = 0; pc < K; pc += KC) {
        const int64_t kc = min64(KC, K - pc);
        pack_rows(j->x + m0 * (IS_GATED(j->input) ? 2 * K : K), ap, mc, K, pc, kc, j->input, j->norm_w, j->inv ? j->inv + m0 : NULL);
        tiles(ap, j->P, j->res, j->y, m0, mc, 0, j->panels, j->N, K, pc, kc);
    }
    free(ap);
}

/* All y rows x panel i, from the rows packed once for every item: the panel's weights are read in order, once. */
static void panel_item(void *arg, int64_t i) {
    const panel_job *j = arg;
    const int64_t K = j->K, rows = (j->M + GROUP - 1) / GROUP * GROUP; /* packed's K block pc: [rows/4][kc][4] at pc * rows */
    for (int64_t pc = 0; pc < K; pc += KC) tiles(j->packed + pc * rows, j->P, j->res, j->y, 0, j->M, i, i + 1, j->N, K, pc, min64(KC, K - pc));
}

/* y [M, N] = a [M, K] @ W.T (+ res [M, N], a residual stream, where res is not NULL; it may be y itself) with W in
 * the panel layout, where a is x (input PLAIN), RMSNorm(x) * norm_w with epsilon eps (NORMED; K a multiple of 8) or
 * act(gate) * up of x [M, 2K] (GATED: silu, GATED_GELU: gelu; K a multiple of 8). On pool.c's threads. Many rows: items of up to MC rows,
 * each packing its own; few rows (a decode step): the rows are packed once and each panel is an item, so each reads
 * its share of the weights once. Returns 0, -1 without memory. */
int panel_linear(const float *x, const float *P, const float *res, float *y, int64_t M, int64_t N, int64_t K, int input,
                 const float *norm_w, float eps, int threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const int by_rows = M >= 16 * threads;
    panel_job job = {.x = x, .P = P, .res = res, .norm_w = norm_w, .y = y, .M = M, .N = N, .K = K, .panels = panels, .eps = eps, .input = input};
    if (M <= 0) return 0;
    if (input == NORMED && (job.inv = malloc(sizeof(float) * (size_t)M)) == NULL) return -1;
    if (by_rows) {
        /* an item a thread, two from 64 rows a thread (each item reads all the weights: fewer rows would read them
         * for too little work), of at most MC rows in whole groups */
        const int64_t items = (threads > 1 ? threads : 1) * (M >= 64 * threads ? 2 : 1);
        job.rows_per_item = min64(MC, ((M + items - 1) / items + GROUP - 1) / GROUP * GROUP);
        pool_for((M + job.rows_per_item - 1) / job.rows_per_item, threads, row_item, &job);
    } else {
        const int64_t rows = (M + GROUP - 1) / GROUP * GROUP;
        job.packed = aligned_alloc(64, sizeof(float) * (size_t)((rows * K + 15) / 16 * 16)); /* a multiple of 64 bytes */
        if (job.packed == NULL) {
            free(job.inv);
            return -1;
        }
        if (input == NORMED)
            for (int64_t m = 0; m < M; m++) job.inv[m] = inv_rms(x + m * K, K, eps);
        for (int64_t pc = 0; pc < K; pc += KC) pack_rows(x, job.packed + pc * rows, M, K, pc, min64(KC, K - pc), input, norm_w, job.inv);
        pool_for(panels, threads, panel_item, &job);
        free(job.packed);
    }
    free(job.inv);
    return atomic_load_explicit(&job.failed, memory_order_relaxed) ? -1 : 0;
}
