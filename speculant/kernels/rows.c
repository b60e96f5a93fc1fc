/* The element-wise ops of a layer, per row: RMS norm, SwiGLU's silu(gate) * up and GeGLU's gelu_tanh(gate) * up.
 *
 * torch spends tens of microseconds on F.rms_norm of one row (it decomposes into ~8 ops) and on
 * silu + mul, which over a 24-layer model came to about a seventh of the 0.5B draft's decode step
 * (`scripts/step_timing.py`). Here each is one call of a few microseconds. A row is computed by one thread with the same
 * instructions whatever the number of rows, so results do not depend on how many rows share a pass.
 *
 * Layouts (float32, contiguous): x, out [S][D]; w [D]; h [S][2F] = gate | up; act [S][F].
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* out = x / sqrt(mean(x^2) + eps) * w   (D a multiple of 8) */
void rms_norm_rows(const float *x, const float *w, int64_t S, int64_t D, float eps, float *out) {
    for (int64_t s = 0; s < S; s++) {
        const float *xr = x + s * D;
        float *o = out + s * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 16 <= D; d += 16) {
            const __m256 v0 = _mm256_loadu_ps(xr + d), v1 = _mm256_loadu_ps(xr + d + 8);
            a0 = _mm256_fmadd_ps(v0, v0, a0);
            a1 = _mm256_fmadd_ps(v1, v1, a1);
        }
        for (; d < D; d += 8) {
            const __m256 v = _mm256_loadu_ps(xr + d);
            a0 = _mm256_fmadd_ps(v, v, a0);
        }
        const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum(_mm256_add_ps(a0, a1)) / (float)D + eps));
        for (d = 0; d < D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + d), r), _mm256_loadu_ps(w + d)));
    }
}

/* act = silu(gate) * up = gate * sigmoid(gate) * up   (F a multiple of 8) */
void silu_mul_rows(const float *h, int64_t S, int64_t F, float *act) {
    for (int64_t s = 0; s < S; s++) {
        const float *g = h + s * 2 * F, *u = g + F;
        float *o = act + s * F;
        for (int64_t j = 0; j < F; j += 8) {
            const __m256 x = _mm256_loadu_ps(g + j);
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid8(x)), _mm256_loadu_ps(u + j)));
        }
    }
}

/* act = gelu_tanh(gate) * up   (F a multiple of 8). gelu_tanh(x) = x (1 + tanh(u)) / 2 with
 * u = sqrt(2 / pi) (x + 0.044715 x^3), and (1 + tanh(u)) / 2 = sigmoid(2 u): silu's sigmoid at
 * z = 2 sqrt(2 / pi) (x + 0.044715 x^3), without tanh's cancellation near 0. */
void gelu_tanh_mul_rows(const float *h, int64_t S, int64_t F, float *act) {
    const __m256 c = _mm256_set1_ps(1.5957691216057308f), k = _mm256_set1_ps(0.044715f);
    for (int64_t s = 0; s < S; s++) {
        const float *g = h + s * 2 * F, *u = g + F;
        float *o = act + s * F;
        for (int64_t j = 0; j < F; j += 8) {
            const __m256 x = _mm256_loadu_ps(g + j);
            const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            const __m256 z = _mm256_mul_ps(c, _mm256_add_ps(x, _mm256_mul_ps(k, x3)));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid8(z)), _mm256_loadu_ps(u + j)));
        }
    }
}
