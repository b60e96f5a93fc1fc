/* Block decoders: a weight row into the canonical form (gq.c's contract).
 * Part of gq.c, included once into its one translation unit. */
#ifndef SPECULANT_GQ_DECODE_H
#define SPECULANT_GQ_DECODE_H

#include "gq_types.h"

/* ---------------------------------------------------------------- canonical decoded rows */

typedef struct {
    uint8_t *u;     /* [K] unsigned values */
    int16_t *sce;   /* K-quants: [K / 2] scale of each pair of values (sc of their group of 16) */
    int16_t *mn;    /* K-quants: [K / 16] */
    float *d, *dm;  /* per (super)block: d and dmin (K-quants) or d and the offset coefficient o (32-blocks) */
    float *f;       /* F16/BF16: [K] floats */
} drow;

static void q4k_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xf) | ((s[j] >> 6) << 4);
        m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

static void set_groups(drow *r, int64_t sb, const int16_t sc[16], const int16_t mn[16]) {
    int16_t *se = r->sce + sb * 128;
    for (int g = 0; g < 16; g++) {
        for (int p = 0; p < 8; p++) se[g * 8 + p] = sc[g];
        r->mn[sb * 16 + g] = mn[g];
    }
}

/* One superblock of a K-quant at b into r's slot sb. */
static void decode_k(int t, const uint8_t *b, drow *r, int64_t sb) {
    uint8_t *u = r->u + sb * 256;
    int16_t sc[16], mn[16];
    switch (t) {
    case Q4_K: case Q5_K: {
        uint8_t s8[8], m8[8];
        q4k_scales(b + 4, s8, m8);
        const uint8_t *qh = b + 16, *qs = t == Q4_K ? b + 16 : b + 48;
        for (int j = 0; j < 4; j++) {
            for (int l = 0; l < 32; l++) {
                const uint8_t q = qs[32 * j + l];
                u[64 * j + l] = q & 0xf;
                u[64 * j + 32 + l] = q >> 4;
            }
        }
        if (t == Q5_K)
            for (int i = 0; i < 8; i++)
                for (int l = 0; l < 32; l++) u[32 * i + l] |= ((qh[l] >> i) & 1) << 4;
        for (int g = 0; g < 16; g++) { sc[g] = s8[g / 2]; mn[g] = m8[g / 2]; }
        r->d[sb] = rdh(b);
        r->dm[sb] = rdh(b + 2);
        break;
    }
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *s = (const int8_t *)(b + 192);
        for (int a = 0; a < 2; a++) /* value x = 64 h + 32 j + l of 128 (loops split so that gcc vectorizes l) */
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 2; j++)
                    for (int l = 0; l < 32; l++)
                        u[128 * a + 64 * h + 32 * j + l] = ((ql[64 * a + 32 * j + l] >> (4 * h)) & 0xf) |
                                                           (((qh[32 * a + l] >> (2 * (2 * h + j))) & 3) << 4);
        for (int g = 0; g < 16; g++) { sc[g] = s[g]; mn[g] = (int16_t)(32 * s[g]); }
        r->d[sb] = r->dm[sb] = rdh(b + 208);
        break;
    }
    case Q3_K: {
        const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
        for (int h = 0; h < 2; h++) /* value e = 128 h + 32 s2 + l (loops split so that gcc vectorizes l) */
            for (int s2 = 0; s2 < 4; s2++)
                for (int l = 0; l < 32; l++) /* q = ql - 4 (1 - hb) = u - 4 */
                    u[128 * h + 32 * s2 + l] = (uint8_t)(((qs[32 * h + l] >> (2 * s2)) & 3) |
                                                         (((hm[l] >> (4 * h + s2)) & 1) << 2));
        for (int g = 0; g < 16; g++) {
            const int lo = g < 8 ? s[g] & 0xf : s[g - 8] >> 4, hi = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
            sc[g] = (int16_t)((lo | (hi << 4)) - 32);
            mn[g] = (int16_t)(4 * sc[g]);
        }
        r->d[sb] = r->dm[sb] = rdh(b + 108);
        break;
    }
    case Q2_K: {
        const uint8_t *s = b, *qs = b + 16;
        for (int h = 0; h < 2; h++) /* as Q3_K's */
            for (int s2 = 0; s2 < 4; s2++)
                for (int l = 0; l < 32; l++) u[128 * h + 32 * s2 + l] = (qs[32 * h + l] >> (2 * s2)) & 3;
        for (int g = 0; g < 16; g++) { sc[g] = s[g] & 0xf; mn[g] = s[g] >> 4; }
        r->d[sb] = rdh(b + 80);
        r->dm[sb] = rdh(b + 82);
        break;
    }
    }
    set_groups(r, sb, sc, mn);
}

/* Where the nibbles of a Q4_0/Q4_1/Q5_0/Q5_1 block start (Q5's 4 bytes of fifth bits sit just before). */
static inline int nibbles_at(int t) { return t == Q4_0 ? 2 : t == Q4_1 ? 4 : t == Q5_0 ? 6 : 8; }

/* The coefficient o of a 4/5-bit block's sum of x (decode_32's dm): -8 d, -16 d, or the stored m. */
static inline float offset_of(int t, const uint8_t *b, float d) {
    return t == Q4_0 ? -8.0f * d : t == Q5_0 ? -16.0f * d : rdh(b + 2);
}

/* One 32-block at b into r's slot i. */
static void decode_32(int t, const uint8_t *b, drow *r, int64_t i) {
    uint8_t *u = r->u + i * 32;
    const float d = rdh(b);
    float o = 0.0f;
    switch (t) {
    case Q4_0: case Q4_1: {
        const uint8_t *qs = b + nibbles_at(t);
        for (int l = 0; l < 16; l++) { u[l] = qs[l] & 0xf; u[l + 16] = qs[l] >> 4; }
        o = offset_of(t, b, d);
        break;
    }
    case Q5_0: case Q5_1: {
        const uint8_t *qs = b + nibbles_at(t);
        uint32_t qh;
        memcpy(&qh, qs - 4, 4);
        for (int l = 0; l < 16; l++) {
            u[l] = (qs[l] & 0xf) | (((qh >> l) & 1) << 4);
            u[l + 16] = (qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
        }
        o = offset_of(t, b, d);
        break;
    }
    case Q8_0:
        for (int l = 0; l < 32; l++) u[l] = (uint8_t)(b[2 + l] ^ 0x80); /* q + 128 */
        o = -128.0f * d;
        break;
    }
    r->d[i] = d;
    r->dm[i] = o;
}

/* The 8 six-bit scales and mins of a Q4_K/Q5_K superblock (q4k_scales, on 32-bit words). */
static inline void q4k_scales_swar(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t a, b, c;
    memcpy(&a, s, 4); memcpy(&b, s + 4, 4); memcpy(&c, s + 8, 4);
    const uint32_t lo6 = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, top2 = 0x30303030u;
    *sc = (uint64_t)(a & lo6) | (uint64_t)((c & lo4) | ((a >> 2) & top2)) << 32;
    *mn = (uint64_t)(b & lo6) | (uint64_t)(((c >> 4) & lo4) | ((b >> 2) & top2)) << 32;
}

#if GQ_AVX2
/* The hot decoders with AVX2 (same results as the loops above, which remain for other types). */
static inline void decode_q4k_avx2(const uint8_t *b, drow *r, int64_t sb, int q5) {
    uint8_t s8[8], m8[8];
    q4k_scales(b + 4, s8, m8);
    const uint8_t *qs = q5 ? b + 48 : b + 16;
    uint8_t *u = r->u + sb * 256;
    const __m256i lo = _mm256_set1_epi8(0x0f);
    __m256i hbits = q5 ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i a = _mm256_and_si256(q, lo), c = _mm256_and_si256(_mm256_srli_epi16(q, 4), lo);
        if (q5) {
            const __m256i one = _mm256_set1_epi8(1);
            a = _mm256_or_si256(a, _mm256_slli_epi16(_mm256_and_si256(hbits, one), 4));
            c = _mm256_or_si256(c, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 1), one), 4));
            hbits = _mm256_srli_epi16(hbits, 2);
        }
        _mm256_storeu_si256((__m256i *)(u + 64 * j), a);
        _mm256_storeu_si256((__m256i *)(u + 64 * j + 32), c);
    }
    int16_t *se = r->sce + sb * 128;
    for (int s = 0; s < 8; s++) _mm256_storeu_si256((__m256i *)(se + 16 * s), _mm256_set1_epi16(s8[s]));
    for (int g = 0; g < 16; g++) r->mn[sb * 16 + g] = m8[g / 2];
    r->d[sb] = rdh(b);
    r->dm[sb] = rdh(b + 2);
}
#endif

#if GQ_AVX2
/* 32-blocks with AVX2: nibbles (and Q5's fifth bits) to bytes; *d, *o as decode_32 sets d and dm */
static inline __m256i u32_avx2(int t, const uint8_t *b, float *d_out, float *o_out) {
    const float d = rdh(b);
    __m256i v;
    float o;
    if (t == Q8_0) {
        v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
        o = -128.0f * d;
    } else {
        const int off = nibbles_at(t);
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + off)), lo = _mm_set1_epi8(0x0f);
        v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), lo), _mm_and_si128(q, lo));
        if (t == Q5_0 || t == Q5_1) {
            uint32_t qh;
            memcpy(&qh, b + off - 4, 4);
            /* byte l of the vector <- bit l of qh: spread qh's bytes, test one bit per byte */
            const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
            const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
            const __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
            v = _mm256_or_si256(v, _mm256_and_si256(on, _mm256_set1_epi8(0x10)));
        }
        o = offset_of(t, b, d);
    }
    *d_out = d;
    *o_out = o;
    return v;
}
#endif

static void decode_row(int t, const uint8_t *w, int64_t K, drow *r) {
    const int bb = block_bytes(t);
    if (family(t) == FAM_K) {
        const int64_t nsb = K / 256;
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *b = w + sb * bb;
            prefetch_block(b, bb);
#if GQ_AVX2
            if (t == Q4_K || t == Q5_K) { decode_q4k_avx2(b, r, sb, t == Q5_K); continue; }
#endif
            decode_k(t, b, r, sb);
        }
    } else if (family(t) == FAM_32) {
        for (int64_t i = 0; i < K / 32; i++) { /* portable builds: SIMD ones read raw */
            prefetch_block(w + i * bb, bb);
            decode_32(t, w + i * bb, r, i);
        }
    } else if (t == F16) {
        for (int64_t e = 0; e < K; e++) r->f[e] = f16_to_f32(rd16(w + 2 * e));
    } else if (t == BF16) {
        for (int64_t e = 0; e < K; e++) {
            const uint32_t bits = (uint32_t)rd16(w + 2 * e) << 16;
            memcpy(r->f + e, &bits, 4);
        }
    }
}


#endif /* SPECULANT_GQ_DECODE_H */
