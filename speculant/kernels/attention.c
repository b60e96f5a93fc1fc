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
 *                               scale d then 32 int8 q (34 bytes) of the row rotated (attention_cache.h: hadamard),
 *                               quantized as models/cache.py's q8_0_rows, bit for bit. Every read widens a
 *                               value exactly (d * q is exact in float32), so all the arithmetic below is
 *                               float32 whatever the type.
 *   mask [S][S] uint8 or NULL   NULL: causal (row s attends to slots 0 .. start + s)
 *   out  [S][H hd]
 *
 * The parts: attention_cache.h (the cache rows' types, loads, stores and rotation), attention_group.h (one row's
 * attention for the query heads of one key/value head), this file (rotary, cache writes, the tasks' threads).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_cache.h"
#include "attention_group.h"

static void rope(float *x, const float *c, const float *s, int half) {
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i] + a * s[i];
    }
}

int64_t attn_row_bytes(int64_t hd, int kv) { return row_bytes(hd, kv); } /* for blocks.c's layer strides */

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
