/* AVX2 helpers shared by the kernels (included, so every file inlines its own copy). */
#ifndef SPECULANT_SIMD_H
#define SPECULANT_SIMD_H
#include <immintrin.h>

/* exp(x) for x <= 0 (scores minus their maximum), 8 lanes: Cephes' expf polynomial, |rel err| < 2e-7 */
static inline __m256 exp_neg(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);  /* below: 0 (padding is -inf) */
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, x), x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

/* sigmoid(z), from exp(-|z|): 1 / (1 + e) for z >= 0, e / (1 + e) for z < 0 */
static inline __m256 sigmoid8(__m256 z) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = exp_neg(_mm256_or_ps(z, _mm256_set1_ps(-0.0f)));  /* exp(-|z|) in (0, 1] */
    return _mm256_div_ps(_mm256_blendv_ps(one, e, z), _mm256_add_ps(one, e));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
