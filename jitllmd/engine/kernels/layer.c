/* A decoder layer's decode step over quantized weights in one call: what DecoderBlock does for a step's single-token
 * rows, kernel by kernel, without a return to Python between them (each return, with its wrapper, ctypes conversions
 * and the allocation of the next output, cost ~20 us: a third of a 135M model's step).
 *
 * decode_layer runs, for R rows of x [R, hidden] (Llama's layer; Gemma's adds what is in brackets):
 *     qkv  = quant(RMSNorm(x) * input_norm) (+ qkv bias)       quant_rows, the norm folded, the bias added in its sums
 *     [q, k = RMSNorm per head of q, k]                        rms_norm_heads, in qkv's own rows
 *     q, k = RoPE(q, k)                                        rope_rows, in qkv's own rows
 *     attn = attention(q, k, v) with each row's session KV     attend_rows, which writes k and v into the cache first
 *     y    = x + quant(attn) @ o                               quant_rows, the residual added in its sums
 *          [x + RMSNorm(quant(attn) @ o) * attn_out_norm]      ... or quant_rows, then rms_norm_add_rows
 *     y    = y + quant(act(gate) * up) @ down, gate_up = quant(RMSNorm(y) * post_norm) @ gate_up (act: silu [or gelu])
 *          [y + RMSNorm(quant(...) @ down) * mlp_out_norm]
 * the same calls with the same arguments as the layer's Python path makes them, so it gives the same bits. Each
 * projection is its runs of same-format rows stacked along the output (a Q5_0 q/k and a Q8_0 v: two runs).
 *
 * Tokens a `many` flag marks (a short prompt feed too long for the few-row kernel to win: layers/quant.py's
 * rows_feed) take a prompt chunk's products instead: the int8 GEMM (gemm_rows: quant_rows' rounding of x and its
 * integer sums, its f32 steps in another order; flag MANY_GEMM), or where the CPU has bf16 units x and the weights
 * rounded to bf16 (bf16_round, bf16_rows; MANY_BF16). Each token's result is still its own, whatever the tokens
 * beside it. Each projection is then one call per run of consecutive tokens of one kind.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h" /* its inputs (PLAIN, NORMED, GATED) */

#define MAX_RUNS 4
enum { MANY_ROWS = 0, MANY_GEMM = 1, MANY_BF16 = 2 }; /* a token's `many` flag: which product it takes */

int quant_rows(const float *x, const uint8_t *W, float *y, int64_t T, int64_t K, int64_t N, int64_t ldy, int type, int input, const float *norm_w,
               float eps, const float *r, int64_t ldr, int threads);
int gemm_rows(const float *x, const uint8_t *W, float *y, int64_t T, int64_t K, int64_t N, int64_t ldy, int type, int input, const float *norm_w,
              float eps, const float *r, int64_t ldr, int threads);
int bf16_round(const float *x, uint16_t *xb, int64_t T, int64_t K, int input, const float *norm_w, float eps, int threads);
int bf16_rows(const uint16_t *xb, int64_t T, int64_t K, int nruns, const uint8_t *const *W, const int64_t *w_stride, const int64_t *rows,
              const int *types, float *y, int64_t ldy, const float *add, int64_t ld_add, int threads);
void rope_rows(float *x, int64_t stride, const float *cos, const float *sin, int64_t T, int64_t heads, int64_t D, int threads);
void rms_norm_add_rows(const float *x, const float *w, const float *r, float *y, int64_t T, int64_t D, float eps, int threads);
void rms_norm_heads(float *x, int64_t stride, const float *w, int64_t T, int64_t heads, int64_t D, float eps, int threads);
int attend_rows(const float *q, const float *k_new, const float *v_new, float *out, const int64_t *k_ptrs, const int64_t *v_ptrs,
                 const int64_t *lengths, const int64_t *starts, const int64_t *tables, int64_t R, int64_t H, int64_t Hkv, int64_t D, float scale,
                 int kind, int threads);

/* A projection: `runs` runs of rows of `k` inputs, run i `rows[i]` rows of ggml type `type[i]` at w[i]. */
typedef struct {
    int64_t runs, k;
    const uint8_t *w[MAX_RUNS];
    int64_t type[MAX_RUNS], rows[MAX_RUNS];
} qproj;

/* A layer (every field 8 bytes: ctypes lays it out alike). qkv_bias, q_norm, k_norm, attn_out_norm and mlp_out_norm
 * may be NULL (Llama's have none of the norms); gate: the down projection's input (GATED: silu, GATED_GELU: gelu). */
typedef struct {
    qproj qkv, o, gate_up, down;
    const float *qkv_bias, *input_norm, *post_norm;
    double eps, scale;
    int64_t H, Hkv, D, hidden, inter;
    const float *q_norm, *k_norm, *attn_out_norm, *mlp_out_norm;
    int64_t gate;
} qlayer;

/* Tokens [t0, t1)'s bf16 product (MANY_BF16): their a rounded to bf16 once, every run in one bf16_rows call. */
static int project_bf16(const qproj *p, const float *x, float *y, int64_t n, int64_t ldy, int input, const float *norm_w, float eps,
                        const float *add, int64_t ldr, int threads) {
    uint16_t *xb = malloc((size_t)((n + 31) / 32 * 32 * p->k) * sizeof(uint16_t));
    if (!xb) return -1;
    int types[MAX_RUNS];
    const int64_t stride[MAX_RUNS] = {0};
    for (int64_t i = 0; i < p->runs; i++) types[i] = (int)p->type[i];
    int rc = bf16_round(x, xb, n, p->k, input, norm_w, eps, threads);
    if (!rc) rc = bf16_rows(xb, n, p->k, (int)p->runs, p->w, stride, p->rows, types, y, ldy, add, ldr, threads);
    free(xb);
    return rc;
}

/* y [T, out] (rows ldy apart) = add (+ its row t at ldr, or with ldr 0 a bias) + a @ W.T, a made from x per input;
 * token t through quant_rows, or as many[t] says (NULL: quant_rows for all): one call per run of tokens of one kind
 * (and per run of rows, but for bf16_rows, which takes them all at once). */
static int project(const qproj *p, const float *x, float *y, int64_t T, int64_t ldy, int input, const float *norm_w, float eps, const float *add,
                   int64_t ldr, const uint8_t *many, int threads) {
    const int64_t ldx = IS_GATED(input) ? 2 * p->k : p->k;
    for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
        const int kind = many ? many[t0] : MANY_ROWS;
        for (t1 = t0 + 1; t1 < T && (many ? many[t1] : MANY_ROWS) == kind; t1++) {
        }
        const float *a = add && ldr ? add + t0 * ldr : add;
        if (kind == MANY_BF16) {
            const int rc = project_bf16(p, x + t0 * ldx, y + t0 * ldy, t1 - t0, ldy, input, norm_w, eps, a, ldr, threads);
            if (rc) return rc;
            continue;
        }
        for (int64_t i = 0, col = 0; i < p->runs; col += p->rows[i], i++) {
            const int rc = (kind == MANY_GEMM ? gemm_rows : quant_rows)(x + t0 * ldx, p->w[i], y + t0 * ldy + col, t1 - t0, p->k, p->rows[i], ldy,
                                                                      (int)p->type[i], input, norm_w, eps, a ? a + col : NULL, ldr, threads);
            if (rc) return rc;
        }
    }
    return 0;
}

/* Layer L over R single-token rows: x [R, hidden] -> y [R, hidden] (y may not be x). cos, sin [R, D]: the rows'
 * RoPE tables (rope_rows's); row r's cache k_ptrs[r], v_ptrs[r] (the layer's pages, rows of kind `kv`: simd.h) through its page
 * table at tables[r] (rows.c attend_rows), its new token at
 * position lengths[r] - 1, attending from starts[r]; many: NULL, or R flags (MANY_*), which product each row takes.
 * Returns 0, or -1 without memory. */
int decode_layer(const qlayer *L, const float *x, float *y, int64_t R, const float *cos, const float *sin, const int64_t *k_ptrs,
                 const int64_t *v_ptrs, const int64_t *lengths, const int64_t *starts, const int64_t *tables, int kv, const uint8_t *many,
                 int threads) {
    const int64_t H = L->H, Hkv = L->Hkv, D = L->D, W = (H + 2 * Hkv) * D, hidden = L->hidden, I = L->inter;
    const float eps = (float)L->eps;
    const int64_t packed = R > 1 ? R * W : 0; /* several rows: q, k and v each packed row after row, as attend_rows reads them */
    const int64_t normed = L->attn_out_norm || L->mlp_out_norm ? R * hidden : 0; /* a sublayer's output before its norm */
    float *qkv = malloc((size_t)(R * W + R * H * D + R * 2 * I + packed + normed) * sizeof(float));
    if (!qkv) return -1;
    float *attn = qkv + R * W, *gate_up = attn + R * H * D, *pack = gate_up + R * 2 * I, *out = pack + packed;
    int rc = project(&L->qkv, x, qkv, R, W, NORMED, L->input_norm, eps, L->qkv_bias, 0, many, threads);
    if (!rc) {
        if (L->q_norm) rms_norm_heads(qkv, W, L->q_norm, R, H, D, eps, threads);
        if (L->k_norm) rms_norm_heads(qkv + H * D, W, L->k_norm, R, Hkv, D, eps, threads);
        rope_rows(qkv, W, cos, sin, R, H + Hkv, D, threads);
        const float *q = qkv, *k = qkv + H * D, *v = qkv + (H + Hkv) * D;
        if (R > 1) {
            float *pq = pack, *pk = pack + R * H * D, *pv = pk + R * Hkv * D;
            for (int64_t r = 0; r < R; r++) {
                memcpy(pq + r * H * D, qkv + r * W, (size_t)(H * D) * sizeof(float));
                memcpy(pk + r * Hkv * D, qkv + r * W + H * D, (size_t)(Hkv * D) * sizeof(float));
                memcpy(pv + r * Hkv * D, qkv + r * W + (H + Hkv) * D, (size_t)(Hkv * D) * sizeof(float));
            }
            q = pq;
            k = pk;
            v = pv;
        }
        int64_t keys = 0; /* attention's multiply-adds, about: a short history is quicker on one thread */
        for (int64_t r = 0; r < R; r++) keys += lengths[r] - starts[r];
        rc = attend_rows(q, k, v, attn, k_ptrs, v_ptrs, lengths, starts, tables, R, H, Hkv, D, (float)L->scale, kv, keys * H * D >= (1 << 15) ? threads : 1);
        if (!rc && L->attn_out_norm) {
            rc = project(&L->o, attn, out, R, hidden, PLAIN, NULL, 0.0f, NULL, 0, many, threads);
            if (!rc) rms_norm_add_rows(out, L->attn_out_norm, x, y, R, hidden, eps, threads);
        } else if (!rc) {
            rc = project(&L->o, attn, y, R, hidden, PLAIN, NULL, 0.0f, x, hidden, many, threads);
        }
    }
    if (!rc) rc = project(&L->gate_up, y, gate_up, R, 2 * I, NORMED, L->post_norm, eps, NULL, 0, many, threads);
    if (!rc && L->mlp_out_norm) {
        rc = project(&L->down, gate_up, out, R, hidden, (int)L->gate, NULL, 0.0f, NULL, 0, many, threads);
        if (!rc) rms_norm_add_rows(out, L->mlp_out_norm, y, y, R, hidden, eps, threads);
    } else if (!rc) {
        rc = project(&L->down, gate_up, y, R, hidden, (int)L->gate, NULL, 0.0f, y, hidden, many, threads); /* each y element read, then written, by one thread */
    }
    free(qkv);
    return rc ? -1 : 0;
}

/* Layers 0 .. n - 1 of a decode step in one call: decode_layer over each in turn, each reading what the one before
 * wrote (x, then two buffers in turn, the last layer's into y), so a step returns to Python once, not once a layer.
 * meta: per layer its five int64 arrays [R] (k_ptrs, v_ptrs, lengths, starts, tables), [n][5][R]; cos, sin: per
 * layer its RoPE rows. The same calls as n decode_layer calls: the same bits. */
int decode_stack(const qlayer *const *layers, int64_t n, const float *x, float *y, int64_t R, const float *const *cos, const float *const *sin,
                 const int64_t *meta, int kv, const uint8_t *many, int threads) {
    if (n <= 0) return 0;
    const int64_t hidden = layers[0]->hidden;
    float *buf = n > 1 ? malloc((size_t)(2 * R * hidden) * sizeof(float)) : NULL;
    if (n > 1 && !buf) return -1;
    const float *in = x;
    int rc = 0;
    for (int64_t l = 0; l < n && !rc; l++) {
        float *out = l == n - 1 ? y : buf + (l % 2) * R * hidden;
        const int64_t *m = meta + l * 5 * R;
        rc = decode_layer(layers[l], in, out, R, cos[l], sin[l], m, m + R, m + 2 * R, m + 3 * R, m + 4 * R, kv, many, threads);
        in = out;
    }
    free(buf);
    return rc;
}
