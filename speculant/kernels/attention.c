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
 * Layouts (float32 unless said, contiguous):
 *   qkv  [S][(H + 2 Hkv) hd]   projections after bias; q and k are rotated in place
 *   cos, sin [S][hd/2]          rotate-half tables at the rows' positions
 *   kc, vc   [Hkv][max_len][row] this layer's cache, rows of hd values in the cache type kv (KV_F32, KV_F16,
 *                               KV_Q8); rows go to slots start .. start + S - 1. float16: rounded to nearest
 *                               even, as torch's .half(). q8_0: llama.cpp's block_q8_0, per 32 values an fp16
 *                               scale d then 32 int8 q (34 bytes) of the row rotated (hadamard below),
 *                               quantized as models/cache.py's q8_0_rows, bit for bit. Every read widens a
 *                               value exactly (d * q is exact in float32), so all the arithmetic below is
 *                               float32 whatever the type.
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

/* The cache types (the kv argument; models/cache.py's KVCache.c_type) */
#define KV_F32 0
#define KV_F16 1
#define KV_Q8 2
#define Q8_BYTES 34 /* a q8_0 block: the fp16 scale, then 32 int8 */

/* Bytes of a cache row of hd values */
AI int64_t row_bytes(int64_t hd, int kv) { return kv == KV_Q8 ? hd / 32 * Q8_BYTES : hd * (kv == KV_F16 ? 2 : 4); }
int64_t attn_row_bytes(int64_t hd, int kv) { return row_bytes(hd, kv); } /* for blocks.c's layer strides */

/* A q8_0 block's scale, broadcast */
AI __m256 q8_scale(const uint8_t *b) {
    uint16_t d;
    memcpy(&d, b, 2);
    return _mm256_set1_ps(_cvtsh_ss(d));
}

/* Values i .. i + 7 of a q8_0 block times its scale d (from q8_scale): exact in float32 */
AI __m256 q8_values8(const uint8_t *b, int i, __m256 d) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + i)))), d);
}

/* 8 values of a cache row from element i (a multiple of 8), widened exactly to float32 */
AI __m256 ld8(const void *row, int i, int kv) {
    if (kv == KV_Q8) {
        const uint8_t *b = (const uint8_t *)row + (i >> 5) * Q8_BYTES;
        return q8_values8(b, i & 31, q8_scale(b));
    }
    return kv == KV_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)))
                        : _mm256_loadu_ps((const float *)row + i);
}

/* A cache row (hd values) from a float32 one: copied, rounded to float16 (nearest even), or quantized to q8_0 blocks
 * as ggml's quantize_row_q8_0_ref (d = amax / 127, q = x * (1 / d) rounded, d stored as fp16) but rounding q to
 * nearest even (the current mode, as torch.round in cache.py) where ggml rounds halves away from zero */
static void store_row(void *dst, const float *src, int64_t hd, int kv) {
    if (kv == KV_F32) {
        memcpy(dst, src, hd * sizeof(float));
    } else if (kv == KV_F16) {
        for (int64_t d = 0; d < hd; d += 8)
            _mm_storeu_si128((__m128i *)((uint16_t *)dst + d),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        for (int64_t b0 = 0; b0 < hd; b0 += 32) {
            uint8_t *b = (uint8_t *)dst + b0 / 32 * Q8_BYTES;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(src[b0 + i]));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const uint16_t dh = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            memcpy(b, &dh, 2);
            for (int i = 0; i < 32; i++) b[2 + i] = (uint8_t)(int8_t)nearbyintf(src[b0 + i] * id);
        }
    }
}

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

/* q8_0 caches hold each head's keys and values rotated by a Walsh-Hadamard matrix (models/cache.py: hadamard), as
 * llama.cpp's quantized caches do: it spreads a channel far larger than its row's others (the 1.5B's layer-0 keys
 * reach ~300 beside values near 1) over the whole block, so the block's scale no longer drowns the small ones.
 * The butterflies over blocks of rot_size(hd) values, unnormalised (entries +-1; H H = n I), in cache.py's order,
 * so both store the same bytes; q is rotated and scaled by 1 / n (exact) before the scores, q . k unchanged, and
 * the output, a sum of rotated values, is rotated back the same way. */
static int rot_size(int64_t hd) { const int64_t n = hd & -hd; return n > 128 ? 128 : (int)n; }

/* Stage h (1, 2 or 4) of the butterflies within 8 values: lane j gets x[j] + x[j + h] where j's bit h is clear,
 * x[j - h] - x[j] where it is set (a + b and a - b, as the scalar loop computes them) */
AI __m256 butterfly8(__m256 v, int h) {
    const __m256 s = h == 1 ? _mm256_permute_ps(v, 0xb1) : h == 2 ? _mm256_permute_ps(v, 0x4e)
                                                            : _mm256_permute2f128_ps(v, v, 1);
    const __m256 sum = _mm256_add_ps(v, s), dif = _mm256_sub_ps(s, v);
    return h == 1 ? _mm256_blend_ps(sum, dif, 0xaa) : h == 2 ? _mm256_blend_ps(sum, dif, 0xcc)
                                                             : _mm256_blend_ps(sum, dif, 0xf0);
}

static void hadamard(float *x, int64_t hd, float post) {
    const int n = rot_size(hd); /* >= 32: q8_0 heads hold whole 32-value blocks */
    for (int64_t i0 = 0; i0 < hd; i0 += n) {
        float *y = x + i0;
        for (int i = 0; i < n; i += 8)
            _mm256_storeu_ps(y + i, butterfly8(butterfly8(butterfly8(_mm256_loadu_ps(y + i), 1), 2), 4));
        for (int h = 8; h < n; h *= 2)
            for (int i = 0; i < n; i += 2 * h)
                for (int j = i; j < i + h; j += 8) {
                    const __m256 a = _mm256_loadu_ps(y + j), b = _mm256_loadu_ps(y + j + h);
                    _mm256_storeu_ps(y + j, _mm256_add_ps(a, b));
                    _mm256_storeu_ps(y + j + h, _mm256_sub_ps(a, b));
                }
    }
    if (post != 1.0f)
        for (int64_t i = 0; i < hd; i += 8)
            _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(post)));
}

/* Returns 0, -1 if scratch memory ran out, -2 for a head size that is not a multiple of 8 (of 32 for q8_0).
 *
 * pos [S] (or NULL: row s at position start + s) are the rows' positions; committed slot j holds position j.
 * window > 0 (a sliding-window layer): row s at position p attends only to keys at positions > p - window, in the
 * same order, as models/keys.py's window_keys picks them. Its keys then start at lo = max(0, p - window + 1): the
 * virtual sequence above begins there, so the groups of 8 keys, and every score and sum, are those of the chain
 * that ends at the row, whether it is scored alone, in a chain or in a tree. A causal row whose position is its
 * slot reads the cache from lo directly; any other row gathers (segment B) as a tree row does, with mask NULL
 * meaning rows 0 .. s. scale: the queries' scale, 0 for hd ** -0.5 (computed here as 1 / sqrtf(hd)). */
int attn_rows_ex(float *qkv, int64_t S, int64_t H, int64_t Hkv, int64_t hd, const float *cos, const float *sin,
                 void *kc, void *vc, int64_t max_len, int64_t start, const uint8_t *mask, const int64_t *pos,
                 int64_t window, float scale, float *out, int kv, int nthreads) {
    if (hd % (kv == KV_Q8 ? 32 : 8)) return -2;
    const int64_t width = (H + 2 * Hkv) * hd, half = hd / 2, group = H / Hkv, rb = row_bytes(hd, kv);
    char *kc8 = (char *)kc, *vc8 = (char *)vc;
    for (int64_t s = 0; s < S; s++) {
        float *row = qkv + s * width;
        for (int64_t h = 0; h < H + Hkv; h++) rope(row + h * hd, cos + s * half, sin + s * half, (int)half);
        if (kv == KV_Q8) /* q / n, k and v rotated (above) */
            for (int64_t h = 0; h < H + 2 * Hkv; h++) hadamard(row + h * hd, hd, h < H ? 1.0f / rot_size(hd) : 1.0f);
        for (int64_t h = 0; h < Hkv; h++) {
            store_row(kc8 + (h * max_len + start + s) * rb, row + (H + h) * hd, hd, kv);
            store_row(vc8 + (h * max_len + start + s) * rb, row + (H + Hkv + h) * hd, hd, kv);
        }
    }
    int gather = mask != NULL;
    if (pos && !gather)
        for (int64_t s = 0; s < S; s++) gather |= window > 0 && pos[s] != start + s;
    const int64_t Lmax8 = (start + S + 7) & ~(int64_t)7;
    const int64_t tail = gather ? 8 + S : 0; /* keys of segment B at most: < 8 committed ones, then pass rows */
    if (nthreads < 1) nthreads = 1;
    /* tasks: (row, key/value head, part of its query heads); the heads of a group are split only
     * as far as needed to give every thread work */
    const int64_t pairs = S * Hkv;
    int64_t parts = (nthreads + pairs - 1) / pairs;
    if (parts > group) parts = group;
    const int64_t per = (group + parts - 1) / parts;
    parts = (group + per - 1) / per;
    if (pairs * parts < 2) nthreads = 1;
    /* scores, normalisers, segment B of one task, and (q8_0) a block of widened rows */
    const int64_t need = per * Lmax8 + per + 2 * tail * hd + (kv == KV_Q8 ? KEYS * hd : 0);
    float *scratch = (float *)malloc(sizeof(float) * need * nthreads);
    if (!scratch) return -1;
    if (scale == 0.0f) scale = 1.0f / sqrtf((float)hd);
#pragma omp parallel num_threads(nthreads)
    {
        float *p = scratch + need * omp_get_thread_num();
        char *kB = (char *)(p + per * Lmax8 + per), *vB = kB + tail * rb;
        float *dq = p + per * Lmax8 + per + 2 * tail * hd;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < pairs * parts; t++) {
            /* a thread's tasks are consecutive rows of one key/value head: the rows after the first read its
             * keys and values from L2 (or L3), not memory */
            const int64_t kh = t / (S * parts), s = t / parts % S, h0 = kh * group + t % parts * per;
            const int64_t g = kh * group + group - h0 < per ? kh * group + group - h0 : per;
            const char *k = kc8 + kh * max_len * rb, *v = vc8 + kh * max_len * rb;
            const int64_t ps = pos ? pos[s] : start + s, lo = window > 0 && ps - window + 1 > 0 ? ps - window + 1 : 0;
            int64_t L = start + s + 1 - lo, LA = L;
            if (gather) { /* the committed keys from lo in whole groups of 8 (segment A), then a copy of the rest
                           * and the row's visible pass rows */
                const int64_t cl = lo < start ? lo : start, c0 = cl + ((start - cl) & ~(int64_t)7);
                int64_t n = 0;
                for (int64_t j = c0; j < start; j++, n++) {
                    memcpy(kB + n * rb, k + j * rb, rb);
                    memcpy(vB + n * rb, v + j * rb, rb);
                }
                for (int64_t r = 0; r < S; r++)
                    if ((mask ? mask[s * S + r] : r <= s) && (pos ? pos[r] : start + r) >= lo) {
                        memcpy(kB + n * rb, k + (start + r) * rb, rb);
                        memcpy(vB + n * rb, v + (start + r) * rb, rb);
                        n++;
                    }
                LA = c0 - cl;
                L = LA + n;
                k += cl * rb, v += cl * rb;
            } else {
                k += lo * rb, v += lo * rb;
            }
            (kv == KV_Q8 ? attend_q8 : kv == KV_F16 ? attend_f16 : attend_f32)(
                qkv + s * width + h0 * hd, (int)g, k, v, LA, kB, vB, L, (int)hd, scale, p, out + s * H * hd + h0 * hd,
                dq);
        }
    }
    free(scratch);
    if (kv == KV_Q8) /* the outputs back from the rotated values */
        for (int64_t r = 0; r < S * H; r++) hadamard(out + r * hd, hd, 1.0f / rot_size(hd));
    return 0;
}

/* attn_rows_ex at the rows' slots, every slot in view, queries scaled by hd ** -0.5 */
int attn_rows_masked(float *qkv, int64_t S, int64_t H, int64_t Hkv, int64_t hd, const float *cos, const float *sin,
                     void *kc, void *vc, int64_t max_len, int64_t start, const uint8_t *mask, float *out, int kv,
                     int nthreads) {
    return attn_rows_ex(qkv, S, H, Hkv, hd, cos, sin, kc, vc, max_len, start, mask, NULL, 0, 0.0f, out, kv, nthreads);
}

int attn_rows(float *qkv, int64_t S, int64_t H, int64_t Hkv, int64_t hd, const float *cos, const float *sin,
              float *kc, float *vc, int64_t max_len, int64_t start, float *out, int nthreads) {
    return attn_rows_masked(qkv, S, H, Hkv, hd, cos, sin, kc, vc, max_len, start, NULL, out, 0, nthreads);
}
