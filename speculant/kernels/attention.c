/* Attention of a short pass (decoding, speculative verification): rotary embedding, the KV cache
 * write and causal attention row by row, in one call per layer.
 *
 * In torch this is some 20 small ops per layer for one new token and ~4 more per extra row, each
 * costing microseconds of dispatch: a quarter of a decode step of the 0.5B draft. Here it is one
 * call. Every (row, head) is computed start to finish by one thread with the same instructions
 * whatever the number of rows S, so a row's output is bit-identical whether it is scored alone or
 * with drafted tokens (speculative verification reproduces one-token decoding).
 *
 * Trees of drafts (attn_rows_masked with a mask): row s attends to the committed slots 0 .. start-1
 * and to the pass rows t with mask[s][t], in ascending order. Those keys form a virtual sequence of
 * L keys: what a chain pass gives the same token at the same depth. It is read as two segments: the
 * cache up to c0 = start rounded down to 8, then a gathered copy of the rest (< 8 committed keys and
 * the row's ancestors). Scores are taken 8 keys at a time at multiples of 8 (dot8) and the tail one
 * at a time; with c0 a multiple of 8 no group of 8 straddles the two segments, so every score and
 * every sum is the chain's, bit for bit.
 *
 * Layouts (float32, contiguous):
 *   qkv  [S][(H + 2 Hkv) hd]   projections after bias; q and k are rotated in place
 *   cos, sin [S][hd/2]          rotate-half tables at the rows' positions
 *   kc, vc   [Hkv][max_len][hd] this layer's cache; rows go to slots start .. start + S - 1
 *   mask [S][S] uint8 or NULL   NULL: causal (row s attends to slots 0 .. start + s)
 *   out  [S][H hd]
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

/* Scores of one query against 8 keys (rows of kj, hd apart): 8 independent fma chains, then one
 * transposing reduction gives the 8 dot products in one vector. */
static inline __m256 dot8(const float *q, const float *kj, int hd) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kj + i * hd + d), a[i]);
    }
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    /* lanes (0 1 2 3 | 0 1 2 3): halves of keys 0-3 and of keys 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

#define KEYS 32 /* keys per block: the block's keys and values (32 x hd floats each) stay in L1 */

/* One query row of the G heads that share one key/value head, against slots 0 .. L-1.
 * q: G queries, hd apart; o: G outputs, hd apart; p: scratch of G x L8 floats (L8 = L rounded up
 * to 8). Each block of keys and values is read once for all G heads (grouped-query attention),
 * which matters once the cache outgrows L2; at 256 slots the 1.5B's 7-token pass went from 4.9 to
 * 3.7 ms of attention, most of that from scoring 8 keys at a time (dot8). What each head computes,
 * and in which order, does not depend on G's neighbours or on other rows. */
/* The key/value rows of virtual index j: the first LA in kA/vA, the rest in kB/vB (LA is L or a
 * multiple of 8, so a group of 8 keys at a multiple of 8 lies in one segment). */
#define SEG(a, b, j) ((j) < LA ? (a) + (j) * hd : (b) + ((j) - LA) * hd)

static void attend_group(const float *q, int G, const float *kA, const float *vA, int64_t LA, const float *kB,
                         const float *vB, int64_t L, int hd, float scale, float *p, float *o) {
    const int64_t L8 = (L + 7) & ~(int64_t)7, full = L & ~(int64_t)7;
    const __m256 sv = _mm256_set1_ps(scale);
    for (int64_t j0 = 0; j0 < full; j0 += KEYS) {  /* scores, 8 keys at a time */
        const int64_t j1 = j0 + KEYS < full ? j0 + KEYS : full;
        for (int g = 0; g < G; g++)
            for (int64_t j = j0; j < j1; j += 8)
                _mm256_storeu_ps(p + g * L8 + j, _mm256_mul_ps(dot8(q + g * hd, SEG(kA, kB, j), hd), sv));
    }
    for (int g = 0; g < G; g++) {
        float *pg = p + g * L8;
        for (int64_t j = full; j < L; j++) {  /* the last L % 8 keys one at a time */
            const float *kj = SEG(kA, kB, j);
            __m256 a = _mm256_setzero_ps();
            for (int d = 0; d < hd; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * hd + d), _mm256_loadu_ps(kj + d), a);
            pg[j] = hsum(a) * scale;
        }
        for (int64_t j = L; j < L8; j++) pg[j] = -INFINITY;
        __m256 mv8 = _mm256_set1_ps(-INFINITY);
        for (int64_t j = 0; j < L8; j += 8) mv8 = _mm256_max_ps(mv8, _mm256_loadu_ps(pg + j));
        float t[8], m = -INFINITY;
        _mm256_storeu_ps(t, mv8);
        for (int i = 0; i < 8; i++) m = t[i] > m ? t[i] : m;
        __m256 tot = _mm256_setzero_ps();
        const __m256 mv = _mm256_set1_ps(m);
        for (int64_t j = 0; j < L8; j += 8) {
            const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(pg + j), mv));
            _mm256_storeu_ps(pg + j, e);
            tot = _mm256_add_ps(tot, e);
        }
        p[(int64_t)G * L8 + g] = 1.0f / hsum(tot);  /* the normaliser, applied after the weighted sum */
    }
    /* weighted sums of the values, key blocks outer so each block is read once for all heads; the
     * accumulators live in o between blocks, so every output still sums over j in order */
    for (int64_t j0 = 0; j0 < L; j0 += KEYS) {
        const int64_t j1 = j0 + KEYS < L ? j0 + KEYS : L;
        for (int g = 0; g < G; g++) {
            const float *pg = p + g * L8;
            for (int d0 = 0; d0 < hd; d0 += 64) {  /* 8 accumulators of 8 lanes at a time */
                const int w = hd - d0 < 64 ? hd - d0 : 64;
                float *og = o + g * hd + d0;
                __m256 acc[8];
                for (int i = 0; i < w / 8; i++) acc[i] = j0 ? _mm256_loadu_ps(og + 8 * i) : _mm256_setzero_ps();
                for (int64_t j = j0; j < j1; j++) {
                    const __m256 pj = _mm256_set1_ps(pg[j]);
                    const float *vj = SEG(vA, vB, j) + d0;
                    for (int i = 0; i < w / 8; i++) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), acc[i]);
                }
                for (int i = 0; i < w / 8; i++) _mm256_storeu_ps(og + 8 * i, acc[i]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const __m256 inv = _mm256_set1_ps(p[(int64_t)G * L8 + g]);
        for (int d = 0; d < hd; d += 8) _mm256_storeu_ps(o + g * hd + d, _mm256_mul_ps(_mm256_loadu_ps(o + g * hd + d), inv));
    }
}

/* Returns 0, -1 if scratch memory ran out, -2 for a head size that is not a multiple of 8. */
int attn_rows_masked(float *qkv, int64_t S, int64_t H, int64_t Hkv, int64_t hd, const float *cos, const float *sin,
                     float *kc, float *vc, int64_t max_len, int64_t start, const uint8_t *mask, float *out,
                     int nthreads) {
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
    const int64_t Lmax8 = (start + S + 7) & ~(int64_t)7, c0 = start & ~(int64_t)7;
    const int64_t tail = mask ? start - c0 + S : 0; /* keys of segment B at most */
    if (nthreads < 1) nthreads = 1;
    /* tasks: (row, key/value head, part of its query heads); the heads of a group are split only
     * as far as needed to give every thread work */
    const int64_t pairs = S * Hkv;
    int64_t parts = (nthreads + pairs - 1) / pairs;
    if (parts > group) parts = group;
    const int64_t per = (group + parts - 1) / parts;
    parts = (group + per - 1) / per;
    if (pairs * parts < 2) nthreads = 1;
    const int64_t need = per * Lmax8 + per + 2 * tail * hd; /* scores, normalisers, segment B of one task */
    float *scratch = (float *)malloc(sizeof(float) * need * nthreads);
    if (!scratch) return -1;
    const float scale = 1.0f / sqrtf((float)hd);
#pragma omp parallel num_threads(nthreads)
    {
        float *p = scratch + need * omp_get_thread_num();
        float *kB = p + per * Lmax8 + per, *vB = kB + tail * hd;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < pairs * parts; t++) {
            const int64_t s = t / (Hkv * parts), kh = t / parts % Hkv, h0 = kh * group + t % parts * per;
            const int64_t g = kh * group + group - h0 < per ? kh * group + group - h0 : per;
            const float *k = kc + kh * max_len * hd, *v = vc + kh * max_len * hd;
            int64_t L = start + s + 1, LA = L;
            if (mask) { /* gather the committed keys from c0 and the row's visible pass rows */
                int64_t n = 0;
                for (int64_t j = c0; j < start; j++, n++) {
                    memcpy(kB + n * hd, k + j * hd, hd * sizeof(float));
                    memcpy(vB + n * hd, v + j * hd, hd * sizeof(float));
                }
                for (int64_t r = 0; r < S; r++)
                    if (mask[s * S + r]) {
                        memcpy(kB + n * hd, k + (start + r) * hd, hd * sizeof(float));
                        memcpy(vB + n * hd, v + (start + r) * hd, hd * sizeof(float));
                        n++;
                    }
                LA = c0;
                L = c0 + n;
            }
            attend_group(qkv + s * width + h0 * hd, (int)g, k, v, LA, kB, vB, L, (int)hd, scale, p,
                         out + s * H * hd + h0 * hd);
        }
    }
    free(scratch);
    return 0;
}

int attn_rows(float *qkv, int64_t S, int64_t H, int64_t Hkv, int64_t hd, const float *cos, const float *sin,
              float *kc, float *vc, int64_t max_len, int64_t start, float *out, int nthreads) {
    return attn_rows_masked(qkv, S, H, Hkv, hd, cos, sin, kc, vc, max_len, start, NULL, out, nthreads);
}
