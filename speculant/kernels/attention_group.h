/* Attention of one query row for the G query heads that share a key/value head (attend_group), against a
 * virtual sequence of keys read as two segments (attention.c explains them): scores 4 keys x 3 heads at a time,
 * softmax, then the values' weighted sums, blocks of KEYS keys read once for all G heads. Included into
 * attention.c alone. */
#ifndef SPECULANT_ATTENTION_GROUP_H
#define SPECULANT_ATTENTION_GROUP_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "attention_cache.h"
#include "simd.h"

#define KEYS 32 /* keys per block: the block's keys and values (32 x hd floats each) stay in L1 */
#define HT 3      /* query heads a tile: each key or value vector loaded is used by HT heads */
/* TILE(g, nh) for the head tiles of G heads: HT (3) at a time, then the 1 or 2 left, nh constant at each call */
#define HEAD_TILES(G, TILE)                                  \
    do {                                                     \
        int g_ = 0;                                          \
        for (; g_ + HT <= (G); g_ += HT) TILE(g_, HT);       \
        if ((G) - g_ == 2) TILE(g_, 2);                      \
        else if ((G) - g_ == 1) TILE(g_, 1);                 \
    } while (0)

/* Rows j .. j+n-1 (those below LA) of a cache segment (rows of rb bytes) into L1, a block ahead of their use:
 * the hardware prefetcher alone streamed the cache at a fraction of the memory bandwidth
 * (`scripts/attention_bench.py`). */
AI void prefetch_rows(const void *a, int64_t j, int n, int64_t LA, int64_t rb) {
    for (int i = 0; i < n && j + i < LA; i++)
        for (int64_t c = 0; c < rb; c += 64) _mm_prefetch((const char *)a + (j + i) * rb + c, _MM_HINT_T0);
}

/* Scores of nh (<= HT) queries (hd apart) against 4 keys: p[h * L8 + i] = scale * q_h . k_i. Each lane is
 * an fma chain over hd in order, then one hadd tree per head (the pairwise sum of the 8 lanes); loading
 * each key chunk once for all nh heads is what this tiling is for. Per (head, key) the same operations
 * whatever nh, G or the neighbouring keys, so a score does not depend on the tiling. */
AI void scores4(const float *q, int nh, const void *k0, const void *k1, const void *k2, const void *k3, int hd,
                __m128 sv, float *p, int64_t L8, int kv) {
    __m256 a[HT][4];
    for (int h = 0; h < nh; h++)
        for (int i = 0; i < 4; i++) a[h][i] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 8) {
        const __m256 x0 = ld8(k0, d, kv), x1 = ld8(k1, d, kv), x2 = ld8(k2, d, kv), x3 = ld8(k3, d, kv);
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
 * multiple of 8, so a group of 8 keys at a multiple of 8 lies in one segment); rows of rb bytes. */
#define SEG(a, b, j) ((j) < LA ? (const char *)(a) + (j) * rb : (const char *)(b) + ((j) - LA) * rb)

/* o[h * hd + d0 + 8 i + lane] (i < nv, h < nh) += sum over keys j0 .. j1-1, in order, of p[h * L8 + j] v_j[...]:
 * one fma chain per output lane (starting from o's value unless `first`), each value vector loaded once
 * for the nh heads. */
AI void wsum(const float *p, int nh, int64_t L8, const void *vA, const void *vB, int64_t LA, int64_t j0, int64_t j1,
             int hd, int d0, int nv, float *o, int pf, int kv, int first) {
    const int64_t rb = row_bytes(hd, kv);
    __m256 acc[HT][4];
    for (int h = 0; h < nh; h++)
        for (int i = 0; i < nv; i++) acc[h][i] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o + h * hd + d0 + 8 * i);
    for (int64_t j = j0; j < j1; j++) {
        const void *vj = SEG(vA, vB, j);
        if (pf) prefetch_rows(vA, j + KEYS, 1, LA, rb);
        __m256 v[4];
        for (int i = 0; i < nv; i++) v[i] = ld8(vj, d0 + 8 * i, kv);
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
AI void scores_tile(const float *q, int nh, const void *kA, const void *kB, int64_t LA, int64_t j0, int64_t j1,
                    int hd, __m128 sv, float *p, int64_t L8, int pf, int kv) {
    const int64_t rb = row_bytes(hd, kv);
    for (int64_t j = j0; j < j1; j += 4) {
        if (pf) prefetch_rows(kA, j + KEYS, 4, LA, rb);
        scores4(q, nh, SEG(kA, kB, j), SEG(kA, kB, j + 1), SEG(kA, kB, j + 2), SEG(kA, kB, j + 3), hd, sv, p + j, L8,
                kv);
    }
}

AI void wsum_tile(const float *p, int nh, int64_t L8, const void *vA, const void *vB, int64_t LA, int64_t j0,
                  int64_t j1, int hd, float *o, int pf, int kv, int first) {
    int d0 = 0;
    for (; d0 + 32 <= hd; d0 += 32) wsum(p, nh, L8, vA, vB, LA, j0, j1, hd, d0, 4, o, pf && !d0, kv, first);
    for (; d0 < hd; d0 += 8) wsum(p, nh, L8, vA, vB, LA, j0, j1, hd, d0, 1, o, pf && !d0, kv, first);
}

/* Rows j0 .. j1-1 of a q8_0 segment pair (as SEG) widened into dq [j1 - j0][hd] float32 (d * q, exact), the rows a
 * block ahead prefetched. A q8_0 cache is read a block of KEYS rows at a time through this copy in L1, which every
 * head tile then reads as float32: widening each value once for the G heads (instead of once per 3-head tile, a
 * scale, a sign extension, a conversion and a multiply each time) made a q8_0 cache's attention faster for one row
 * and more so for several (`scripts/attention_bench.py --kv-dtypes f16 q8_0`; docs/measurements.md "Kernel
 * choices"), and its bits are a float32 cache's. */
AI void widen_q8(const void *A, const void *B, int64_t LA, int64_t j0, int64_t j1, int hd, float *dq) {
    const int64_t rb = row_bytes(hd, KV_Q8);
    for (int64_t j = j0; j < j1; j++) {
        prefetch_rows(A, j + KEYS, 1, LA, rb);
        const uint8_t *r = (const uint8_t *)SEG(A, B, j);
        float *out = dq + (j - j0) * hd;
        for (int b = 0; b < hd / 32; b++) {
            const uint8_t *blk = r + Q8_BYTES * b;
            const __m256 d = q8_scale(blk);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + 32 * b + 8 * i, q8_values8(blk, 8 * i, d));
        }
    }
}

/* One query row of the G heads that share one key/value head, against slots 0 .. L-1.
 * q: G queries, hd apart; o: G outputs, hd apart; p: scratch of G x L8 floats (L8 = L rounded up
 * to 8). Each block of keys and values is read once for all G heads (grouped-query attention),
 * which matters once the cache outgrows L2, and each vector of it loaded once for HT heads at a time
 * (before, one head at a time, the value sums' loop of variable width compiled to a compare chain per
 * key). It pays for passes of several rows; one row is bound by streaming the cache either way
 * (`scripts/attention_bench.py`; docs/measurements.md "Kernel choices"). The same bits as before: each
 * (head, key) score and each output lane is the same chain of operations. What each head computes, and
 * in which order, does not depend on G's neighbours, on the tiling or on other rows. */
AI void attend_group(const float *q, int G, const void *kA, const void *vA, int64_t LA, const void *kB,
                     const void *vB, int64_t L, int hd, float scale, float *p, float *o, int kv, float *dq) {
    const int64_t L8 = (L + 7) & ~(int64_t)7, full = L & ~(int64_t)7, rb = row_bytes(hd, kv);
    const __m128 sv = _mm_set1_ps(scale);
    for (int64_t j0 = 0; j0 < full; j0 += KEYS) {  /* scores, 4 keys x HT heads at a time */
        const int64_t j1 = j0 + KEYS < full ? j0 + KEYS : full;
        if (kv == KV_Q8) { /* the block widened once, then read as a float32 segment of j1 - j0 rows */
            widen_q8(kA, kB, LA, j0, j1, hd, dq);
#define SCORES(g, nh) \
    scores_tile(q + (g) * hd, nh, dq, dq, j1 - j0, 0, j1 - j0, hd, sv, p + (g) * L8 + j0, L8, 0, KV_F32)
            HEAD_TILES(G, SCORES);
#undef SCORES
            continue;
        }
#define SCORES(g, nh) scores_tile(q + (g) * hd, nh, kA, kB, LA, j0, j1, hd, sv, p + (g) * L8, L8, !(g), kv)
        HEAD_TILES(G, SCORES);
#undef SCORES
    }
    for (int g = 0; g < G; g++) {
        float *pg = p + g * L8;
        for (int64_t j = full; j < L; j++) {  /* the last L % 8 keys one at a time */
            const void *kj = SEG(kA, kB, j);
            __m256 a = _mm256_setzero_ps();
            for (int d = 0; d < hd; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * hd + d), ld8(kj, d, kv), a);
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
        if (kv == KV_Q8) {
            widen_q8(vA, vB, LA, j0, j1, hd, dq);
#define WSUM(g, nh) wsum_tile(p + (g) * L8 + j0, nh, L8, dq, dq, j1 - j0, 0, j1 - j0, hd, o + (g) * hd, 0, KV_F32, !j0)
            HEAD_TILES(G, WSUM);
#undef WSUM
            continue;
        }
#define WSUM(g, nh) wsum_tile(p + (g) * L8, nh, L8, vA, vB, LA, j0, j1, hd, o + (g) * hd, !(g), kv, !j0)
        HEAD_TILES(G, WSUM);
#undef WSUM
    }
    for (int g = 0; g < G; g++) {
        const __m256 inv = _mm256_set1_ps(p[(int64_t)G * L8 + g]);
        for (int d = 0; d < hd; d += 8) _mm256_storeu_ps(o + g * hd + d, _mm256_mul_ps(_mm256_loadu_ps(o + g * hd + d), inv));
    }
}

/* attend_group for each cache type, each its own compiled copy (a constant type) */
static void attend_f32(const float *q, int G, const void *kA, const void *vA, int64_t LA, const void *kB,
                       const void *vB, int64_t L, int hd, float scale, float *p, float *o, float *dq) {
    attend_group(q, G, kA, vA, LA, kB, vB, L, hd, scale, p, o, KV_F32, dq);
}
static void attend_f16(const float *q, int G, const void *kA, const void *vA, int64_t LA, const void *kB,
                       const void *vB, int64_t L, int hd, float scale, float *p, float *o, float *dq) {
    attend_group(q, G, kA, vA, LA, kB, vB, L, hd, scale, p, o, KV_F16, dq);
}
static void attend_q8(const float *q, int G, const void *kA, const void *vA, int64_t LA, const void *kB,
                      const void *vB, int64_t L, int hd, float scale, float *p, float *o, float *dq) {
    attend_group(q, G, kA, vA, LA, kB, vB, L, hd, scale, p, o, KV_Q8, dq);
}

#endif
