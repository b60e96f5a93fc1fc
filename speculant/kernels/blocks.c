/* All the Transformer blocks of a short pass (decoding, speculative verification) in one call.
 *
 * Python's per-op overhead (module calls, tensor allocation, ctypes argument conversion) came to about a
 * tenth of a decode step of the 1.5B and of the 0.5B draft (timing every kernel call inside forwards of 1
 * token on a 256-token cache; `scripts/step_timing.py` splits a step into matmuls and the rest).
 * This file runs the same kernels (gq.c's matmul, attention.c, rows.c) in the same order as
 * Transformer.forward's Python path:
 *
 *   h = rms_norm(x); qkv = h Wqkv (+b); [q, k heads rms-normed]; attention (rope, cache write); d = att Wo;
 *   [d = rms_norm(d)]; x += d; h = rms_norm(x); gu = h Wgate_up; d = act(gate) * up Wdown; [d = rms_norm(d)]; x += d
 *
 * (bracketed: the architectures that have them; act: silu or gelu_tanh) so its output is bit-identical to that
 * path (tests/test_fused.py checks it for every architecture); it only removes the Python between the kernels.
 * The residual adds are plain float adds, as torch's. Tree passes hand their ancestor mask to the attention;
 * `taps` copies the residual after chosen blocks out (the hidden states that EAGLE-style drafters read), so
 * asking for them keeps the pass on this path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* the kernels of gq.c, attention.c and rows.c (one shared library) */
typedef struct gq_part gq_part;
int gq_matmul(const gq_part *parts, int nparts, const float *x, int64_t M, int64_t K, const float *bias, float *y,
              int64_t N, int nthreads);
int attn_rows_ex(float *qkv, int64_t S, int64_t H, int64_t Hkv, int64_t hd, const float *cos, const float *sin,
                 void *kc, void *vc, int64_t max_len, int64_t start, const uint8_t *mask, const int64_t *pos,
                 int64_t window, float scale, float *out, int kv, int nthreads);
int64_t attn_row_bytes(int64_t hd, int kv);
void rms_norm_rows(const float *x, const float *w, int64_t S, int64_t D, float eps, float *out);
void silu_mul_rows(const float *h, int64_t S, int64_t F, float *act);
void gelu_tanh_mul_rows(const float *h, int64_t S, int64_t F, float *act);

/* One linear layer, as GGMLLinear holds it: its parts (gq.c's gq_part array), bias, output features. */
typedef struct {
    const gq_part *parts;
    int64_t nparts;
    const float *bias; /* or NULL */
    int64_t n;
} gq_linear;

/* One block, as models/fused.py's _Block mirrors it */
typedef struct {
    const float *attn_norm, *ffn_norm; /* [D] */
    gq_linear qkv, o, gate_up, down;
    const float *q_norm, *k_norm;               /* [hd] each, or NULL: no per-head norms */
    const float *post_attn_norm, *post_ffn_norm; /* [D] each, or NULL: none */
    int64_t window;                              /* > 0: a sliding-window layer (attn_rows_ex) */
    int64_t rope;                                /* its rotary tables: tables[2 rope], tables[2 rope + 1] */
    int64_t gelu;                                /* 1: GeGLU (gelu_tanh), 0: SwiGLU */
    float scale;                                 /* the queries' scale, 0: hd ** -0.5 */
} gq_block;

static int mm(const gq_linear *l, const float *x, int64_t S, int64_t K, float *y, int nthreads) {
    return gq_matmul(l->parts, (int)l->nparts, x, S, K, l->bias, y, l->n, nthreads);
}

static void add_rows(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = x[i] + y[i];
}

/* x[S, D] (in/out): the residual stream before the first block, after the last. The KV caches kc,
 * vc are [n_blocks][Hkv][max_len][row], rows of hd values in the cache type kv (attention.c); the S new
 * rows are written at slots start..start+S-1.
 * tables: the rows' rotary tables [S][hd/2] as cos, sin pairs, each block's picked by its `rope`; pos [S] (or NULL:
 * slots) the rows' positions and mask [S][S] (or NULL: causal), as attn_rows_ex;
 * taps [n_blocks] (or NULL): where taps[l] is not NULL, x after block l is copied there ([S, D]).
 * Returns 0, or the first kernel's error code. */
int gq_blocks_ex(const gq_block *blocks, int64_t n_blocks, float *x, int64_t S, int64_t D, int64_t H, int64_t Hkv,
                 int64_t hd, int64_t F, float eps, const float *const *tables, const int64_t *pos, void *kc, void *vc,
                 int64_t max_len, int64_t start, const uint8_t *mask, float *const *taps, int kv, int nthreads) {
    const int64_t W = (H + 2 * Hkv) * hd, A = H * hd;
    /* scratch: h [S, max(D, F)], qkv [S, W], att [S, A], delta [S, D], gu [S, 2F] */
    const int64_t HW = D > F ? D : F;
    float *buf = (float *)malloc(sizeof(float) * S * (HW + W + A + D + 2 * F));
    if (!buf) return -1;
    float *h = buf, *qkv = h + S * HW, *att = qkv + S * W, *delta = att + S * A, *gu = delta + S * D;
    const int64_t layer_cache = Hkv * max_len * attn_row_bytes(hd, kv); /* bytes */
    int rc = 0;
    for (int64_t l = 0; l < n_blocks && !rc; l++) {
        const gq_block *b = blocks + l;
        rms_norm_rows(x, b->attn_norm, S, D, eps, h);
        if ((rc = mm(&b->qkv, h, S, D, qkv, nthreads)))
            break;
        if (b->q_norm) /* each query head, then each key head, as one row of hd (in place) */
            for (int64_t s = 0; s < S; s++) {
                rms_norm_rows(qkv + s * W, b->q_norm, H, hd, eps, qkv + s * W);
                rms_norm_rows(qkv + s * W + A, b->k_norm, Hkv, hd, eps, qkv + s * W + A);
            }
        if ((rc = attn_rows_ex(qkv, S, H, Hkv, hd, tables[2 * b->rope], tables[2 * b->rope + 1],
                               (char *)kc + l * layer_cache, (char *)vc + l * layer_cache, max_len, start, mask, pos,
                               b->window, b->scale, att, kv, nthreads)))
            break;
        if ((rc = mm(&b->o, att, S, A, delta, nthreads)))
            break;
        if (b->post_attn_norm)
            rms_norm_rows(delta, b->post_attn_norm, S, D, eps, delta);
        add_rows(x, delta, S * D);
        rms_norm_rows(x, b->ffn_norm, S, D, eps, h);
        if ((rc = mm(&b->gate_up, h, S, D, gu, nthreads)))
            break;
        (b->gelu ? gelu_tanh_mul_rows : silu_mul_rows)(gu, S, F, h);
        if ((rc = mm(&b->down, h, S, F, delta, nthreads)))
            break;
        if (b->post_ffn_norm)
            rms_norm_rows(delta, b->post_ffn_norm, S, D, eps, delta);
        add_rows(x, delta, S * D);
        if (taps && taps[l])
            memcpy(taps[l], x, sizeof(float) * S * D);
    }
    free(buf);
    return rc;
}

/* gq_blocks_ex for a causal pass at the rows' slots, one rotary table for every block (a block's `rope` 0) */
int gq_blocks(const gq_block *blocks, int64_t n_blocks, float *x, int64_t S, int64_t D, int64_t H, int64_t Hkv,
              int64_t hd, int64_t F, float eps, const float *cos, const float *sin, float *kc, float *vc,
              int64_t max_len, int64_t start, int nthreads) {
    const float *tables[2] = {cos, sin};
    return gq_blocks_ex(blocks, n_blocks, x, S, D, H, Hkv, hd, F, eps, tables, NULL, kc, vc, max_len, start, NULL,
                        NULL, 0, nthreads);
}
