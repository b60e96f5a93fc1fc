/* Q4_K, Q5_K and Q6_K repacked at load: 16 weight rows per tile, one output per lane, for every pass (1..any rows).
 * Part of gq.c, included once into its one translation unit, after gq_gemm.h (its vector macros).
 *
 * The file's row-major blocks make each output a horizontal reduction (gq_dot_k.h: 16 lanes per output, a
 * decode of every superblock per row); with 16 rows interleaved, one vpdpbusd multiplies 4 values of 16
 * outputs, the unpacking of a superblock is shared by the 16 outputs and by every activation row, and a row
 * costs ~1/3 of the instructions. The nibbles stay nibbles (2368 bytes per 16 rows x 256 values against the
 * file's 2304), so a decode step still reads about the file's bytes. The packed tiles beat the file's blocks
 * at every row count (`scripts/linear_timing.py`; docs/measurements.md "Kernel choices").
 *
 * Canonical form of a packed Q4_K output (n, m), the same in every build and for every row count: per
 * superblock the exact integers S = sum over sub-blocks j of sc[j] * (sum of u * x over j) and
 * Mn = sum over j of mn[j] * B32[j] (B32: the sum of x over sub-block j), then
 *   acc = fma(S, d * dx, acc); acc = fma(-Mn, dmin * dx, acc)   (superblock order; y = acc + bias).
 *
 * Q4_K tile layout per superblock (PACK_SB_BYTES): qs[32 groups g][16 lanes][4 bytes], byte i of lane n
 * holding u of value 4g + i (low nibble) and of value 128 + 4g + i (high); sc[8][16] u8; mn[4 pairs p][16][2]
 * u8 (mn of sub-blocks 2p, 2p + 1); d[16], dmin[16] fp16, the file's: 2368 bytes per 16 rows against the file's 2304.
 * The mins and scales stay the file's bytes: with int16 mins and float scales (2560 bytes) the 1.5B's linears read
 * 1052 MB a token against the file's 980, and a decode step that runs at the bandwidth pays for every extra byte
 * (`scripts/vs_llama_cpp.sh`). Tile t's superblocks follow each other.
 *
 * Q5_K (PACK5_SB_BYTES): Q4_K's layout (u's low 4 bits in qs) and at P5_QH the fifth bits, qh[8 h][16 lanes][4 bytes],
 * byte i of word h holding at bit f (0..3) that of value 4(4h + f) + i and at bit 4 + f that of value 128 + 4(4h + f) + i.
 * Its canonical form is Q4_K's, u < 32. Unpacked (gq_dot_k.h's 16 lanes per output) a Q5_K_M file's linears were
 * compute-bound, not bandwidth-bound; packed they take about 2/3 of the time at one row and half at 4-8
 * (`scripts/linear_timing.py`; docs/measurements.md "Kernel choices").
 *
 * Q6_K (PACK6_SB_BYTES, 1% more than the file's): the low 4 bits of u = q + 32 as Q4_K's qs; qh[16 h][16 lanes]
 * [4 bytes], byte i of hgroup h (< 8: values 16h + 4f + i, >= 8: 128 + 16(h - 8) + 4f + i, f = 0..3) holding
 * their top 2 bits, f = 0 at bits 4-5, 1 at 6-7, 2 at 0-1, 3 at 2-3 (one shift and mask each puts them at
 * bits 4-5); sc[16 groups][16] int8; d[16] float. Its canonical form: per superblock the exact
 * S = sum of sc[g] * (sum of u*x over group g of 16) and Mn = 32 * sum of sc[g] * B16[g], then
 *   acc = fma(S, d * dx, acc); acc = fma(-Mn, d * dx, acc). */
#ifndef SPECULANT_GQ_PACKED_H
#define SPECULANT_GQ_PACKED_H

/* The most activation rows of a pass over a packed tile. 8 on AVX-512: a verification pass of 5-8 rows unpacks each
 * tile once, where passes of 4 unpacked it twice (`scripts/linear_timing.py` at M = 5 and 8; docs/measurements.md
 * "Kernel choices"). The 256-bit builds' 16 registers keep 4. */
#if GQ_512
#define PACKED_MR 8
#define PACKED_SWITCH ROW_SWITCH
#else
#define PACKED_MR 4
#define PACKED_SWITCH GEMM_SWITCH
#endif

#define PACK_SB_BYTES 2368
#define PK_SC 2048
#define PK_MN 2176
#define PK_D 2304
#define PK_DM 2336
#define PACK5_SB_BYTES 2880
#define P5_QH 2368
#define PACK6_SB_BYTES 3392
#define P6_QH 2048
#define P6_SC 3072
#define P6_D 3328
/* Q2_K and Q3_K (gq_packed2.h): 2-bit fields at 0, Q3_K's third bits at P3_H, the scale bytes at P2_SC / P3_SC, then
 * d[16] (and Q2_K's dmin[16]) fp16 */
#define PACK2_SB_BYTES 1344
#define P2_SC 1024
#define PACK3_SB_BYTES 1824
#define P3_H 1024
#define P3_SC 1536

static inline int64_t packed_sb_bytes(int t) {
    return t == Q6_K ? PACK6_SB_BYTES : t == Q5_K ? PACK5_SB_BYTES : t == Q3_K ? PACK3_SB_BYTES
         : t == Q2_K ? PACK2_SB_BYTES : PACK_SB_BYTES;
}

#if GQ_AVX2
/* 2 VL bytes at b as VL int16 pairs, bytes 2n and 2n + 1 in lane n's halves, sign- or zero-extended: the
 * packed K-quants' mins (and Q2_K's / Q3_K's scales) for vpdpwssd */
static inline vi_t pairs16(const uint8_t *b, int sign) {
#if GQ_512
    const __m256i s = _mm256_loadu_si256((const __m256i *)b);
    return sign ? _mm512_cvtepi8_epi16(s) : _mm512_cvtepu8_epi16(s);
#else
    const __m128i s = _mm_loadu_si128((const __m128i *)b);
    return sign ? _mm256_cvtepi8_epi16(s) : _mm256_cvtepu8_epi16(s);
#endif
}

/* w | bit b of each byte of h at bit tb (clear in w) of the same byte: Q5_K's fifth bits at bit 4 (P5_QH below, b = the
 * quad's bit), Q5_0's / Q5_1's qh (gq_packed32.h), Q3_K's third bits at bit 2 (gq_packed2.h). AVX-512: bit b of each
 * byte as a byte mask (vptestmb), then a masked add: 2 operations instead of 3 (shift, and, or); the 0.5B draft's
 * Q5_0 linears are compute-bound when memory is fast. Both give the same bytes. */
static inline vi_t with_bit(vi_t w, vi_t h, int b, int tb) {
#if GQ_512
    return _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(h, _mm512_set1_epi8((char)(1 << b))), w,
                                _mm512_set1_epi8((char)(1 << tb)));
#else
    return VI_OR(w, VI_AND(b <= tb ? VI_SLLI32(h, tb - b) : VI_SRLI32(h, b - tb), VI_SET1(0x01010101 << tb)));
#endif
}

/* AVX2 without VNNI has no one-instruction u8 x s8 dot product: VDP_U8 is vpmaddubsw, vpmaddwd by ones and vpaddd.
 * Q4_K passes there (gq_packed_i16.h) keep each sub-block's pair sums in int16 and widen them once per sub-block,
 * by vpmaddwd with the sub-block's scales (i16_scales: the scale in both halves of each lane; no vpmulld). */
#if !GQ_VNNI
static inline vi_t i16_scales(vi_t s) { return VI_OR(s, VI_SLLI32(s, 16)); } /* s < 2^15 in each int32 lane */
#endif

/* The end of superblock sb of a packed Q4_K/Q5_K tile o for R rows: Mn from the mins and the sums of x per 32, then
 * the canonical two fused multiply-adds into acc (the float work every build and pass shares) */
static inline __attribute__((always_inline)) void q4k_finish(const int R, const int NV, const uint8_t *o, vi_t S[][2],
                                                             const int16_t *b32, const int64_t K, const int64_t sb,
                                                             const float *xd, const int64_t nsb, vf_t acc[][2]) {
    for (int v = 0; v < NV; v++) {
        const vf_t D = VF_F16(o + PK_D + 2 * VL * v), DM = VF_F16(o + PK_DM + 2 * VL * v);
        vi_t mn[4];
        for (int p = 0; p < 4; p++) mn[p] = pairs16(o + PK_MN + 32 * p + 2 * VL * v, 0);
        for (int m = 0; m < R; m++) {
            vi_t Mn = VI_ZERO();
            for (int p = 0; p < 4; p++) Mn = VDP_I16(Mn, mn[p], bcast4(b32 + m * (K / 32) + sb * 8 + 2 * p));
            const vf_t dx = VF_SET1(xd[m * nsb + sb]);
            acc[m][v] = VF_FMA(VF_CVT(S[m][v]), VF_MUL(D, dx), acc[m][v]);
            acc[m][v] = VF_FNMA(VF_CVT(Mn), VF_MUL(DM, dx), acc[m][v]);
        }
    }
}

/* out[m][v] (lanes VL v .. of the tile) for R activation rows: xq [R][K], xd [R][nsb], b32 [R][K / 32]. Q5_K, and
 * Q4_K on the VNNI builds. */
static inline __attribute__((always_inline)) void packed_rows(const int R, const int q5, const uint8_t *tile,
                                                              const int64_t nsb,
                                                              const int8_t *xq, const int64_t K, const float *xd,
                                                              const int16_t *b32, vf_t out[PACKED_MR][2]) {
    const int NV = 16 / VL;
    vf_t acc[PACKED_MR][2]; /* in registers: accumulating in out (a pointer, aliased by the byte loads) was slower */
    SET_RV(acc, R, NV, VF_ZERO());
    const vi_t lo4 = VI_SET1(0x0f0f0f0f);
    const int64_t sbb = q5 ? PACK5_SB_BYTES : PACK_SB_BYTES;
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *o = tile + sb * sbb;
        /* Every build asks for the superblock ahead two lines a group (prefetch_spread), between the multiplies: a
         * burst of the whole superblock's lines at its start stalled the core on its miss buffers, on the 256-bit
         * builds and on AVX-512 too, where a decode step got faster by a fifth (`scripts/kernel_ab.py`;
         * docs/measurements.md, issue 49). */
        vi_t S[PACKED_MR][2];
        SET_RV(S, R, NV, VI_ZERO());
        const int8_t *x = xq + sb * 256;
        for (int j = 0; j < 4; j++) { /* sub-blocks j (low nibbles) and j + 4 (high) */
            vi_t Il[PACKED_MR][2], Ih[PACKED_MR][2];
            SET_RV(Il, R, NV, VI_ZERO());
            SET_RV(Ih, R, NV, VI_ZERO());
#pragma GCC unroll 8
            for (int g = 8 * j; g < 8 * j + 8; g++) {
                prefetch_spread(o, sbb, q5 ? 8192 : 4096, g);
                vi_t wl[2], wh[2];
                for (int v = 0; v < NV; v++) {
                    const vi_t q = VI_LOAD(o + 64 * g + 4 * VL * v);
                    wl[v] = VI_AND(q, lo4);
                    wh[v] = VI_AND(VI_SRLI16(q, 4), lo4);
                    if (q5) {
                        const vi_t h = VI_LOAD(o + P5_QH + 64 * (g / 4) + 4 * VL * v);
                        wl[v] = with_bit(wl[v], h, g % 4, 4);
                        wh[v] = with_bit(wh[v], h, 4 + g % 4, 4);
                    }
                }
                for (int m = 0; m < R; m++) {
                    DP_BCAST(Il[m], wl, x + m * K + 4 * g, NV);
                    DP_BCAST(Ih[m], wh, x + m * K + 128 + 4 * g, NV);
                }
            }
            for (int v = 0; v < NV; v++) {
                const vi_t scl = VI_U8_32(o + PK_SC + 16 * j + VL * v), sch = VI_U8_32(o + PK_SC + 16 * (j + 4) + VL * v);
                for (int m = 0; m < R; m++)
                    S[m][v] = VI_ADD(S[m][v], VI_ADD(VI_MULLO(Il[m][v], scl), VI_MULLO(Ih[m][v], sch)));
            }
        }
        q4k_finish(R, NV, o, S, b32, K, sb, xd, nsb, acc);
    }
    COPY_RV(out, acc, R, NV);
}

/* u's top 2 bits of field f of a qh vector, at bits 4-5 of each byte */
static inline vi_t q6_high(vi_t h, int f) {
    const vi_t m = VI_SET1(0x30303030);
    return VI_AND(f == 0 ? h : f == 1 ? VI_SRLI16(h, 2) : f == 2 ? VI_SLLI16B(h, 4) : VI_SLLI16B(h, 2), m);
}

/* Lanes VL v .. of a Q6_K tile's scales of groups 2p and 2p + 1 (sc: group 2p's 16 bytes, then group 2p + 1's) as
 * int16 pairs (sc[2p], sc[2p + 1]), one per lane, for vpdpwssd */
static inline vi_t q6_scale_pairs(const uint8_t *sc, int v) {
    const __m128i a = _mm_loadu_si128((const __m128i *)sc), b = _mm_loadu_si128((const __m128i *)(sc + 16));
#if GQ_512
    (void)v;
    return _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
#else
    return _mm256_cvtepi8_epi16(v ? _mm_unpackhi_epi8(a, b) : _mm_unpacklo_epi8(a, b));
#endif
}

/* The end of superblock sb of a packed Q6_K tile o for R rows: Mn from the scales and the sums of x per 16, then the
 * canonical two fused multiply-adds into acc */
static inline __attribute__((always_inline)) void q6k_finish(const int R, const int NV, const uint8_t *o, vi_t S[][2],
                                                             const int16_t *b16, const int64_t K, const int64_t sb,
                                                             const float *xd, const int64_t nsb, vf_t acc[][2]) {
    for (int v = 0; v < NV; v++) {
        /* Mn by vpdpwssd on pairs of groups (2p, 2p + 1): 8 per row instead of 16 vpmulld and their adds
         * (|sc| <= 128, |B16| <= 2032: exact in int32, so the same integer in any order). An extra row of a
         * Q6_K layer costs about a quarter less this way (`scripts/row_cost.py --types Q4_K Q6_K`) */
        vi_t sp[8];
        for (int p = 0; p < 8; p++) sp[p] = q6_scale_pairs(o + P6_SC + 32 * p, v);
        const vf_t D = VF_LOAD((const float *)(o + P6_D) + VL * v);
        for (int m = 0; m < R; m++) {
            vi_t Mn = VI_ZERO();
            for (int p = 0; p < 8; p++) Mn = VDP_I16(Mn, sp[p], bcast4(b16 + m * (K / 16) + sb * 16 + 2 * p));
            const vf_t ddx = VF_MUL(D, VF_SET1(xd[m * nsb + sb]));
            acc[m][v] = VF_FMA(VF_CVT(S[m][v]), ddx, acc[m][v]);
            acc[m][v] = VF_FNMA(VF_CVT(VI_SLLI32(Mn, 5)), ddx, acc[m][v]);
        }
    }
}

/* packed_rows for Q6_K: b16 [R][K / 16] (sums of x per 16). */
static inline __attribute__((always_inline)) void packed6_rows(const int R, const uint8_t *tile, const int64_t nsb,
                                                               const int8_t *xq, const int64_t K, const float *xd,
                                                               const int16_t *b16, vf_t out[PACKED_MR][2]) {
    const int NV = 16 / VL;
    vf_t acc[PACKED_MR][2]; /* in registers: accumulating in out (a pointer, aliased by the byte loads) was slower */
    SET_RV(acc, R, NV, VF_ZERO());
    const vi_t lo4 = VI_SET1(0x0f0f0f0f);
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *o = tile + sb * PACK6_SB_BYTES;
        vi_t S[PACKED_MR][2];
        SET_RV(S, R, NV, VI_ZERO());
        const int8_t *x = xq + sb * 256;
        for (int s = 0; s < 8; s++) { /* groups s (values 16s ..) and 8 + s (128 + 16s ..) */
            vi_t Il[PACKED_MR][2], Ih[PACKED_MR][2], hl[2], hh[2];
            SET_RV(Il, R, NV, VI_ZERO());
            SET_RV(Ih, R, NV, VI_ZERO());
            for (int v = 0; v < NV; v++) {
                hl[v] = VI_LOAD(o + P6_QH + 64 * s + 4 * VL * v);
                hh[v] = VI_LOAD(o + P6_QH + 64 * (8 + s) + 4 * VL * v);
            }
#pragma GCC unroll 4
            for (int f = 0; f < 4; f++) {
                const int g = 4 * s + f;
                prefetch_spread(o, PACK6_SB_BYTES, 8192, g);
                vi_t wl[2], wh[2];
                for (int v = 0; v < NV; v++) {
                    const vi_t q = VI_LOAD(o + 64 * g + 4 * VL * v);
                    wl[v] = VI_OR(VI_AND(q, lo4), q6_high(hl[v], f));
                    wh[v] = VI_OR(VI_AND(VI_SRLI16(q, 4), lo4), q6_high(hh[v], f));
                }
                for (int m = 0; m < R; m++) {
                    DP_BCAST(Il[m], wl, x + m * K + 4 * g, NV);
                    DP_BCAST(Ih[m], wh, x + m * K + 128 + 4 * g, NV);
                }
            }
            for (int v = 0; v < NV; v++) {
                const vi_t scl = VI_I8_32(o + P6_SC + 16 * s + VL * v), sch = VI_I8_32(o + P6_SC + 16 * (8 + s) + VL * v);
                for (int m = 0; m < R; m++)
                    S[m][v] = VI_ADD(S[m][v], VI_ADD(VI_MULLO(Il[m][v], scl), VI_MULLO(Ih[m][v], sch)));
            }
        }
        q6k_finish(R, NV, o, S, b16, K, sb, xd, nsb, acc);
    }
    COPY_RV(out, acc, R, NV);
}
#endif

#if GQ_AVX2
/* A packed Q4_K/Q5_K/Q6_K tile (16 rows, all superblocks) in gq_gemm.h's tile form, for prompt passes: their
 * GEMM shares each broadcast activation between two tiles and multiplies unpacked bytes, which the packed
 * kernel's nibble unpacking per activation row cannot match at hundreds of rows. */
static void expand_packed(int t, const uint8_t *pk, int64_t K, ktile *kt) {
    const int64_t nsb = K / 256;
    const vi_t lo4 = VI_SET1(0x0f0f0f0f);
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *o = pk + sb * packed_sb_bytes(t);
        uint8_t *T = kt->T + sb * 4096;
        for (int g = 0; g < 32; g++)
            for (int v = 0; v < 16 / VL; v++) {
                const vi_t q = VI_LOAD(o + 64 * g + 4 * VL * v);
                vi_t lo = VI_AND(q, lo4), hi = VI_AND(VI_SRLI16(q, 4), lo4);
                if (t == Q6_K) {
                    lo = VI_OR(lo, q6_high(VI_LOAD(o + P6_QH + 64 * (g / 4) + 4 * VL * v), g % 4));
                    hi = VI_OR(hi, q6_high(VI_LOAD(o + P6_QH + 64 * (8 + g / 4) + 4 * VL * v), g % 4));
                } else if (t == Q5_K) {
                    const vi_t h = VI_LOAD(o + P5_QH + 64 * (g / 4) + 4 * VL * v);
                    lo = with_bit(lo, h, g % 4, 4);
                    hi = with_bit(hi, h, 4 + g % 4, 4);
                }
                VI_STORE(T + 64 * g + 4 * VL * v, lo);
                VI_STORE(T + 64 * (32 + g) + 4 * VL * v, hi);
            }
        /* The scales, VL lanes at a time: a scalar loop over lanes and groups here took more time than the
         * values (a prompt pass's linears, `scripts/prefill_routes.py`). */
        for (int v = 0; v < 16 / VL; v++) {
            for (int j = 0; j < 8; j++) { /* groups 2j and 2j + 1 of 16 values (Q4_K: sub-block j): sc of each, and
                                           * per lane the int16 pair (mn of group 2j, mn of group 2j + 1) */
                vi_t s0, s1, mn;
                if (t == Q6_K) { /* mn = 32 sc */
                    s0 = VI_I8_32(o + P6_SC + 32 * j + VL * v);
                    s1 = VI_I8_32(o + P6_SC + 32 * j + 16 + VL * v);
                    mn = VI_OR(VI_AND(VI_SLLI32(s0, 5), VI_SET1(0xffff)), VI_SLLI32(s1, 21));
                } else { /* sub-block j's min twice: the low (j even) or high (j odd) half of the tile's pairs */
                    s0 = s1 = VI_U8_32(o + PK_SC + 16 * j + VL * v);
                    const vi_t w = pairs16(o + PK_MN + 32 * (j / 2) + 2 * VL * v, 0);
                    mn = j % 2 ? VI_OR(VI_AND(w, VI_SET1((int)0xffff0000)), VI_AND(VI_SRAI16(w), VI_SET1(0xffff)))
                               : VI_OR(VI_AND(w, VI_SET1(0xffff)), VI_SLLI16(w));
                }
                VI_STORE(kt->SC + (sb * 16 + 2 * j) * 16 + VL * v, s0);
                VI_STORE(kt->SC + (sb * 16 + 2 * j + 1) * 16 + VL * v, s1);
                VI_STORE(kt->MN + ((sb * 8 + j) * 16 + VL * v) * 2, mn);
            }
            const vf_t D = t == Q6_K ? VF_LOAD((const float *)(o + P6_D) + VL * v) : VF_F16(o + PK_D + 2 * VL * v);
            VF_STORE(kt->D + sb * 16 + VL * v, D);
            VF_STORE(kt->DM + sb * 16 + VL * v, t == Q6_K ? D : VF_F16(o + PK_DM + 2 * VL * v));
        }
    }
}
#endif

#include "gq_pack_k.h" /* their rows repacked into these tiles, at load */
#include "gq_packed8.h" /* the 256-bit builds' passes of 5..8 rows over these tiles */
#include "gq_packed_i16.h" /* Q4_K's passes on AVX2 without VNNI */

#endif /* SPECULANT_GQ_PACKED_H */
