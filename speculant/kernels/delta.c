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
