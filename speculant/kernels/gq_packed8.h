/* Passes of 5..8 activation rows over packed Q6_K tiles on the 256-bit builds (AVX2, AVX-VNNI), and of 2..4 on
 * AVX-VNNI.
 * Part of gq.c, included at the end of gq_packed.h (its layouts, canonical forms and helpers).
 *
 * Why: gq_packed.h's passes keep a sub-block's chains for both half-tiles (8 lanes each) and both nibble halves
 * live, 4 per row; 16 ymm registers hold that for 4 rows at most (PACKED_MR 4), so a verification pass of 8 rows
 * was two passes, each unpacking every weight vector and reading the tile again. Here a pass keeps one half-tile
 * and one group of 16 values live at a time: one chain per row, so 8 rows
 * fit, and every weight vector is unpacked once for all the rows of the pass. Each activation quad is then
 * broadcast once per half-tile rather than once per pass: more loads, no more arithmetic. Q4_K's unpacking is small
 * beside its rows' work, so its AVX2 passes keep both half-tiles instead (gq_packed_i16.h); Q5_K keeps PACKED_MR.
 *
 * The integers are gq_packed.h's exact S and Mn, summed in another order (exact: the same integers), and the
 * float work per (superblock, row, lane) is the same two fused multiply-adds in superblock order, so a row's bits
 * do not depend on which pass computes it (tests/test_gguf_kernels.py runs 1..32 rows on every build). */
#ifndef SPECULANT_GQ_PACKED8_H
#define SPECULANT_GQ_PACKED8_H

#if GQ_AVX2 && !GQ_512
#define PACKED8 1
#define PACKED8_MR 8

/* out[m][v] for R (5..8) activation rows of a Q6_K tile: packed6_rows' arguments. Per half-tile the rows' S stay in registers over the superblock
 * (8 chains); without VNNI each group's 4 quads are two int16 pairs of vpmaddubsw sums (u < 64, |x| <= 127: a
 * pair of quads <= 32004), widened by vpmaddwd with the group's scale in both halves of each lane. */
static inline __attribute__((always_inline)) void packed8_6_rows(const int R, const uint8_t *tile, const int64_t nsb,
                                                                 const int8_t *xq, const int64_t K, const float *xd,
                                                                 const int16_t *b16, vf_t out[PACKED8_MR][2]) {
    vf_t acc[PACKED8_MR][2];
    SET_RV(acc, R, 2, VF_ZERO());
    const vi_t lo4 = VI_SET1(0x0f0f0f0f);
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *o = tile + sb * PACK6_SB_BYTES;
        const int8_t *x = xq + sb * 256;
        for (int v = 0; v < 2; v++) {
            vi_t S[PACKED8_MR];
            for (int m = 0; m < R; m++) S[m] = VI_ZERO();
            for (int G = 0; G < 16; G++) { /* group G of 16 values: 16G .. (G < 8), else 128 + 16(G - 8) .. */
                const int h = G / 8, s = G % 8;
                const __m128i hs = _mm_cvtsi32_si128(4 * h); /* a shift by the nibble half: no branch on h */
                const vi_t hq = VI_LOAD(o + P6_QH + 64 * G + 32 * v);
                vi_t w[4];
                for (int f = 0; f < 4; f++) {
                    if (!v) prefetch_spread(o, PACK6_SB_BYTES, 8192, 4 * G + f);
                    const vi_t q = VI_LOAD(o + 64 * (4 * s + f) + 32 * v);
                    w[f] = VI_OR(VI_AND(_mm256_srl_epi16(q, hs), lo4), q6_high(hq, f));
                }
                const vi_t sc = VI_I8_32(o + P6_SC + 16 * G + 8 * v);
#if GQ_VNNI
                for (int m = 0; m < R; m++) {
                    const int8_t *p = x + m * K + 128 * h + 16 * s;
                    vi_t I = VI_ZERO();
                    for (int f = 0; f < 4; f++) I = VDP_U8(I, w[f], bcast4(p + 4 * f));
                    S[m] = VI_ADD(S[m], VI_MULLO(I, sc));
                }
#else
                const vi_t s2 = VI_OR(VI_AND(sc, VI_SET1(0xffff)), VI_SLLI32(sc, 16)); /* sc in both int16 halves */
                for (int m = 0; m < R; m++) {
                    const int8_t *p = x + m * K + 128 * h + 16 * s;
                    const vi_t p0 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], bcast4(p)),
                                                     _mm256_maddubs_epi16(w[1], bcast4(p + 4)));
                    const vi_t p1 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], bcast4(p + 8)),
                                                     _mm256_maddubs_epi16(w[3], bcast4(p + 12)));
                    S[m] = VI_ADD(S[m], VI_ADD(_mm256_madd_epi16(p0, s2), _mm256_madd_epi16(p1, s2)));
                }
#endif
            }
            vi_t sp[8]; /* packed6_rows' Mn and float work */
            for (int p = 0; p < 8; p++) sp[p] = q6_scale_pairs(o + P6_SC + 32 * p, v);
            const vf_t D = VF_LOAD((const float *)(o + P6_D) + 8 * v);
            for (int m = 0; m < R; m++) {
                vi_t Mn = VI_ZERO();
                for (int p = 0; p < 8; p++) Mn = VDP_I16(Mn, sp[p], bcast4(b16 + m * (K / 16) + sb * 16 + 2 * p));
                const vf_t ddx = VF_MUL(D, VF_SET1(xd[m * nsb + sb]));
                acc[m][v] = VF_FMA(VF_CVT(S[m]), ddx, acc[m][v]);
                acc[m][v] = VF_FNMA(VF_CVT(VI_SLLI32(Mn, 5)), ddx, acc[m][v]);
            }
        }
    }
    COPY_RV(out, acc, R, 2);
}

#if GQ_VNNI
/* out[m][v] for R (2..4) activation rows of a Q6_K tile on AVX-VNNI: packed6_rows' arguments. packed6_rows keeps both
 * nibble halves' chains live (4 a row: 16 registers at 4 rows, and they spilled); here one half at a time (groups
 * 8h .. 8h + 7), 2 chains a row, as gq_packed_i16.h does for Q4_K: extra rows cost less than packed6_rows' at 2-4
 * rows (`scripts/row_cost.py --types Q6_K --rows 2 3 4`); on AVX2 without VNNI it was no faster in a model's passes
 * (`scripts/kernel_ab.py`; docs/measurements.md, issue 49). */
static inline __attribute__((always_inline)) void packed6_half_rows(const int R, const uint8_t *tile, const int64_t nsb,
                                                                    const int8_t *xq, const int64_t K, const float *xd,
                                                                    const int16_t *b16, vf_t out[][2]) {
    vf_t acc[4][2];
    SET_RV(acc, R, 2, VF_ZERO());
    const vi_t lo4 = VI_SET1(0x0f0f0f0f);
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *o = tile + sb * PACK6_SB_BYTES;
        const int8_t *x = xq + sb * 256;
        vi_t S[4][2];
        SET_RV(S, R, 2, VI_ZERO());
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 8; s++) { /* group 8h + s: values 128h + 16s .. */
                const int G = 8 * h + s;
                vi_t I[4][2], hq[2];
                SET_RV(I, R, 2, VI_ZERO());
                for (int v = 0; v < 2; v++) hq[v] = VI_LOAD(o + P6_QH + 64 * G + 32 * v);
#pragma GCC unroll 4
                for (int f = 0; f < 4; f++) {
                    if (!h) prefetch_spread(o, PACK6_SB_BYTES, 8192, 4 * s + f);
                    vi_t w[2];
                    for (int v = 0; v < 2; v++) {
                        const vi_t q = VI_LOAD(o + 64 * (4 * s + f) + 32 * v);
                        w[v] = VI_OR(VI_AND(h ? VI_SRLI16(q, 4) : q, lo4), q6_high(hq[v], f));
                    }
                    for (int m = 0; m < R; m++) {
                        const vi_t xb = bcast4(x + m * K + 128 * h + 16 * s + 4 * f);
                        for (int v = 0; v < 2; v++) I[m][v] = VDP_U8(I[m][v], w[v], xb);
                    }
                }
                for (int v = 0; v < 2; v++) {
                    const vi_t sc = VI_I8_32(o + P6_SC + 16 * G + 8 * v);
                    for (int m = 0; m < R; m++) S[m][v] = VI_ADD(S[m][v], VI_MULLO(I[m][v], sc));
                }
            }
        q6k_finish(R, 2, o, S, b16, K, sb, xd, nsb, acc);
    }
    COPY_RV(out, acc, R, 2);
}
#endif
#else
#define PACKED8 0
#define PACKED8_MR PACKED_MR
#endif

#endif /* SPECULANT_GQ_PACKED8_H */
