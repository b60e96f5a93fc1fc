/* Canonical float reductions and the K-quant dot products (decoded rows and raw superblocks).
 * Part of gq.c, included once into its one translation unit. */
#ifndef SPECULANT_GQ_DOT_K_H
#define SPECULANT_GQ_DOT_K_H

#include "gq_decode.h"

/* ---------------------------------------------------------------- canonical float reductions */

static inline float hsum8_lanes(const float v[8]) {
    const float s0 = v[0] + v[4], s1 = v[1] + v[5], s2 = v[2] + v[6], s3 = v[3] + v[7];
    return (s0 + s2) + (s1 + s3);
}
static inline float hsum16_lanes(const float v[16]) {
    float h[8];
    for (int j = 0; j < 8; j++) h[j] = v[j] + v[j + 8];
    return hsum8_lanes(h);
}
#if GQ_AVX2
static inline float hsum8_avx(__m256 v) { /* = hsum8_lanes */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
static inline float hsum16_avx(__m256 lo, __m256 hi) { return hsum8_avx(_mm256_add_ps(lo, hi)); }
#endif
#if GQ_512
static inline __m512 join8(__m256 lo, __m256 hi) { /* lanes 0-7 lo, 8-15 hi (AVX512F only) */
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
#endif

/* ---------------------------------------------------------------- dot products of one decoded row */

#if GQ_512
/* dot_k's work for superblock sb and R rows, its u, pair scales S, mins mn and d/dm in registers (loaded
 * from a decoded row by dot_k, decoded from the file's bytes by dot_k_raw: one piece of code, same bits).
 * A macro, not a function: as an always-inline function taking the vectors (arrays or by value), gcc 12
 * kept them in memory and R = 8 ran slower (docs/measurements.md "Kernel choices"). It reads the
 * caller's xq, K, sb, nsb, xd, xb, acc and accm. */
#define DOT_K_SB(R, U, S, mn, d, dm)                                                                          \
    for (int m = 0; m < (R); m++) {                                                                           \
        const int8_t *x = xq + m * K + sb * 256;                                                              \
        __m512i I = _mm512_dpwssd_epi32(_mm512_setzero_si512(),                                               \
                                        _mm512_maddubs_epi16(U[0], _mm512_loadu_si512((const void *)x)), S[0]); \
        I = _mm512_dpwssd_epi32(I, _mm512_maddubs_epi16(U[1], _mm512_loadu_si512((const void *)(x + 64))), S[1]);  \
        I = _mm512_dpwssd_epi32(I, _mm512_maddubs_epi16(U[2], _mm512_loadu_si512((const void *)(x + 128))), S[2]); \
        I = _mm512_dpwssd_epi32(I, _mm512_maddubs_epi16(U[3], _mm512_loadu_si512((const void *)(x + 192))), S[3]); \
        const __m256i Sm = _mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)(xb + m * (K / 16) + sb * 16))); \
        const float dx = xd[m * nsb + sb];                                                                    \
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_set1_ps((d) * dx), acc[m]);                    \
        accm[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Sm), _mm256_set1_ps((dm) * dx), accm[m]);                \
    }
static inline float hsum16_512(__m512 v) { /* = hsum16_lanes */
    return hsum16_avx(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

#if GQ_AVX2 && !GQ_512
/* DOT_K_SB for AVX2 builds: U[k] = u of values 32k..32k+31, S[k] their pair scales; lanes 0-7 (lo) take
 * values 64c..64c+31 of each chunk c, lanes 8-15 (hi) 64c+32..64c+63. Shared by dot_k and dot_k_raw. */
#if GQ_VNNI
#define GQ_DPWSSD(I, p, s) _mm256_dpwssd_avx_epi32(I, p, s)
#else
#define GQ_DPWSSD(I, p, s) _mm256_add_epi32(I, _mm256_madd_epi16(p, s))
#endif
#define DOT_K_SB_AVX2(R, U, S, mn, d, dm)                                                                     \
    for (int m = 0; m < (R); m++) {                                                                           \
        const int8_t *x = xq + m * K + sb * 256;                                                              \
        __m256i I0 = _mm256_setzero_si256(), I1 = _mm256_setzero_si256();                                     \
        for (int c = 0; c < 4; c++) {                                                                         \
            I0 = GQ_DPWSSD(I0, _mm256_maddubs_epi16(U[2 * c], _mm256_loadu_si256((const __m256i *)(x + 64 * c))), S[2 * c]); \
            I1 = GQ_DPWSSD(I1, _mm256_maddubs_epi16(U[2 * c + 1], _mm256_loadu_si256((const __m256i *)(x + 64 * c + 32))), \
                           S[2 * c + 1]);                                                                     \
        }                                                                                                     \
        const __m256i Sm = _mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)(xb + m * (K / 16) + sb * 16))); \
        const float dx = xd[m * nsb + sb];                                                                    \
        const __m256 a = _mm256_set1_ps((d) * dx);                                                            \
        lo[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I0), a, lo[m]);                                            \
        hi[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I1), a, hi[m]);                                            \
        accm[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Sm), _mm256_set1_ps((dm) * dx), accm[m]);                \
    }
#endif

/* K-quants: out[m] = dot(row, x row m) for R rows (R a compile-time constant where inlined). */
static inline __attribute__((always_inline)) void dot_k(
    const int R, const drow *w, const int64_t nsb, const int8_t *xq, const int64_t K, const float *xd,
    const int16_t *xb, float *out) {
#if GQ_512
    __m512 acc[MAXR];
    __m256 accm[MAXR];
    for (int m = 0; m < R; m++) { acc[m] = _mm512_setzero_ps(); accm[m] = _mm256_setzero_ps(); }
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *u = w->u + sb * 256;
        const int16_t *se = w->sce + sb * 128;
        __m512i U[4], S[4];
        for (int c = 0; c < 4; c++) {
            U[c] = _mm512_loadu_si512((const void *)(u + 64 * c));
            S[c] = _mm512_loadu_si512((const void *)(se + 32 * c));
        }
        const __m256i mn = _mm256_loadu_si256((const __m256i *)(w->mn + sb * 16));
        const float d = w->d[sb], dm = w->dm[sb];
        DOT_K_SB(R, U, S, mn, d, dm);
    }
    for (int m = 0; m < R; m++) out[m] = hsum16_512(acc[m]) - hsum8_avx(accm[m]);
#elif GQ_AVX2
    __m256 lo[MAXR], hi[MAXR], accm[MAXR];
    for (int m = 0; m < R; m++) { lo[m] = hi[m] = accm[m] = _mm256_setzero_ps(); }
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *u = w->u + sb * 256;
        const int16_t *se = w->sce + sb * 128;
        __m256i U[8], S[8];
        for (int k = 0; k < 8; k++) {
            U[k] = _mm256_loadu_si256((const __m256i *)(u + 32 * k));
            S[k] = _mm256_loadu_si256((const __m256i *)(se + 16 * k));
        }
        const __m256i mn = _mm256_loadu_si256((const __m256i *)(w->mn + sb * 16));
        const float d = w->d[sb], dm = w->dm[sb];
        DOT_K_SB_AVX2(R, U, S, mn, d, dm);
    }
    for (int m = 0; m < R; m++) out[m] = hsum16_avx(lo[m], hi[m]) - hsum8_avx(accm[m]);
#else
    for (int m = 0; m < R; m++) {
        float acc[16] = {0}, accm[8] = {0};
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *u = w->u + sb * 256;
            const int16_t *se = w->sce + sb * 128, *mn = w->mn + sb * 16;
            const int8_t *x = xq + m * K + sb * 256;
            const int16_t *b = xb + m * (K / 16) + sb * 16;
            const float dx = xd[m * nsb + sb], a = w->d[sb] * dx, am = w->dm[sb] * dx;
            for (int l = 0; l < 16; l++) {
                int32_t I = 0;
                for (int c = 0; c < 4; c++) {
                    const int e = 64 * c + 4 * l;
                    int32_t s = 0;
                    for (int i = 0; i < 4; i++) s += (int32_t)u[e + i] * x[e + i];
                    I += (int32_t)se[e / 2] * s;
                }
                acc[l] = fmaf((float)I, a, acc[l]);
            }
            for (int j = 0; j < 8; j++)
                accm[j] = fmaf((float)((int32_t)mn[2 * j] * b[2 * j] + (int32_t)mn[2 * j + 1] * b[2 * j + 1]), am, accm[j]);
        }
        out[m] = hsum16_lanes(acc) - hsum8_lanes(accm);
    }
#endif
}

#if GQ_512
/* Q4_K and Q6_K straight from the file's bytes (AVX512-VNNI builds): each superblock is decoded into
 * registers, the canonical u, scale and min vectors that decode_row + dot_k would store and load, then
 * the same integer and float operations as dot_k's, so the outputs are the same bits. It saves decode_row's
 * stores and reloads and its scalar scale unpacking: the decode was ~3/4 of a Q4_K row's work at M = 1. */

/* S[c]: the int16 scale of each pair of values 64c..64c+63 (pair p is in group 4c + p / 8) from the 16
 * group scales g16 (int16, in the low 256 bits). */
static inline void pair_scales(__m512i g16, __m512i S[4]) {
    for (int c = 0; c < 4; c++) {
        const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16((short)(4 * c)),
                                             _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22,
                                                 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3));
        S[c] = _mm512_permutexvar_epi16(idx, g16);
    }
}

static inline void regs_q4k(const uint8_t *b, __m512i U[4], __m512i S[4], __m256i *mn, float *d, float *dm) {
    uint64_t sc8, mn8;
    q4k_scales_swar(b + 4, &sc8, &mn8);
    /* group g (of 16 values) has sub-block g / 2's scale and min */
    const __m128i s2 = _mm_unpacklo_epi8(_mm_cvtsi64_si128((long long)sc8), _mm_cvtsi64_si128((long long)sc8));
    const __m128i m2 = _mm_unpacklo_epi8(_mm_cvtsi64_si128((long long)mn8), _mm_cvtsi64_si128((long long)mn8));
    pair_scales(_mm512_castsi256_si512(_mm256_cvtepu8_epi16(s2)), S);
    *mn = _mm256_cvtepu8_epi16(m2);
    const __m512i lo = _mm512_set1_epi8(0x0f);
    for (int h = 0; h < 2; h++) { /* qs bytes 64h..64h+63: values 128h + (0..31, 64..95) low, (32..63, 96..127) high */
        const __m512i q = _mm512_loadu_si512((const void *)(b + 16 + 64 * h));
        const __m512i a = _mm512_and_si512(q, lo), c = _mm512_and_si512(_mm512_srli_epi16(q, 4), lo);
        U[2 * h] = _mm512_shuffle_i64x2(a, c, _MM_SHUFFLE(1, 0, 1, 0));
        U[2 * h + 1] = _mm512_shuffle_i64x2(a, c, _MM_SHUFFLE(3, 2, 3, 2));
    }
    *d = rdh(b);
    *dm = rdh(b + 2);
}

static inline void regs_q6k(const uint8_t *b, __m512i U[4], __m512i S[4], __m256i *mn, float *d, float *dm) {
    const __m256i g16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    pair_scales(_mm512_castsi256_si512(g16), S);
    *mn = _mm256_slli_epi16(g16, 5); /* 32 sc */
    const __m512i lo = _mm512_set1_epi8(0x0f), m3 = _mm512_set1_epi8(3);
    /* in each 256-bit half, the shift of qh that gives values 32 s2.. of its 128: s2 = 0, 1 | 2, 3 */
    const __m512i sh01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i sh23 = _mm512_add_epi16(sh01, _mm512_set1_epi16(4));
    for (int a = 0; a < 2; a++) {
        const __m512i l = _mm512_loadu_si512((const void *)(b + 64 * a)); /* l0 | l1 */
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * a)));
        const __m512i h01 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, sh01), m3), 4);
        const __m512i h23 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, sh23), m3), 4);
        U[2 * a] = _mm512_or_si512(_mm512_and_si512(l, lo), h01);
        U[2 * a + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), lo), h23);
    }
    *d = *dm = rdh(b + 208);
}

/* dot_k for a Q4_K (q6 = 0) or Q6_K (q6 = 1) row of raw superblocks; same lanes and operations. */
static inline __attribute__((always_inline)) void dot_k_raw(
    const int R, const int q6, const uint8_t *wrow, const int64_t nsb, const int8_t *xq, const int64_t K,
    const float *xd, const int16_t *xb, float *out) {
    __m512 acc[MAXR];
    __m256 accm[MAXR];
    for (int m = 0; m < R; m++) { acc[m] = _mm512_setzero_ps(); accm[m] = _mm256_setzero_ps(); }
    for (int64_t sb = 0; sb < nsb; sb++) {
        __m512i U[4], S[4];
        __m256i mn;
        float d, dm;
        prefetch_block(wrow + sb * (q6 ? 210 : 144), q6 ? 210 : 144);
        if (q6) regs_q6k(wrow + sb * 210, U, S, &mn, &d, &dm);
        else regs_q4k(wrow + sb * 144, U, S, &mn, &d, &dm);
        DOT_K_SB(R, U, S, mn, d, dm);
    }
    for (int m = 0; m < R; m++) out[m] = hsum16_512(acc[m]) - hsum8_avx(accm[m]);
}
#endif

#if GQ_AVX2 && !GQ_512
/* Q4_K and Q6_K straight from the file's bytes on AVX2 / AVX-VNNI builds, as the 512-bit path does:
 * U, S and mn are the vectors dot_k would load from decode_row's output, built in registers. */
static inline void regs_q4k_avx2(const uint8_t *b, __m256i U[8], __m256i S[8], __m256i *mn, float *d, float *dm) {
    uint64_t sc8, mn8;
    q4k_scales_swar(b + 4, &sc8, &mn8);
    /* S[k] = sub-block k's scale in every lane: one byte shuffle each from the 8 scales zero-extended */
    const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8)));
    for (int k = 0; k < 8; k++) S[k] = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * k)));
    *mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_cvtsi64_si128((long long)mn8), _mm_cvtsi64_si128((long long)mn8)));
    const __m256i lo = _mm256_set1_epi8(0x0f);
    for (int j = 0; j < 4; j++) { /* qs bytes 32j..: values 64j + i low nibbles, 64j + 32 + i high */
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * j));
        U[2 * j] = _mm256_and_si256(q, lo);
        U[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), lo);
    }
    *d = rdh(b);
    *dm = rdh(b + 2);
}

static inline void regs_q6k_avx2(const uint8_t *b, __m256i U[8], __m256i S[8], __m256i *mn, float *d, float *dm) {
    const __m128i s8 = _mm_loadu_si128((const __m128i *)(b + 192)); /* 16 int8 group scales */
    const __m128i pick = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int k = 0; k < 8; k++) /* values 32k..: groups 2k (pairs 0-7) and 2k + 1 (pairs 8-15) */
        S[k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, _mm_add_epi8(pick, _mm_set1_epi8((char)(2 * k)))));
    *mn = _mm256_slli_epi16(_mm256_cvtepi8_epi16(s8), 5); /* 32 sc */
    const __m256i lo = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(3);
    for (int a = 0; a < 2; a++) { /* as decode_k does for Q6_K */
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * a));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * a + 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * a));
        const __m256i n[4] = {_mm256_and_si256(l0, lo), _mm256_and_si256(l1, lo),
                              _mm256_and_si256(_mm256_srli_epi16(l0, 4), lo), _mm256_and_si256(_mm256_srli_epi16(l1, 4), lo)};
        for (int s2 = 0; s2 < 4; s2++)
            U[4 * a + s2] = _mm256_or_si256(n[s2], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * s2), m3), 4));
    }
    *d = *dm = rdh(b + 208);
}

static inline __attribute__((always_inline)) void dot_k_raw(
    const int R, const int q6, const uint8_t *wrow, const int64_t nsb, const int8_t *xq, const int64_t K,
    const float *xd, const int16_t *xb, float *out) {
    __m256 lo[MAXR], hi[MAXR], accm[MAXR];
    for (int m = 0; m < R; m++) { lo[m] = hi[m] = accm[m] = _mm256_setzero_ps(); }
    for (int64_t sb = 0; sb < nsb; sb++) {
        __m256i U[8], S[8], mn;
        float d, dm;
        prefetch_block(wrow + sb * (q6 ? 210 : 144), q6 ? 210 : 144);
        if (q6) regs_q6k_avx2(wrow + sb * 210, U, S, &mn, &d, &dm);
        else regs_q4k_avx2(wrow + sb * 144, U, S, &mn, &d, &dm);
        DOT_K_SB_AVX2(R, U, S, mn, d, dm);
    }
    for (int m = 0; m < R; m++) out[m] = hsum16_avx(lo[m], hi[m]) - hsum8_avx(accm[m]);
}
#endif


#endif /* SPECULANT_GQ_DOT_K_H */
