/* The gated delta rule of Qwen3.5's linear-attention layers (models/qwen35.py: DeltaNet), token by token.
 *
 * torch runs one token's recurrence as ~8 ops over the [H][K][V] state, each a full pass over it (the state is
 * 1 MiB a layer at Qwen3.5-2B's shape, bigger than L2), and a verification pass repeats them per token. Here one
 * value head's state (K x V floats, 64 KiB at 128 x 128) stays in cache through both passes of a token, and the
 * states after every token go into one buffer (the cache keeps them for rollback).
 *
 * Per token t and head h, in this order (models/delta_rule.py: delta_rule_reference is the same arithmetic in
 * torch, bit for bit: every op is one IEEE float op, no FMA as the library builds with -ffp-contract=off, and the
 * sums over i run in the same order):
 *     cur = prev * decay;  mem = sum_i k_i cur_i;  delta = (v - mem) * beta
 *     cur = cur + k_i delta (row i);  out = sum_i q_i cur_i
 * A head's work does not depend on S or on the threads, so a pass of S tokens equals S one-token passes.
 *
 * Layouts (float32, contiguous): state0 [H][K][V] (before the pass), states [S][H][K][V] (after each token),
 * q, k [S][H][K], v [S][H][V], beta, decay [S][H], out [S][H][V]. V <= 1024.
 */
#include <stdint.h>

int delta_rule(const float *state0, const float *q, const float *k, const float *v, const float *beta,
               const float *decay, int64_t S, int64_t H, int64_t K, int64_t V, float *states, float *out,
               int threads) {
    if (V > 1024)
        return 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t h = 0; h < H; h++) {
        float mem[1024], delta[1024];
        for (int64_t t = 0; t < S; t++) {
            const float *prev = t ? states + ((t - 1) * H + h) * K * V : state0 + h * K * V;
            float *cur = states + (t * H + h) * K * V;
            const float *kt = k + (t * H + h) * K, *qt = q + (t * H + h) * K, *vt = v + (t * H + h) * V;
            float *o = out + (t * H + h) * V;
            const float g = decay[t * H + h], b = beta[t * H + h];
            for (int64_t j = 0; j < V; j++) {
                cur[j] = prev[j] * g;
                mem[j] = kt[0] * cur[j];
            }
            for (int64_t i = 1; i < K; i++) {
                const float ki = kt[i];
                const float *p = prev + i * V;
                float *c = cur + i * V;
                for (int64_t j = 0; j < V; j++) {
                    c[j] = p[j] * g;
                    mem[j] = mem[j] + ki * c[j];
                }
            }
            for (int64_t j = 0; j < V; j++)
                delta[j] = (vt[j] - mem[j]) * b;
            for (int64_t i = 0; i < K; i++) {
                const float ki = kt[i], qi = qt[i];
                float *c = cur + i * V;
                for (int64_t j = 0; j < V; j++) {
                    c[j] = c[j] + ki * delta[j];
                    o[j] = i ? o[j] + qi * c[j] : qi * c[j];
                }
            }
        }
    }
    return 0;
}

/* The rest of a Gated DeltaNet layer around the rule, and a gated full-attention layer: one call each instead of
 * ~40 small torch ops a layer (models/qwen35.py). Each row is computed alone with the same scalar arithmetic
 * whatever S or the threads, so a k-row pass still equals k one-row passes bit for bit; the results are close to
 * the torch path's, not equal to them (expf, and sums in another order). */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

int attn_rows_ex(float *qkv, int64_t S, int64_t H, int64_t Hkv, int64_t hd, const float *cos, const float *sin,
                 void *kc, void *vc, int64_t max_len, int64_t start, const uint8_t *mask, const int64_t *pos,
                 int64_t window, float scale, float *out, int kv, int nthreads); /* attention.c */

static float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
/* torch's softplus (beta 1, threshold 20) */
static float softplusf_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* dst = x / sqrt(mean(x^2) + eps) * w over n values (an RMS norm) */
static void rms_row(const float *x, const float *w, int64_t n, float eps, float *dst) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss = ss + x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) dst[i] = x[i] * r * w[i];
}

/* x * rsqrt(sum x^2 + 1e-6) * scale over n values (the rule's q and k) */
static void l2_row(const float *x, int64_t n, float scale, float *dst) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss = ss + x[i] * x[i];
    const float r = 1.0f / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++) dst[i] = x[i] * r * scale;
}

/* One pass of S rows through a Gated DeltaNet mixer, from in_proj's output to out_proj's input.
 *   p [S][P]        in_proj's rows: conv inputs (C) | z (hv dv) | b (hv) | a (hv)
 *   xs [K-1+S][C]   the convolution window, then this pass's conv inputs; conv [K][C] (tap j a row)
 *   neg_a, dt_bias [hv]; norm [dv]; state0 [hv][dk][dv]; states [S][hv][dk][dv] (after each row)
 *   out [S][hv dv]  rms(rule output per head) * norm * silu(z)
 * tiled: value head i reads key head i % hk, else i / (hv / hk). C and dv multiples of 8. Returns 0, 1 for
 * dv > 1024, -1 out of memory, -2 for C or dv not a multiple of 8. */
int qwen35_deltanet(const float *p, int64_t P, const float *xs, const float *conv, int64_t K, int64_t S, int64_t C,
                    int64_t hk, int64_t hv, int64_t dk, int64_t dv, int tiled, const float *neg_a,
                    const float *dt_bias, const float *norm, float eps, const float *state0, float *states, float *out,
                    int threads) {
    if (C % 8 || dv % 8)
        return -2;
    const int64_t vd = hv * dv, per = hv / hk;
    float *mixed = malloc(sizeof(float) * C), *q = malloc(sizeof(float) * S * hv * dk),
          *k = malloc(sizeof(float) * S * hv * dk), *v = malloc(sizeof(float) * S * vd),
          *beta = malloc(sizeof(float) * S * hv), *decay = malloc(sizeof(float) * S * hv),
          *o = malloc(sizeof(float) * S * vd);
    int rc = -1;
    if (!mixed || !q || !k || !v || !beta || !decay || !o)
        goto done;
    const float qscale = 1.0f / sqrtf((float)dk);
    for (int64_t t = 0; t < S; t++) {
        for (int64_t c = 0; c < C; c += 8) { /* the taps in one fixed order; silu(x) = x sigmoid(x) */
            __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(xs + t * C + c), _mm256_loadu_ps(conv + c));
            for (int64_t j = 1; j < K; j++)
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(xs + (t + j) * C + c),
                                                       _mm256_loadu_ps(conv + j * C + c)));
            _mm256_storeu_ps(mixed + c, _mm256_mul_ps(acc, sigmoid8(acc)));
        }
        for (int64_t h = 0; h < hv; h++) {
            const int64_t src = tiled ? h % hk : h / per;
            l2_row(mixed + src * dk, dk, qscale, q + (t * hv + h) * dk);
            l2_row(mixed + (hk + src) * dk, dk, 1.0f, k + (t * hv + h) * dk);
        }
        memcpy(v + t * vd, mixed + 2 * hk * dk, sizeof(float) * vd);
        const float *b = p + t * P + C + vd, *a = b + hv;
        for (int64_t h = 0; h < hv; h++) {
            beta[t * hv + h] = sigmoidf_(b[h]);
            decay[t * hv + h] = expf(neg_a[h] * softplusf_(a[h] + dt_bias[h]));
        }
    }
    rc = delta_rule(state0, q, k, v, beta, decay, S, hv, dk, dv, states, o, threads);
    if (rc)
        goto done;
    for (int64_t t = 0; t < S; t++) {
        const float *z = p + t * P + C;
        for (int64_t h = 0; h < hv; h++) {
            float *row = out + t * vd + h * dv;
            rms_row(o + t * vd + h * dv, norm, dv, eps, row);
            for (int64_t j = 0; j < dv; j += 8) {
                const __m256 g = _mm256_loadu_ps(z + h * dv + j);
                _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), _mm256_mul_ps(g, sigmoid8(g))));
            }
        }
    }
done:
    free(mixed), free(q), free(k), free(v), free(beta), free(decay), free(o);
    return rc;
}

/* A gated full-attention layer's short pass, from the qkv projection to o_proj's input.
 *   p [S][(2H + 2Hkv) hd]  per query head its query then its gate, then the keys, then the values
 *   q_norm, k_norm [hd]; cos, sin [S][rd / 2]: the rotary of the first rd values of each head (rotate-half)
 *   kc, vc, max_len, start, kv: the layer's cache as attention.c's attn_rows_ex takes it
 *   out [S][H hd]  attention * sigmoid(gate)
 * Returns attn_rows_ex's code (0 done). */
int qwen35_attention(const float *p, int64_t S, int64_t H, int64_t Hkv, int64_t hd, int64_t rd, const float *q_norm,
                     const float *k_norm, float eps, const float *cos, const float *sin, void *kc, void *vc,
                     int64_t max_len, int64_t start, int kv, float *out, int threads) {
    const int64_t P = (2 * H + 2 * Hkv) * hd, W = (H + 2 * Hkv) * hd, half = rd / 2;
    float *qkv = malloc(sizeof(float) * S * W), *ones = malloc(sizeof(float) * S * hd / 2),
          *zeros = calloc(S * hd / 2, sizeof(float));
    int rc = -1;
    if (!qkv || !ones || !zeros)
        goto done;
    for (int64_t i = 0; i < S * hd / 2; i++) ones[i] = 1.0f;
    for (int64_t s = 0; s < S; s++) {
        const float *row = p + s * P, *c = cos + s * half, *sn = sin + s * half;
        float *dst = qkv + s * W;
        for (int64_t h = 0; h < H + Hkv; h++) {
            float *x = dst + h * hd;
            if (h < H)
                rms_row(row + h * 2 * hd, q_norm, hd, eps, x);
            else
                rms_row(row + 2 * H * hd + (h - H) * hd, k_norm, hd, eps, x);
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * sn[i];
                x[i + half] = x2 * c[i] + x1 * sn[i];
            }
        }
        memcpy(dst + (H + Hkv) * hd, row + (2 * H + Hkv) * hd, sizeof(float) * Hkv * hd);
    }
    /* attn_rows_ex rotates whole heads; rotated here already, so its tables are the identity (x * 1 - y * 0 is x) */
    rc = attn_rows_ex(qkv, S, H, Hkv, hd, ones, zeros, kc, vc, max_len, start, NULL, NULL, 0, 0.0f, out, kv, threads);
    if (rc)
        goto done;
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = 0; h < H; h++) {
            const float *g = p + s * P + h * 2 * hd + hd;
            float *o = out + s * H * hd + h * hd;
            for (int64_t i = 0; i < hd; i += 8)
                _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), sigmoid8(_mm256_loadu_ps(g + i))));
        }
done:
    free(qkv), free(ones), free(zeros);
    return rc;
}
