/* 32-block and float dot products (decoded rows and raw blocks).
 * Part of gq.c, included once into its one translation unit. */
#ifndef SPECULANT_GQ_DOT_32_H
#define SPECULANT_GQ_DOT_32_H

#include "gq_dot_k.h"

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
 * six AVX2 operations per block. With dot_32_pair's one multiply for both blocks' d * dx this is 10-20%
 * faster per block (docs/measurements.md "Kernel choices"). */
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
 * per pair measured slower on Q8_0 at M = 8; docs/measurements.md "Kernel choices"). */
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


#endif /* SPECULANT_GQ_DOT_32_H */
