/* GGUF block formats multiplied as the file stores them (no requantisation), for 1..32 activation rows.
 *
 * Weights are the GGUF tensor's bytes, memory-mapped: row n of W[N, K] is `row_bytes` bytes of blocks.
 * Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
 *
 * Activations are quantised per row to int8 as llama.cpp does: per 32 values for the 32-blocks
 * (Q8_0-like) and per 256 for the K-quants (Q8_K-like, with the sums of each 16), with a float32 scale
 * (absmax / 127) where llama.cpp rounds Q8_0's to fp16. The dot products then run in integers, with the
 * K-quants' integer sub-block scales folded into exact int32 sums; float arithmetic happens once per
 * block (32-blocks) or per superblock (K-quants).
 *
 * Exactness contract (tests/test_gguf_kernels.py):
 *  - every weight row is first decoded into a canonical form (unsigned integers u, integer scales and
 *    mins, float block scales); the integer sums are exact, so their order does not matter;
 *  - the float work of an output (row n, activation row m) follows one fixed lane structure, the
 *    "canonical 16 lanes" below, in every build (AVX512-VNNI, AVX-VNNI, AVX2, portable C) and whatever
 *    M or the thread count: a row's output is bit-identical whether it is computed alone or with
 *    drafted rows, on every build. Built with -ffp-contract=off; fused multiply-adds are explicit.
 *
 * Canonical form and lanes, per output (n, m):
 *  K-quants (superblocks of 256): u[256] < 64, sc[16] and mn[16] int16 per 16 values, d and dmin:
 *      W = d * sc * u - dmin * mn  (Q6_K: u = q + 32, mn = 32 sc, dmin = d; Q3_K: u = q + 4, mn = 4 sc)
 *    lane l (0..15) of I = sum over the 4 chunks c of 64 values of sc[4c + l/4] * (sum of u*x over values
 *    64c + 4l .. 64c + 4l + 3); lane j (0..7) of S = mn[2j] B[2j] + mn[2j+1] B[2j+1], B = sums of x per 16;
 *    acc[l] = fma(I[l], d * dx, acc[l]); accm[j] = fma(S[j], dmin * dx, accm[j]); y = hsum16(acc) - hsum8(accm)
 *  32-blocks: u[32] (Q8_0: q + 128), d, and the coefficient o of the block's sum of x (Q4_0: -8d, Q4_1: m):
 *    lane (b & 1) * 8 + j: acc = fma(sum of u*x over values 32b + 4j .. 4j + 3, d * dx, acc);
 *    t = fma(o, dx * sum(xq), t) in block order; y = hsum16(acc) + t
 *  F32/F16/BF16 (activations stay float): acc[e % 16] = fma(w[e], x[e], acc[e % 16]); y = hsum16(acc)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#define GQ_AVX2 1
#else
#define GQ_AVX2 0
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GQ_512 1
#else
#define GQ_512 0
#endif
#if defined(__AVXVNNI__) || GQ_512
#define GQ_VNNI 1
#else
#define GQ_VNNI 0
#endif

enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
       Q5_K = 13, Q6_K = 14, BF16 = 30 };
enum { FAM_F = 0, FAM_32 = 1, FAM_K = 2 };
#define MAXR 8   /* activation rows per pass over a decoded weight row */

static int family(int t) {
    switch (t) {
    case F32: case F16: case BF16: return FAM_F;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return FAM_32;
    case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: return FAM_K;
    default: return -1;
    }
}

/* bytes per block and values per block of each type (gguf's GGML_QUANT_SIZES) */
static int block_bytes(int t) {
    switch (t) {
    case F32: return 4; case F16: return 2; case BF16: return 2;
    case Q4_0: return 18; case Q4_1: return 20; case Q5_0: return 22; case Q5_1: return 24; case Q8_0: return 34;
    case Q2_K: return 84; case Q3_K: return 110; case Q4_K: return 144; case Q5_K: return 176; case Q6_K: return 210;
    default: return 0;
    }
}
static int block_values(int t) {
    int f = family(t);
    return f == FAM_F ? 1 : f == FAM_32 ? 32 : f == FAM_K ? 256 : 0;
}

int gq_supported(int t) { return family(t) >= 0; }
int gq_block_bytes(int t) { return block_bytes(t); }
int gq_block_values(int t) { return block_values(t); }

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
#if defined(__F16C__)
static inline float rdh(const uint8_t *p) { return _cvtsh_ss(rd16(p)); } /* exact, as f16_to_f32 */
#else
static inline float rdh(const uint8_t *p) { return f16_to_f32(rd16(p)); }
#endif

/* Weights stream from memory once per token: each (super)block asks for the lines PREFETCH_AHEAD bytes
 * further on (the rows of a thread's share are contiguous). The hardware prefetcher alone left a decode
 * step short of the bandwidth: 2 threads of an AMD EPYC (AVX-512), a 173 MB Q4_K tensor at M = 1,
 * 6.1-7.2 ns per superblock without, 5.0-5.9 with 2048 ahead (1024: 5.4-5.6, 4096: 4.8-5.3); a 191 MB
 * Q6_K lm_head 7.6-8.4 ns, 6.2-7.0 (a C harness that includes this file and times gq_matmul on random
 * blocks; not in the repo). No effect on results. */
#define PREFETCH_AHEAD 2048
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *b, int bytes) {
#if defined(__GNUC__)
    for (int l = 0; l < bytes; l += 64) __builtin_prefetch(b + PREFETCH_AHEAD + l, 0, 3);
#else
    (void)b; (void)bytes;
#endif
}

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
        for (int e = 0; e < 256; e++) {
            const int h = e / 128, s2 = (e % 128) / 32, l = e % 32;
            const int ql = (qs[32 * h + l] >> (2 * s2)) & 3, hb = (hm[l] >> (e / 32)) & 1;
            u[e] = (uint8_t)(ql + 4 * hb); /* q = ql - 4 (1 - hb) = u - 4 */
        }
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
        for (int e = 0; e < 256; e++) {
            const int h = e / 128, s2 = (e % 128) / 32, l = e % 32;
            u[e] = (qs[32 * h + l] >> (2 * s2)) & 3;
        }
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

/* ---------------------------------------------------------------- activations */

/* Per-row int8 quantisation of x[M, K] in blocks of `blk` (32 or 256): xq[M, K], xd[M, K / blk] scales;
 * for blk = 256 also xb[M, K / 16] sums of each 16; for blk = 32 also xs[M, K / 32] = scale * sum. */
static void quantize_block(const float *x, int blk, int8_t *xq, float *xd, int16_t *xb, float *xs) {
    float amax = 0.0f;
    for (int i = 0; i < blk; i++) { /* = fmaxf(amax, |x|) (amax is never NaN; a NaN x is skipped), but
                                       * inline: gcc calls libm's fmaxf for each value (a decode step of
                                       * the 1.5B makes ~380,000 such calls) */
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    *xd = d;
    int32_t sum = 0;
    for (int i = 0; i < blk; i++) {
        float v = nearbyintf(x[i] * id);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        xq[i] = (int8_t)v;
        sum += xq[i];
    }
    if (xb)
        for (int g = 0; g < blk / 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += xq[16 * g + i];
            xb[g] = (int16_t)s;
        }
    if (xs) *xs = d * (float)sum;
}

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
 * kept them in memory and R = 8 ran 6-10% slower (8192x1536 Q4_K, one thread, AMD EPYC). It reads the
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

#if GQ_512
/* dot_32's float work for blocks b, b + 1 (lanes 0-7 and 8-15) whose u are in U, for R rows. */
static inline __attribute__((always_inline)) void dot_32_pair(
    const int R, const __m512i U, const float d0, const float d1, const float o0, const float o1, const int8_t *xq,
    const int64_t K, const int64_t b, const int64_t nb, const float *xd, const float *xs, __m512 *acc, float *t) {
    const __m128 dd = _mm_setr_ps(d0, d1, 0.0f, 0.0f);
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int m = 0; m < R; m++) {
        const __m512i P = _mm512_dpbusd_epi32(_mm512_setzero_si512(), U, _mm512_loadu_si512((const void *)(xq + m * K + 32 * b)));
        const float *dx = xd + m * nb + b, *sx = xs + m * nb + b;
        /* lanes 0-7 d0 * dx[0], 8-15 d1 * dx[1]: the two products in one multiply, spread by one permute */
        const __m128 p = _mm_mul_ps(dd, _mm_castpd_ps(_mm_load_sd((const double *)dx)));
        const __m512 a = _mm512_permutexvar_ps(half, _mm512_castps128_ps512(p));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), a, acc[m]);
        t[m] = fmaf(o0, sx[0], t[m]);
        t[m] = fmaf(o1, sx[1], t[m]);
    }
}
/* an odd last block: even index, lanes 0-7 */
static inline __attribute__((always_inline)) void dot_32_last(
    const int R, const __m256i U, const float d, const float o, const int8_t *xq, const int64_t K, const int64_t b,
    const int64_t nb, const float *xd, const float *xs, __m512 *acc, float *t) {
    for (int m = 0; m < R; m++) {
        const __m256i P = _mm256_dpbusd_epi32(_mm256_setzero_si256(), U, _mm256_loadu_si256((const __m256i *)(xq + m * K + 32 * b)));
        const __m512 a = join8(_mm256_set1_ps(d * xd[m * nb + b]), _mm256_setzero_ps());
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_zextsi256_si512(P)), a, acc[m]);
        t[m] = fmaf(o, xs[m * nb + b], t[m]);
    }
}

/* u of blocks b and b + 1 (lanes 0-7 and 8-15) at p: u32_avx2's bytes. For the 4- and 5-bit types both
 * blocks are built at once. The nibbles of both come from one permute, one variable shift and one mask,
 * and Q5's fifth bits go in as a byte mask (bit l of qh is byte l's), where u32_avx2 spreads them with
 * six AVX2 operations per block. With dot_32_pair's one multiply for both blocks' d * dx, a harness
 * (gq.c in a C timer, not in the repo; 1 thread, Q5_0 2048x896 in cache, AMD EPYC) measured per 256
 * values: M = 1 17.9-18.0 -> 16.0-16.5 ns, M = 8 62.0-62.6 -> 50.4-55.2 ns; Q8_0 M = 8 52.0-52.8 -> 48.5. */
static inline __m512i u32x2_512(int t, const uint8_t *p, int bb, float *d0, float *d1, float *o0, float *o1) {
    if (t == Q8_0) { /* whole bytes: u32_avx2's two vectors side by side */
        const __m256i u0 = u32_avx2(t, p, d0, o0), u1 = u32_avx2(t, p + bb, d1, o1);
        return _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1);
    }
    const int off = nibbles_at(t);
    const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + off))),
                                              _mm_loadu_si128((const __m128i *)(p + bb + off)), 1);
    /* 128-bit lanes: block b's bytes twice, then block b + 1's; the odd lanes take the high nibbles */
    const __m512i z = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(q));
    const long long four = 0x0004000400040004LL;
    __m512i v = _mm512_and_si512(_mm512_srlv_epi16(z, _mm512_setr_epi64(0, 0, four, four, 0, 0, four, four)),
                                 _mm512_set1_epi8(0x0f));
    if (t == Q5_0 || t == Q5_1) {
        uint32_t h0, h1;
        memcpy(&h0, p + off - 4, 4);
        memcpy(&h1, p + bb + off - 4, 4);
        v = _mm512_mask_add_epi8(v, (__mmask64)((uint64_t)h0 | (uint64_t)h1 << 32), v, _mm512_set1_epi8(0x10));
    }
    const float a = rdh(p), b = rdh(p + bb);
    *d0 = a;
    *d1 = b;
    *o0 = offset_of(t, p, a);
    *o1 = offset_of(t, p + bb, b);
    return v;
}

/* dot_32_raw's pairs of blocks: returns the index of the first block left (nb - 1 when nb is odd). Called
 * with t = Q8_0 as a constant, so that each type's loop is compiled without the other's branch (a branch
 * per pair measured slower on Q8_0 at M = 8 in the harness: 55-62 vs 52 ns per 256 values). */
static inline __attribute__((always_inline)) int64_t dot_32_pairs(
    const int R, const int t, const uint8_t *wrow, const int bb, const int64_t nb, const int8_t *xq, const int64_t K,
    const float *xd, const float *xs, __m512 *acc, float *tt) {
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        prefetch_block(wrow + b * bb, 2 * bb);
        float d0, d1, o0, o1;
        const __m512i U = u32x2_512(t, wrow + b * bb, bb, &d0, &d1, &o0, &o1);
        dot_32_pair(R, U, d0, d1, o0, o1, xq, K, b, nb, xd, xs, acc, tt);
    }
    return b;
}

/* dot_32 for a row of raw 32-blocks of type t (AVX512-VNNI builds): u decoded into registers by the
 * decoder decode_row uses, then dot_32's own operations, so the same bits without the stores and reloads. */
static inline __attribute__((always_inline)) void dot_32_raw(
    const int R, const int t, const uint8_t *wrow, const int64_t nb, const int8_t *xq, const int64_t K,
    const float *xd, const float *xs, float *out) {
    const int bb = block_bytes(t);
    float tt[MAXR];
    __m512 acc[MAXR];
    for (int m = 0; m < R; m++) { tt[m] = 0.0f; acc[m] = _mm512_setzero_ps(); }
    const int64_t b = t == Q8_0 ? dot_32_pairs(R, Q8_0, wrow, bb, nb, xq, K, xd, xs, acc, tt)
                                : dot_32_pairs(R, t, wrow, bb, nb, xq, K, xd, xs, acc, tt);
    if (b < nb) {
        float d, o;
        const __m256i u = u32_avx2(t, wrow + b * bb, &d, &o);
        dot_32_last(R, u, d, o, xq, K, b, nb, xd, xs, acc, tt);
    }
    for (int m = 0; m < R; m++)
        out[m] = hsum16_512(acc[m]) + tt[m];
}
#endif

#if GQ_AVX2 && !GQ_512
/* dot_32's work on block b for R rows (AVX2 / AVX-VNNI), its u in U decoded from the file's bytes;
 * lanes 0-7 of even blocks, 8-15 of odd ones. */
static inline __attribute__((always_inline)) void dot_32_block(
    const int R, const __m256i U, const float d, const float o, const int wide, const int8_t *xq, const int64_t K,
    const int64_t b, const int64_t nb, const float *xd, const float *xs, __m256 acc[2][MAXR], float *t) {
    const __m256i ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8((char)0x80);
    const __m256i Ws = _mm256_xor_si256(U, bias); /* wide: the signed q */
    for (int m = 0; m < R; m++) {
        const __m256i X = _mm256_loadu_si256((const __m256i *)(xq + m * K + 32 * b));
        __m256i P;
#if GQ_VNNI
        P = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), U, X);
        (void)Ws; (void)ones; (void)wide;
#else
        if (wide) { /* u x = q x + 128 x, each part without int16 saturation */
            const __m256i qx = _mm256_maddubs_epi16(_mm256_sign_epi8(Ws, Ws), _mm256_sign_epi8(X, Ws));
            const __m256i bx = _mm256_maddubs_epi16(bias, X);
            P = _mm256_add_epi32(_mm256_madd_epi16(qx, ones), _mm256_madd_epi16(bx, ones));
        } else {
            P = _mm256_madd_epi16(_mm256_maddubs_epi16(U, X), ones);
        }
#endif
        acc[b & 1][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_set1_ps(d * xd[m * nb + b]), acc[b & 1][m]);
        t[m] = fmaf(o, xs[m * nb + b], t[m]);
    }
}

/* dot_32 for a row of raw 32-blocks of type t (AVX2 / AVX-VNNI builds) */
static inline __attribute__((always_inline)) void dot_32_raw(
    const int R, const int t, const uint8_t *wrow, const int64_t nb, const int8_t *xq, const int64_t K,
    const float *xd, const float *xs, float *out) {
    const int bb = block_bytes(t);
    float tt[MAXR];
    __m256 acc[2][MAXR];
    for (int m = 0; m < R; m++) { tt[m] = 0.0f; acc[0][m] = acc[1][m] = _mm256_setzero_ps(); }
    for (int64_t b = 0; b < nb; b++) {
        prefetch_block(wrow + b * bb, bb);
        float d, o;
        const __m256i U = u32_avx2(t, wrow + b * bb, &d, &o);
        dot_32_block(R, U, d, o, t == Q8_0, xq, K, b, nb, xd, xs, acc, tt);
    }
    for (int m = 0; m < R; m++) out[m] = hsum16_avx(acc[0][m], acc[1][m]) + tt[m];
}
#endif

/* 32-blocks (wide: u up to 255, Q8_0) from a decoded row: portable builds (SIMD builds read raw bytes:
 * dot_32_raw, the same lanes and operations) */
static inline __attribute__((always_inline)) void dot_32(
    const int R, const drow *w, const int64_t nb, const int wide, const int8_t *xq, const int64_t K,
    const float *xd, const float *xs, float *out) {
    float t[MAXR];
    for (int m = 0; m < R; m++) t[m] = 0.0f;
    (void)wide;
    for (int m = 0; m < R; m++) {
        float acc[16] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *u = w->u + 32 * b;
            const int8_t *x = xq + m * K + 32 * b;
            const float a = w->d[b] * xd[m * nb + b];
            for (int j = 0; j < 8; j++) {
                int32_t P = 0;
                for (int i = 0; i < 4; i++) P += (int32_t)u[4 * j + i] * x[4 * j + i];
                acc[(b & 1) * 8 + j] = fmaf((float)P, a, acc[(b & 1) * 8 + j]);
            }
            t[m] = fmaf(w->dm[b], xs[m * nb + b], t[m]);
        }
        out[m] = hsum16_lanes(acc) + t[m];
    }
}

/* float rows: wf[K] against float activations */
static inline __attribute__((always_inline)) void dot_f(const int R, const float *wf, const float *x, const int64_t K,
                                                       float *out) {
#if GQ_AVX2
    __m256 lo[MAXR], hi[MAXR];
    for (int m = 0; m < R; m++) lo[m] = hi[m] = _mm256_setzero_ps();
    for (int64_t e = 0; e < K; e += 16) {
        const __m256 w0 = _mm256_loadu_ps(wf + e), w1 = _mm256_loadu_ps(wf + e + 8);
        for (int m = 0; m < R; m++) {
            lo[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * K + e), lo[m]);
            hi[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * K + e + 8), hi[m]);
        }
    }
    for (int m = 0; m < R; m++) out[m] = hsum16_avx(lo[m], hi[m]);
#else
    for (int m = 0; m < R; m++) {
        float acc[16] = {0};
        for (int64_t e = 0; e < K; e++) acc[e % 16] = fmaf(wf[e], x[m * K + e], acc[e % 16]);
        out[m] = hsum16_lanes(acc);
    }
#endif
}

/* ---------------------------------------------------------------- the matmul */

typedef struct {
    int32_t type;
    int32_t _pad;
    const uint8_t *w;      /* [n][row_bytes] */
    int64_t n;             /* rows of this part */
    int64_t row_bytes;
    const int32_t *perm;   /* or NULL: row r of the part goes to output column offset + perm[r] */
} gq_part;

#define ROW_SWITCH(mc, BODY)                                                                        \
    switch (mc) {                                                                                   \
    case 1: BODY(1); break;                                                                         \
    case 2: BODY(2); break;                                                                         \
    case 3: BODY(3); break;                                                                         \
    case 4: BODY(4); break;                                                                         \
    case 5: BODY(5); break;                                                                         \
    case 6: BODY(6); break;                                                                         \
    case 7: BODY(7); break;                                                                         \
    default: BODY(8); break;                                                                        \
    }

/* Checks a part list against K; returns 0 or a negative code (see gq_matmul). */
static int check_parts(const gq_part *parts, int nparts, int64_t K) {
    for (int p = 0; p < nparts; p++) {
        const int t = parts[p].type, bv = block_values(t);
        if (family(t) < 0) return -2;
        if (K % 32 || K % bv || (family(t) == FAM_F && K % 16)) return -3;
        if (parts[p].row_bytes != K / bv * block_bytes(t)) return -4;
    }
    return 0;
}

/* y[M, N] = x[M, K] @ W^T (+ bias[N]), W given as parts stacked along the output dimension.
 * Returns 0; -1 out of memory; -2 an unsupported type; -3 K not a multiple of the block size;
 * -4 a part's row size does not match its type and K. */
/* 64-byte aligned: the activation rows are read in 64-byte loads, and malloc's 16-byte alignment split every
 * one across two cache lines. Harness (gq.c in a C timer, 1 thread, 2048 rows in cache, AMD EPYC), ns per 256
 * values, malloc -> aligned: Q5_0 x 896 M=8 50.5 -> 47.1-47.4, Q8_0 M=8 48.2-48.3 -> 46.1-46.6, Q4_K x 1536 M=8
 * 31.2-33.3 -> 31.2-31.8; M=1 unchanged. */
static void *alloc64(size_t n) { return aligned_alloc(64, (n + 63) & ~(size_t)63); }

int gq_matmul(const gq_part *parts, int nparts, const float *x, int64_t M, int64_t K, const float *bias, float *y,
              int64_t N, int nthreads) {
    int rc = check_parts(parts, nparts, K);
    if (rc) return rc;
    int need32 = 0, needk = 0;
    int64_t total = 0;
    for (int p = 0; p < nparts; p++) {
        need32 |= family(parts[p].type) == FAM_32;
        needk |= family(parts[p].type) == FAM_K;
        total += parts[p].n;
    }
    if (total != N) return -4;
    const int64_t nb = K / 32, nsb = K / 256;
    int8_t *xq32 = NULL, *xqk = NULL;
    float *xd32 = NULL, *xs32 = NULL, *xdk = NULL;
    int16_t *xbk = NULL;
    if (need32) {
        xq32 = alloc64(M * K + 64);
        xd32 = malloc(sizeof(float) * (M * nb + 1));
        xs32 = malloc(sizeof(float) * (M * nb + 1));
    }
    if (needk) {
        xqk = alloc64(M * K + 64);
        xdk = malloc(sizeof(float) * (M * nsb + 1));
        xbk = malloc(sizeof(int16_t) * (M * (K / 16) + 16));
    }
    if ((need32 && (!xq32 || !xd32 || !xs32)) || (needk && (!xqk || !xdk || !xbk))) {
        rc = -1;
        goto done;
    }
    if (nthreads < 1) nthreads = 1;
    if (N * K < (1 << 16)) nthreads = 1; /* not worth waking other threads */

#pragma omp parallel num_threads(nthreads)
    {
        if (need32) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < M * nb; i++)
                quantize_block(x + i * 32, 32, xq32 + i * 32, xd32 + i, NULL, xs32 + i);
        }
        if (needk) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < M * nsb; i++)
                quantize_block(x + i * 256, 256, xqk + i * 256, xdk + i, xbk + i * 16, NULL);
        }
        /* one decoded row per thread: u[K], sce[K/2], mn[K/16], d/dm[K/32], f[K] */
        const size_t bytes = (size_t)K + 64 + sizeof(int16_t) * (K / 2 + K / 16) + 2 * sizeof(float) * (K / 32) +
                             sizeof(float) * K + 256;
        char *mem = alloc64(bytes);
        drow r;
        if (mem) {
            r.u = (uint8_t *)mem;
            r.sce = (int16_t *)(mem + ((K + 64 + 63) & ~(int64_t)63));
            r.mn = r.sce + K / 2;
            r.d = (float *)(r.mn + K / 16 + 16);
            r.dm = r.d + K / 32;
            r.f = r.dm + K / 32;
        } else {
#pragma omp atomic write
            rc = -1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < N; g++) {
            if (!mem) continue;
            int p = 0;
            int64_t off = 0;
            while (g - off >= parts[p].n) off += parts[p++].n;
            const gq_part *P = parts + p;
            const int64_t rr = g - off;
            const int t = P->type, fam = family(t);
            const uint8_t *wrow = P->w + rr * P->row_bytes;
            const int64_t col = off + (P->perm ? P->perm[rr] : rr);
            const float bv = bias ? bias[col] : 0.0f;
            const float *wf = r.f;
            const int raw = GQ_AVX2 && (t == Q4_K || t == Q6_K || fam == FAM_32); /* GQ_512 implies GQ_AVX2 */
            if (t == F32) wf = (const float *)wrow;
            else if (!raw) decode_row(t, wrow, K, &r);
            for (int64_t m0 = 0; m0 < M; m0 += MAXR) {
                const int mc = (int)(M - m0 < MAXR ? M - m0 : MAXR);
                float o[MAXR];
                if (raw) {
#if GQ_512
#define KR(R) dot_k_raw(R, t == Q6_K, wrow, nsb, xqk + m0 * K, K, xdk + m0 * nsb, xbk + m0 * (K / 16), o)
#define BR(R) dot_32_raw(R, t, wrow, nb, xq32 + m0 * K, K, xd32 + m0 * nb, xs32 + m0 * nb, o)
                    if (fam == FAM_32) {
                        ROW_SWITCH(mc, BR);
                    } else {
                        ROW_SWITCH(mc, KR);
                    }
#undef KR
#undef BR
#elif GQ_AVX2
#define KR(R) dot_k_raw(R, t == Q6_K, wrow, nsb, xqk + m0 * K, K, xdk + m0 * nsb, xbk + m0 * (K / 16), o)
#define BR(R) dot_32_raw(R, t, wrow, nb, xq32 + m0 * K, K, xd32 + m0 * nb, xs32 + m0 * nb, o)
                    if (fam == FAM_32) {
                        ROW_SWITCH(mc, BR);
                    } else {
                        ROW_SWITCH(mc, KR);
                    }
#undef KR
#undef BR
#endif
                } else if (fam == FAM_K) {
#define KB(R) dot_k(R, &r, nsb, xqk + m0 * K, K, xdk + m0 * nsb, xbk + m0 * (K / 16), o)
                    ROW_SWITCH(mc, KB);
#undef KB
                } else if (fam == FAM_32) {
#define B32(R) dot_32(R, &r, nb, t == Q8_0, xq32 + m0 * K, K, xd32 + m0 * nb, xs32 + m0 * nb, o)
                    ROW_SWITCH(mc, B32);
#undef B32
                } else {
#define FB(R) dot_f(R, wf, x + m0 * K, K, o)
                    ROW_SWITCH(mc, FB);
#undef FB
                }
                for (int m = 0; m < mc; m++) y[(m0 + m) * N + col] = bias ? o[m] + bv : o[m];
            }
        }
        free(mem);
    }
done:
    free(xq32); free(xd32); free(xs32); free(xqk); free(xdk); free(xbk);
    return rc;
}

/* ---------------------------------------------------------------- dequantisation (embeddings, prefill) */

/* A Q4_K superblock straight from its bytes into floats: the values and operations of the decode_k path
 * below (same bits), in loops that gcc vectorizes, without decode_k's pair-scale expansion. The prefill
 * dequantizes every weight once per chunk; layer 0 gate_up of the 1.5B (27.5M Q4_K weights, 2 threads,
 * AMD EPYC): 10.3 ms through decode_k, 3.4 ms here. (Q6_K measured no faster this way, 3.3-3.6 vs 3.5-4.0 ms on a
 * down projection, so it keeps the decode_k path.) Returns 0 for other types. */
static int dequant_sb_direct(int t, const uint8_t *b, float *o) {
    if (t != Q4_K) return 0;
    uint8_t s8[8], m8[8];
    q4k_scales(b + 4, s8, m8);
    const float d = rdh(b), dmin = rdh(b + 2);
    for (int j = 0; j < 4; j++) {
        const uint8_t *q = b + 16 + 32 * j;
        const float dl0 = d * (float)s8[2 * j], ml0 = dmin * (float)m8[2 * j];
        const float dl1 = d * (float)s8[2 * j + 1], ml1 = dmin * (float)m8[2 * j + 1];
        for (int l = 0; l < 32; l++) o[64 * j + l] = dl0 * (float)(q[l] & 0xf) - ml0;
        for (int l = 0; l < 32; l++) o[64 * j + 32 + l] = dl1 * (float)(q[l] >> 4) - ml1;
    }
    return 1;
}

/* The float weights of one row as gguf's dequantisers compute them (same operations, same bits). */
static void dequant_row(int t, const uint8_t *w, int64_t K, float *out) {
    const int bb = block_bytes(t);
    if (t == F32) { memcpy(out, w, sizeof(float) * K); return; }
    if (t == F16 || t == BF16) {
        for (int64_t e = 0; e < K; e++) {
            if (t == F16) out[e] = f16_to_f32(rd16(w + 2 * e));
            else { const uint32_t bits = (uint32_t)rd16(w + 2 * e) << 16; memcpy(out + e, &bits, 4); }
        }
        return;
    }
    uint8_t u[256];
    int16_t sce[128], mn[16];
    float d[8], dm[8];
    drow r = {u, sce, mn, d, dm, NULL};
    if (family(t) == FAM_32) {
        for (int64_t i = 0; i < K / 32; i++) {
            const uint8_t *b = w + i * bb;
            decode_32(t, b, &r, 0);
            const float db = d[0], m = dm[0];
            float *o = out + 32 * i;
            /* the type's branch outside the value loop, so that gcc vectorizes it */
            switch (t) {
            case Q4_0: for (int l = 0; l < 32; l++) o[l] = db * (float)(u[l] - 8); break;
            case Q5_0: for (int l = 0; l < 32; l++) o[l] = db * (float)(u[l] - 16); break;
            case Q8_0: for (int l = 0; l < 32; l++) o[l] = (float)(u[l] - 128) * db; break;
            default: for (int l = 0; l < 32; l++) o[l] = db * (float)u[l] + m; break; /* Q4_1, Q5_1: d q + m */
            }
        }
        return;
    }
    for (int64_t sb = 0; sb < K / 256; sb++) {
        if (dequant_sb_direct(t, w + sb * bb, out + 256 * sb)) continue;
        decode_k(t, w + sb * bb, &r, 0);
        for (int g = 0; g < 16; g++) {
            const float dl = d[0] * (float)sce[8 * g], ml = dm[0] * (float)mn[g];
            const uint8_t *ug = u + 16 * g;
            float *o = out + 256 * sb + 16 * g;
            switch (t) {
            case Q6_K: for (int l = 0; l < 16; l++) o[l] = dl * (float)(ug[l] - 32); break;
            case Q3_K: for (int l = 0; l < 16; l++) o[l] = dl * (float)(ug[l] - 4); break;
            default: for (int l = 0; l < 16; l++) o[l] = dl * (float)ug[l] - ml; break; /* Q2_K, Q4_K, Q5_K */
            }
        }
    }
}

/* out[i, K] = row rows[i] of W (embedding lookups). Returns 0, or -2 for an unsupported type. */
int gq_dequant_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t K, const int64_t *rows, int64_t n,
                    float *out) {
    if (family(type) < 0) return -2;
    for (int64_t i = 0; i < n; i++) dequant_row(type, w + rows[i] * row_bytes, K, out + i * K);
    return 0;
}

/* bf16 of a float, rounded to nearest even as torch's Tensor.to(torch.bfloat16); any NaN to 0x7fc0 (torch keeps
 * a NaN's sign and payload bits) */
static inline uint16_t to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

#if GQ_512
/* to_bf16 of 32 finite floats (lo, hi) into o[0..31]: rounded to nearest even, the upper halves gathered by
 * one permute (a NaN would need to_bf16's 0x7fc0: rows whose scales are not all finite are left to it) */
static inline __attribute__((always_inline)) void store_bf16x32(uint16_t *o, __m512 lo, __m512 hi) {
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    const __m512i a = _mm512_castps_si512(lo), b = _mm512_castps_si512(hi);
    const __m512i ra = _mm512_add_epi32(_mm512_add_epi32(a, half), _mm512_and_si512(_mm512_srli_epi32(a, 16), one));
    const __m512i rb = _mm512_add_epi32(_mm512_add_epi32(b, half), _mm512_and_si512(_mm512_srli_epi32(b, 16), one));
    const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25,
                                         23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    _mm512_storeu_si512((void *)o, _mm512_permutex2var_epi16(ra, odd, rb));
}

/* Whether every fp16 scale of a row's blocks is finite (then so is every value the row dequantizes to) */
static int scales_finite(int t, const uint8_t *w, int64_t K) {
    const int bb = block_bytes(t), nb = (int)(K / block_values(t));
    const int at = t == Q6_K ? 208 : 0, two = t == Q4_1 || t == Q5_1 || t == Q4_K;
    for (int i = 0; i < nb; i++) {
        const uint8_t *b = w + (int64_t)i * bb + at;
        if ((rd16(b) & 0x7c00) == 0x7c00 || (two && (rd16(b + 2) & 0x7c00) == 0x7c00)) return 0;
    }
    return 1;
}

/* 32 values from the signed bytes q (q = u - the type's offset): s0 * q for the first 16, s1 * q for the
 * next 16, then + a0 / + a1 where add; dequant_row's products and sums, so the same bits */
static inline __attribute__((always_inline)) void bf16_values32(uint16_t *o, __m256i q, float s0, float s1, int add,
                                                                float a0, float a1) {
    __m512 lo = _mm512_mul_ps(_mm512_set1_ps(s0), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
    __m512 hi = _mm512_mul_ps(_mm512_set1_ps(s1), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
    if (add) {
        lo = _mm512_add_ps(lo, _mm512_set1_ps(a0));
        hi = _mm512_add_ps(hi, _mm512_set1_ps(a1));
    }
    store_bf16x32(o, lo, hi);
}

/* One row of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K straight into bf16 with the matmul's register decoders
 * (u32x2_512, u32_avx2, regs_q4k, regs_q6k): long passes dequantize every weight per pass, and dequant_row's
 * decoding made that ~16% of a 118-token prefill of the 1.5B. Returns 0 for other types and for rows with
 * a non-finite scale (to_bf16's NaN). */
static int dequant_row_bf16_512(int t, const uint8_t *w, int64_t K, uint16_t *out) {
    if ((family(t) != FAM_32 && t != Q4_K && t != Q6_K) || !scales_finite(t, w, K)) return 0;
    if (family(t) == FAM_32) {
        /* Q4_1/Q5_1: d u + m; the others d (u - offset), where u - offset fits a signed byte */
        const int bb = block_bytes(t), add = t == Q4_1 || t == Q5_1;
        const __m512i ofs = _mm512_set1_epi8((char)(t == Q4_0 ? 8 : t == Q5_0 ? 16 : t == Q8_0 ? 128 : 0));
        const int64_t nb = K / 32;
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            float d0, d1, o0, o1;
            const __m512i q = _mm512_sub_epi8(u32x2_512(t, w + b * bb, bb, &d0, &d1, &o0, &o1), ofs);
            bf16_values32(out + 32 * b, _mm512_castsi512_si256(q), d0, d0, add, o0, o0);
            bf16_values32(out + 32 * b + 32, _mm512_extracti64x4_epi64(q, 1), d1, d1, add, o1, o1);
        }
        if (b < nb) {
            float d, o;
            const __m256i q = _mm256_sub_epi8(u32_avx2(t, w + b * bb, &d, &o), _mm512_castsi512_si256(ofs));
            bf16_values32(out + 32 * b, q, d, d, add, o, o);
        }
        return 1;
    }
    const int bb = block_bytes(t);
    const __m512i ofs = _mm512_set1_epi8(t == Q6_K ? 32 : 0);
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t *b = w + sb * bb;
        __m512i U[4], S[4];
        __m256i mn;
        float d, dm, dl[16], ml[16];
        if (t == Q6_K) { /* dl * (u - 32) per group of 16 */
            regs_q6k(b, U, S, &mn, &d, &dm);
            const int8_t *sc = (const int8_t *)(b + 192);
            for (int g = 0; g < 16; g++) { dl[g] = d * (float)sc[g]; ml[g] = 0.0f; }
        } else { /* dl * u - ml per sub-block of 32 */
            regs_q4k(b, U, S, &mn, &d, &dm);
            uint8_t s8[8], m8[8];
            q4k_scales(b + 4, s8, m8);
            for (int g = 0; g < 16; g++) { dl[g] = d * (float)s8[g / 2]; ml[g] = -(dm * (float)m8[g / 2]); }
        }
        for (int c = 0; c < 4; c++) {
            const __m512i q = _mm512_sub_epi8(U[c], ofs);
            uint16_t *o = out + 256 * sb + 64 * c;
            const int g = 4 * c;
            bf16_values32(o, _mm512_castsi512_si256(q), dl[g], dl[g + 1], t == Q4_K, ml[g], ml[g + 1]);
            bf16_values32(o + 32, _mm512_extracti64x4_epi64(q, 1), dl[g + 2], dl[g + 3], t == Q4_K, ml[g + 2], ml[g + 3]);
        }
    }
    return 1;
}
#endif

/* out[r1 - r0, K] = rows r0 .. r1 - 1 of W, in float32 (bf16 = 0) or as their bf16 roundings (bf16 = 1: the
 * weights long passes multiply, written straight into the chunk torch multiplies, with no float32 copy).
 * Returns 0, -1 out of memory, -2 an unsupported type. */
int gq_dequant_range(int type, const uint8_t *w, int64_t row_bytes, int64_t K, int64_t r0, int64_t r1, void *out,
                     int bf16, int nthreads) {
    if (family(type) < 0) return -2;
    if (nthreads < 1) nthreads = 1;
    int rc = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *tmp = bf16 ? malloc(sizeof(float) * K) : NULL;
        if (bf16 && !tmp) {
#pragma omp atomic write
            rc = -1;
        }
#pragma omp for schedule(static)
        for (int64_t r = r0; r < r1; r++) {
            if (!bf16) {
                dequant_row(type, w + r * row_bytes, K, (float *)out + (r - r0) * K);
            } else if (tmp) {
#if GQ_512
                if (dequant_row_bf16_512(type, w + r * row_bytes, K, (uint16_t *)out + (r - r0) * K)) continue;
#endif
                dequant_row(type, w + r * row_bytes, K, tmp);
                uint16_t *o = (uint16_t *)out + (r - r0) * K;
                for (int64_t e = 0; e < K; e++) o[e] = to_bf16(tmp[e]);
            }
        }
        free(tmp);
    }
    return rc;
}

/* Which build this is: 3 AVX512-VNNI, 2 AVX-VNNI, 1 AVX2, 0 portable C. */
int gq_isa(void) { return GQ_512 ? 3 : GQ_VNNI ? 2 : GQ_AVX2 ? 1 : 0; }
