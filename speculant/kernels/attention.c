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
 * the row's ancestors). Scores are taken in groups of 8 keys at multiples of 8 (scores4, 4 keys at a
 * time) and the tail one at a time; with c0 a multiple of 8 no group of 8 straddles the two segments,
 * so every score and every sum is the chain's, bit for bit.
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

#define KEYS 32 /* keys per block: the block's keys and values (32 x hd floats each) stay in L1 */
#define HT 3      /* query heads a tile: each key or value vector loaded is used by HT heads */
#define AI static inline __attribute__((always_inline)) /* inlined with constant nh, so a[][] stays in registers */
/* TILE(g, nh) for the head tiles of G heads: HT (3) at a time, then the 1 or 2 left, nh constant at each call */
#define HEAD_TILES(G, TILE)                                  \
    do {                                                     \
        int g_ = 0;                                          \
        for (; g_ + HT <= (G); g_ += HT) TILE(g_, HT);       \
        if ((G) - g_ == 2) TILE(g_, 2);                      \
        else if ((G) - g_ == 1) TILE(g_, 1);                 \
    } while (0)

/* Rows j .. j+n-1 (those below LA) of a cache segment into L1, a block ahead of their use: the hardware
 * prefetcher alone streamed the cache at ~14 GB/s from 2 threads (the 1.5B's 28 layers at 1000 slots). */
AI void prefetch_rows(const float *a, int64_t j, int n, int64_t LA, int hd) {
    for (int i = 0; i < n && j + i < LA; i++)
        for (int c = 0; c < hd; c += 16) _mm_prefetch((const char *)(a + (j + i) * hd + c), _MM_HINT_T0);
}

/* Scores of nh (<= HT) queries (hd apart) against 4 keys: p[h * L8 + i] = scale * q_h . k_i. Each lane is
 * an fma chain over hd in order, then one hadd tree per head (the pairwise sum of the 8 lanes); loading
 * each key chunk once for all nh heads is what this tiling is for. Per (head, key) the same operations
 * whatever nh, G or the neighbouring keys, so a score does not depend on the tiling. */
AI void scores4(const float *q, int nh, const float *k0, const float *k1, const float *k2, const float *k3, int hd,
                __m128 sv, float *p, int64_t L8) {
    __m256 a[HT][4];
    for (int h = 0; h < nh; h++)
        for (int i = 0; i < 4; i++) a[h][i] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 8) {
        const __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k1 + d), x2 = _mm256_loadu_ps(k2 + d),
                     x3 = _mm256_loadu_ps(k3 + d);
        for (int h = 0; h < nh; h++) {
            const __m256 qh = _mm256_loadu_ps(q + h * hd + d);
            a[h][0] = _mm256_fmadd_ps(qh, x0, a[h][0]);
            a[h][1] = _mm256_fmadd_ps(qh, x1, a[h][1]);
            a[h][2] = _mm256_fmadd_ps(qh, x2, a[h][2]);
            a[h][3] = _mm256_fmadd_ps(qh, x3, a[h][3]);
        }
    }
    for (int h = 0; h < nh; h++) {
        /* lanes (k0 k1 k2 k3 | k0 k1 k2 k3): sums of lanes 0-3 and of lanes 4-7 of each key */
        const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[h][0], a[h][1]), _mm256_hadd_ps(a[h][2], a[h][3]));
        const __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        _mm_storeu_ps(p + h * L8, _mm_mul_ps(r, sv));
    }
}

/* The key/value rows of virtual index j: the first LA in kA/vA, the rest in kB/vB (LA is L or a
 * multiple of 8, so a group of 8 keys at a multiple of 8 lies in one segment). */
#define SEG(a, b, j) ((j) < LA ? (a) + (j) * hd : (b) + ((j) - LA) * hd)

/* o[h * hd + d0 + 8 i + lane] (i < nv, h < nh) += sum over keys j0 .. j1-1, in order, of p[h * L8 + j] v_j[...]:
 * one fma chain per output lane (starting from o's value unless j0 = 0), each value vector loaded once
 * for the nh heads. */
AI void wsum(const float *p, int nh, int64_t L8, const float *vA, const float *vB, int64_t LA, int64_t j0, int64_t j1,
             int hd, int d0, int nv, float *o, int pf) {
    __m256 acc[HT][4];
    for (int h = 0; h < nh; h++)
        for (int i = 0; i < nv; i++) acc[h][i] = j0 ? _mm256_loadu_ps(o + h * hd + d0 + 8 * i) : _mm256_setzero_ps();
    for (int64_t j = j0; j < j1; j++) {
        const float *vj = SEG(vA, vB, j) + d0;
        if (pf) prefetch_rows(vA, j + KEYS, 1, LA, hd);
        __m256 v[4];
        for (int i = 0; i < nv; i++) v[i] = _mm256_loadu_ps(vj + 8 * i);
        for (int h = 0; h < nh; h++) {
            const __m256 pj = _mm256_set1_ps(p[h * L8 + j]);
            for (int i = 0; i < nv; i++) acc[h][i] = _mm256_fmadd_ps(pj, v[i], acc[h][i]);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int i = 0; i < nv; i++) _mm256_storeu_ps(o + h * hd + d0 + 8 * i, acc[h][i]);
}

/* The scores and weighted sums of one tile of nh heads (constant at each call site, so each gets its
 * own unrolled copy). */
AI void scores_tile(const float *q, int nh, const float *kA, const float *kB, int64_t LA, int64_t j0, int64_t j1,
                    int hd, __m128 sv, float *p, int64_t L8, int pf) {
    for (int64_t j = j0; j < j1; j += 4) {
        if (pf) prefetch_rows(kA, j + KEYS, 4, LA, hd);
        scores4(q, nh, SEG(kA, kB, j), SEG(kA, kB, j + 1), SEG(kA, kB, j + 2), SEG(kA, kB, j + 3), hd, sv, p + j, L8);
    }
}

AI void wsum_tile(const float *p, int nh, int64_t L8, const float *vA, const float *vB, int64_t LA, int64_t j0,
                  int64_t j1, int hd, float *o, int pf) {
    int d0 = 0;
    for (; d0 + 32 <= hd; d0 += 32) wsum(p, nh, L8, vA, vB, LA, j0, j1, hd, d0, 4, o, pf && !d0);
    for (; d0 < hd; d0 += 8) wsum(p, nh, L8, vA, vB, LA, j0, j1, hd, d0, 1, o, pf && !d0);
}

/* One query row of the G heads that share one key/value head, against slots 0 .. L-1.
 * q: G queries, hd apart; o: G outputs, hd apart; p: scratch of G x L8 floats (L8 = L rounded up
 * to 8). Each block of keys and values is read once for all G heads (grouped-query attention),
 * which matters once the cache outgrows L2, and each vector of it loaded once for HT heads at a time
 * (before, one head at a time, the value sums' loop of variable width compiled to a compare chain per
 * key). `scripts/attention_bench.py` (the 1.5B's shape, 28 layers, 2 Zen 4 cores, old / new tree
 * alternated twice): 5 rows after 1000 slots 17.2-17.4 -> 10.4-10.9 ms, after 300 4.2-5.2 -> 2.6-3.5 ms;
 * 1 row after 1000 4.3-5.5 -> 4.6-4.8 ms (streaming the cache bounds it). The same bits as before: each
 * (head, key) score and each output lane is the same chain of operations. What each head computes, and
 * in which order, does not depend on G's neighbours, on the tiling or on other rows. */
static void attend_group(const float *q, int G, const float *kA, const float *vA, int64_t LA, const float *kB,
                         const float *vB, int64_t L, int hd, float scale, float *p, float *o) {
    const int64_t L8 = (L + 7) & ~(int64_t)7, full = L & ~(int64_t)7;
    const __m128 sv = _mm_set1_ps(scale);
    for (int64_t j0 = 0; j0 < full; j0 += KEYS) {  /* scores, 4 keys x HT heads at a time */
        const int64_t j1 = j0 + KEYS < full ? j0 + KEYS : full;
#define SCORES(g, nh) scores_tile(q + (g) * hd, nh, kA, kB, LA, j0, j1, hd, sv, p + (g) * L8, L8, !(g))
        HEAD_TILES(G, SCORES);
#undef SCORES
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
#define WSUM(g, nh) wsum_tile(p + (g) * L8, nh, L8, vA, vB, LA, j0, j1, hd, o + (g) * hd, !(g))
        HEAD_TILES(G, WSUM);
#undef WSUM
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
            /* a thread's tasks are consecutive rows of one key/value head: the rows after the first read its
             * keys and values from L2 (or L3), not memory */
            const int64_t kh = t / (S * parts), s = t / parts % S, h0 = kh * group + t % parts * per;
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
