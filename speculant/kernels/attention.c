/* Attention of a short pass (decoding, speculative verification): rotary embedding, the KV cache
 * write and causal attention row by row, in one call per layer.
 *
 * In torch this is some 20 small ops per layer for one new token and ~4 more per extra row, each
 * costing microseconds of dispatch: a quarter of a decode step of the 0.5B draft. Here it is one
 * call. Every (row, head) is computed start to finish by one thread with the same instructions
 * whatever the number of rows S, so a row's output is bit-identical whether it is scored alone or
 * with drafted tokens (speculative verification reproduces one-token decoding).
 *
 * Layouts (float32, contiguous):
 *   qkv  [S][(H + 2 Hkv) hd]   projections after bias; q and k are rotated in place
 *   cos, sin [S][hd/2]          rotate-half tables at the rows' positions
 *   kc, vc   [Hkv][max_len][hd] this layer's cache; rows go to slots start .. start + S - 1
 *   out  [S][H hd]             row s attends to slots 0 .. start + s
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

static void rope(float *x, const float *c, const float *s, int half) {
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i] + a * s[i];
    }
}

/* One query row of one head against slots 0 .. L-1; p: scratch of L (rounded up to 8) floats. */
static void attend_one(const float *q, const float *k, const float *v, int64_t L, int hd, float scale,
                       float *p, float *o) {
    float m = -INFINITY;
    int64_t j = 0;
    /* 8 keys at a time: 8 independent fma chains instead of one (a single chain per key waited on
     * the fma latency), then one transposing reduction gives the 8 scores in one vector */
    __m256 mv8 = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= L; j += 8) {
        const float *kj = k + j * hd;
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += 8) {
            const __m256 qd = _mm256_loadu_ps(q + d);
            for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kj + i * hd + d), a[i]);
        }
        const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
        const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
        const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
        /* lanes: (0 1 2 3 | 0 1 2 3) halves of keys 0-3 and of keys 4-7 */
        const __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20), hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
        const __m256 sc = _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale));
        _mm256_storeu_ps(p + j, sc);
        mv8 = _mm256_max_ps(mv8, sc);
    }
    {
        float t[8];
        _mm256_storeu_ps(t, mv8);
        for (int i = 0; i < 8; i++) m = t[i] > m ? t[i] : m;
    }
    for (; j < L; j++) {
        const float *kj = k + j * hd;
        __m256 a = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kj + d), a);
        const float sj = hsum(a) * scale;
        p[j] = sj;
        m = sj > m ? sj : m;
    }
    const int64_t L8 = (L + 7) & ~(int64_t)7;
    for (int64_t j = L; j < L8; j++) p[j] = -INFINITY;
    __m256 tot = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(m);
    for (int64_t j = 0; j < L8; j += 8) {
        const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
        _mm256_storeu_ps(p + j, e);
        tot = _mm256_add_ps(tot, e);
    }
    const float inv = 1.0f / hsum(tot);
    for (int d0 = 0; d0 < hd; d0 += 64) {  /* 8 accumulators of 8 lanes at a time */
        const int w = hd - d0 < 64 ? hd - d0 : 64;
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < L; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            const float *vj = v + j * hd + d0;
            for (int i = 0; i < w / 8; i++) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), acc[i]);
        }
        for (int i = 0; i < w / 8; i++) _mm256_storeu_ps(o + d0 + 8 * i, _mm256_mul_ps(acc[i], _mm256_set1_ps(inv)));
    }
}

/* Returns 0, -1 if scratch memory ran out, -2 for a head size that is not a multiple of 8. */
int attn_rows(float *qkv, int64_t S, int64_t H, int64_t Hkv, int64_t hd, const float *cos, const float *sin,
              float *kc, float *vc, int64_t max_len, int64_t start, float *out, int nthreads) {
    if (hd % 8) return -2;
    const int64_t width = (H + 2 * Hkv) * hd, half = hd / 2, group = H / Hkv;
    for (int64_t s = 0; s < S; s++) {
        float *row = qkv + s * width;
        for (int64_t h = 0; h < H + Hkv; h++) rope(row + h * hd, cos + s * half, sin + s * half, (int)half);
        for (int64_t h = 0; h < Hkv; h++) {
            memcpy(kc + (h * max_len + start + s) * hd, row + (H + h) * hd, hd * sizeof(float));
            memcpy(vc + (h * max_len + start + s) * hd, row + (H + Hkv + h) * hd, hd * sizeof(float));
        }
    }
    const int64_t Lmax8 = (start + S + 7) & ~(int64_t)7;
    if (nthreads < 1) nthreads = 1;
    if (S * H < 2) nthreads = 1;
    float *scratch = (float *)malloc(sizeof(float) * Lmax8 * nthreads);
    if (!scratch) return -1;
    const float scale = 1.0f / sqrtf((float)hd);
#pragma omp parallel num_threads(nthreads)
    {
        float *p = scratch + Lmax8 * omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < S * H; t++) {
            const int64_t s = t / H, h = t % H, kh = h / group;
            attend_one(qkv + s * width + h * hd, kc + kh * max_len * hd, vc + kh * max_len * hd, start + s + 1,
                       (int)hd, scale, p, out + s * H * hd + h * hd);
        }
    }
    free(scratch);
    return 0;
}
