/* The short-pass attention's KV cache rows (attention.c): the cache types, a row's bytes, loading 8 values
 * widened exactly to float32, storing a float32 row in the cache's type, and the Walsh-Hadamard rotation that
 * q8_0 caches hold their rows in. Included into attention.c alone. */
#ifndef SPECULANT_ATTENTION_CACHE_H
#define SPECULANT_ATTENTION_CACHE_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* always inlined: the callers pass constant head counts and cache types, so each gets its own copy with its
 * accumulators in registers */
#define AI static inline __attribute__((always_inline))

/* The cache types (the kv argument; models/cache.py's KVCache.c_type) */
#define KV_F32 0
#define KV_F16 1
#define KV_Q8 2
#define Q8_BYTES 34 /* a q8_0 block: the fp16 scale, then 32 int8 */

/* Bytes of a cache row of hd values */
AI int64_t row_bytes(int64_t hd, int kv) { return kv == KV_Q8 ? hd / 32 * Q8_BYTES : hd * (kv == KV_F16 ? 2 : 4); }

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

#endif
