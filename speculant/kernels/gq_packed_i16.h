/* Passes of activation rows over packed Q4_K tiles, one nibble half at a time: 1..6 rows on the 256-bit builds (AVX2;
 * AVX-VNNI from 3 rows), 5..8 on AVX-512. Part of gq.c, included at the end of gq_packed.h (its layouts, canonical forms
 * and helpers).
 *
 * Why a kernel of its own: without VNNI each 32 products are one vpmaddubsw, and their int16 pair sums add with
 * vpaddw (u < 16, |x| <= 127: a pair <= 3810, a sub-block's 8 groups <= 30480 < 32767; vpmaddubsw never saturates),
 * so a row needs two instructions per 32 products. gq_packed.h's loop keeps both nibble halves' sums live (4 chains a
 * row), and gcc, free to reassociate integer adds, summed the products of neighbouring groups first: passes of 2-4
 * rows spilled their sums, and an extra row cost about twice what its instructions need (`scripts/row_cost.py`;
 * docs/measurements.md, issue 49). Here a pass keeps one nibble half live at a time (2 chains a row; each weight
 * vector is loaded once per half, from L1), and each multiply-add is one asm pair (maddubs_add), so every sum stays
 * one chain in a register for up to 6 rows. AVX-VNNI's vpdpbusd sums a sub-block in int32 lanes, widened by vpmulld
 * with its scale; there the same one-half-at-a-time loop beat gq_packed.h's passes from 3 rows on in a model's
 * forward but not at 2, so 1-2 rows keep packed_rows (`scripts/kernel_ab.py`; docs/measurements.md, issue 49). On
 * AVX-512 gq_packed.h's passes keep 4 registers a row (both halves' chains, S, acc): from 5 rows they no longer fit the
 * 32, and one half at a time (3 a row) made passes of 5..8 rows cheaper (`scripts/kernel_ab.py --types Q4_K`).
 *
 * The integers are gq_packed.h's exact S and Mn, summed in another order (exact: the same integers), and the float
 * work per (superblock, row, lane) is the same two fused multiply-adds in superblock order, so a row's bits do not
 * depend on the pass or the build (tests/test_gguf_kernels.py runs 1..32 rows on every build). */
#ifndef SPECULANT_GQ_PACKED_I16_H
#define SPECULANT_GQ_PACKED_I16_H

#if GQ_AVX2
#define PK_Q4K_HALF 1
/* AVX-512: 5..8 rows (1..4 keep packed_rows); the 256-bit builds: 1..6 rows (8: 4 + 4) */
#define PACKED_I16_MR (GQ_512 ? 8 : 6)

#if GQ_VNNI /* a sub-block's sums in int32 lanes (vpdpbusd), widened by its scale with vpmulld */
#define Q4K_DP(a, w, x) VDP_U8(a, w, x)
#define Q4K_SCALES(s) (s)
#define Q4K_WIDEN(I, s) VI_MULLO(I, s)
#else
/* a + vpmaddubsw(w, x): one instruction pair the compiler cannot reorder into a tree of sums */
static inline __attribute__((always_inline)) vi_t maddubs_add(vi_t a, vi_t w, vi_t x) {
    vi_t t;
    __asm__("vpmaddubsw %[x], %[w], %[t]\n\tvpaddw %[t], %[a], %[a]" : [a] "+x"(a), [t] "=&x"(t) : [w] "x"(w), [x] "x"(x));
    return a;
}
#define Q4K_DP(a, w, x) maddubs_add(a, w, x)
#define Q4K_SCALES(s) i16_scales(s)
#define Q4K_WIDEN(I, s) _mm256_madd_epi16(I, s)
#endif

/* out[m][v] for R (1..6; AVX-512 5..8) activation rows of a Q4_K tile: packed_rows' arguments (q5 = 0) */
static inline __attribute__((always_inline)) void packed_i16_rows(const int R, const uint8_t *tile, const int64_t nsb,
                                                                  const int8_t *xq, const int64_t K, const float *xd,
                                                                  const int16_t *b32, vf_t out[][2]) {
    const int NV = 16 / VL;
    vf_t acc[PACKED_I16_MR][2];
    SET_RV(acc, R, NV, VF_ZERO());
    const vi_t lo4 = VI_SET1(0x0f0f0f0f);
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *o = tile + sb * PACK_SB_BYTES;
        const int8_t *x = xq + sb * 256;
        vi_t S[PACKED_I16_MR][2];
        SET_RV(S, R, NV, VI_ZERO());
        for (int j = 0; j < 4; j++) {
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) { /* sub-block j + 4h: the low (h = 0) or high nibbles of groups 8j .. 8j + 7 */
                vi_t I[PACKED_I16_MR][2];
                SET_RV(I, R, NV, VI_ZERO());
                /* each half loads the weight vectors anew: kept from the first half, they spilled */
                __asm__ volatile("" ::: "memory");
#pragma GCC unroll 8
                for (int gg = 0; gg < 8; gg++) {
                    const int g = 8 * j + gg;
                    if (!h) prefetch_spread(o, PACK_SB_BYTES, 4096, g);
                    vi_t w[2];
                    for (int v = 0; v < NV; v++) {
                        const vi_t q = VI_LOAD(o + 64 * g + 4 * VL * v);
                        w[v] = VI_AND(h ? VI_SRLI16(q, 4) : q, lo4);
                    }
                    for (int m = 0; m < R; m++) {
#if GQ_512 /* the broadcast as vpdpbusd's memory operand */
                        DP_BCAST(I[m], w, x + m * K + 128 * h + 4 * g, NV);
#else
                        const vi_t xb = bcast4(x + m * K + 128 * h + 4 * g);
                        for (int v = 0; v < NV; v++) I[m][v] = Q4K_DP(I[m][v], w[v], xb);
#endif
                    }
                }
                for (int v = 0; v < NV; v++) {
                    const vi_t sc = Q4K_SCALES(VI_U8_32(o + PK_SC + 16 * (j + 4 * h) + VL * v));
                    for (int m = 0; m < R; m++) S[m][v] = VI_ADD(S[m][v], Q4K_WIDEN(I[m][v], sc));
                }
            }
        }
        q4k_finish(R, NV, o, S, b32, K, sb, xd, nsb, acc);
    }
    COPY_RV(out, acc, R, NV);
}

/* Q4_K's passes of mc rows, out of line: inlined into packed_tile's row switch, their bodies changed gcc's code for the
 * other types' passes there (`scripts/kernel_ab.py --types Q5_0`; docs/measurements.md, issue 49). The 256-bit builds
 * take 1..6 rows here (AVX-VNNI's 1-2: packed_rows), AVX-512 5..8: its packed_rows keeps both nibble halves' chains, 4
 * registers a row, and from 5 rows they spilled (`scripts/row_cost.py --types Q4_K --rows 1 2 3 4 5 6 7 8`); its 1..4
 * rows stay inline in packed_tile. */
static __attribute__((noinline)) void packed_i16_pass(int64_t mc, const uint8_t *tile, const int64_t nsb,
                                                      const int8_t *xq, const int64_t K, const float *xd,
                                                      const int16_t *b32, vf_t out[][2]) {
    switch (mc) {
#if GQ_512
    case 5: packed_i16_rows(5, tile, nsb, xq, K, xd, b32, out); break;
    case 6: packed_i16_rows(6, tile, nsb, xq, K, xd, b32, out); break;
    case 7: packed_i16_rows(7, tile, nsb, xq, K, xd, b32, out); break;
    default: packed_i16_rows(8, tile, nsb, xq, K, xd, b32, out); break;
#else
#if GQ_VNNI
    case 1: packed_rows(1, 0, tile, nsb, xq, K, xd, b32, out); break;
    case 2: packed_rows(2, 0, tile, nsb, xq, K, xd, b32, out); break;
#else
    case 1: packed_i16_rows(1, tile, nsb, xq, K, xd, b32, out); break;
    case 2: packed_i16_rows(2, tile, nsb, xq, K, xd, b32, out); break;
#endif
    case 3: packed_i16_rows(3, tile, nsb, xq, K, xd, b32, out); break;
    case 4: packed_i16_rows(4, tile, nsb, xq, K, xd, b32, out); break;
    case 5: packed_i16_rows(5, tile, nsb, xq, K, xd, b32, out); break;
    default: packed_i16_rows(6, tile, nsb, xq, K, xd, b32, out); break;
#endif
    }
}
#else
#define PK_Q4K_HALF 0
#define PACKED_I16_MR PACKED_MR
#endif

#endif /* SPECULANT_GQ_PACKED_I16_H */
