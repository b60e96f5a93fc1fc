/* The 32-block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) repacked at load: 16 weight rows per tile, one output per
 * lane, for every pass. Part of gq.c, included once into its one translation unit, after gq_packed.h.
 *
 * Why: the file's blocks make each output a horizontal reduction over 8 or 16 lanes with float work per block
 * pair, and the 0.5B draft's Q5_0 linears streamed at a third of the speed of the repacked Q4_K/Q6_K ones
 * (`scripts/linear_timing.py --model qwen2.5-coder-0.5b-instruct`). A tile keeps the
 * file's bytes per value (the same size as its 16 rows in the file), in pairs of blocks so that every pair
 * starts on a 64-byte line.
 *
 * Pair layout (PK32 offsets below; 16 lanes, lane n = row n of the tile), blocks h = 0, 1 of the pair:
 *   qs[h]: nibble types: [4 groups g][16 lanes][4 bytes], byte i of group g = the file's qs[4g + i] (low
 *          nibble: value 4g + i, high: value 16 + 4g + i); Q8_0: [8 groups][16][4], byte i = q of value 4g + i
 *   qh[h] (Q5_0, Q5_1): [16 lanes] uint32, bit 8i + g = the fifth bit of value 4g + i (g = 0..7), so that one
 *          shift and one mask put quad g's fifth bits at bit 4 of its bytes
 *   d[h]: [16] fp16;  m[h] (Q4_1, Q5_1): [16] fp16
 *
 * Canonical form of a packed output (n, m), the same in every build and for every row count: per block b in
 * order, the exact I = sum of q * x over the block (q the signed value: u - 8 for Q4_0, u - 16 for Q5_0, the
 * byte for Q8_0; u for Q4_1 and Q5_1), then
 *   acc = fma(I, d * dx, acc);  Q4_1, Q5_1 also: acc = fma(m, dx * sum(xq), acc)   (y = acc). */
#ifndef SPECULANT_GQ_PACKED32_H
#define SPECULANT_GQ_PACKED32_H

static inline int pk32_nib(int t) { return t != Q8_0; }
static inline int pk32_high(int t) { return t == Q5_0 || t == Q5_1; }
static inline int pk32_min(int t) { return t == Q4_1 || t == Q5_1; }
static inline int pk32_qs(int t) { return pk32_nib(t) ? 256 : 512; } /* bytes of one block's qs */
static inline int pk32_d(int t) { return 2 * pk32_qs(t) + 128 * pk32_high(t); } /* offset of d[0] in a pair */
static inline int64_t pk32_pair_bytes(int t) { return pk32_d(t) + 64 + 64 * pk32_min(t); }
static inline int pk32_offset(int t) { return t == Q8_0 ? 0 : t == Q5_0 ? 16 : t == Q4_0 ? 8 : 0; } /* u - q */

/* Repacks rows 16t .. 16t + 15 of a 32-block tensor w (row_bytes apart; K a multiple of 64) for t in [t0, t1). */
static void pack_32_tiles(int t, const uint8_t *w, int64_t row_bytes, int64_t K, int64_t t0, int64_t t1,
                          uint8_t *out) {
    const int64_t np = K / 64, bb = block_bytes(t), pb = pk32_pair_bytes(t);
    const int qs = pk32_qs(t), at = t == Q8_0 ? 2 : nibbles_at(t), groups = pk32_nib(t) ? 4 : 8;
    for (int64_t tt = t0; tt < t1; tt++)
        for (int64_t p = 0; p < np; p++) {
            uint8_t *o = out + (tt * np + p) * pb;
            for (int n = 0; n < 16; n++)
                for (int h = 0; h < 2; h++) {
                    const uint8_t *b = w + (16 * tt + n) * row_bytes + (2 * p + h) * bb;
                    for (int g = 0; g < groups; g++) memcpy(o + h * qs + 64 * g + 4 * n, b + at + 4 * g, 4);
                    if (pk32_high(t)) {
                        uint32_t fh, ph = 0;
                        memcpy(&fh, b + at - 4, 4); /* bit j: value j's fifth bit */
                        for (int v = 0; v < 32; v++) ph |= ((fh >> v) & 1u) << (8 * (v % 4) + v / 4);
                        memcpy(o + 2 * qs + 64 * h + 4 * n, &ph, 4);
                    }
                    memcpy(o + pk32_d(t) + 32 * h + 2 * n, b, 2);
                    if (pk32_min(t)) memcpy(o + pk32_d(t) + 64 + 32 * h + 2 * n, b + 2, 2);
                }
        }
}

#if GQ_AVX2
#if GQ_512
#define VI_XOR(a, b) _mm512_xor_si512(a, b)
#else
#define VI_XOR(a, b) _mm256_xor_si256(a, b)
#endif
/* Q8_0's q times x: Q8_U(w) once per weight vector, then Q8_DP(I, w, p, NV) per activation row (as DP_BCAST) */
#if GQ_VNNI /* q + 128 (a flipped sign bit) times x, less 128 * sum(x) in the chain's start */
#define Q8_BIAS 128
#define Q8_U(w) VI_XOR(w, VI_SET1((int)0x80808080))
#define Q8_DP DP_BCAST
#else /* |q| times x with q's sign: vpmaddubsw's pair sums stay within 2 * 128 * 127 */
#define Q8_BIAS 0
#define Q8_U(w) (w)
#define Q8_DP(I, w, p, NV)                                                                                    \
    do {                                                                                                      \
        const vi_t x_ = bcast4(p);                                                                            \
        for (int v_ = 0; v_ < (NV); v_++)                                                                     \
            (I)[v_] = _mm256_add_epi32((I)[v_], _mm256_madd_epi16(_mm256_maddubs_epi16(                       \
                _mm256_sign_epi8((w)[v_], (w)[v_]), _mm256_sign_epi8(x_, (w)[v_])), _mm256_set1_epi16(1)));     \
    } while (0)
#endif

/* Group g (values 4g..4g+3 and 16+4g..) of a nibble type T's block at q: I[m] += u * x for the R rows of xq. */
static inline __attribute__((always_inline)) void nib_group(const int R, const int T, const uint8_t *q, const int g,
                                                            const vi_t hv[2], const vi_t lo4, const int8_t *x,
                                                            const int64_t K, vi_t I[PACKED_MR][2]) {
    const int NV = 16 / VL;
    vi_t wl[2], wh[2];
    for (int v = 0; v < NV; v++) {
        const vi_t w = VI_LOAD(q + 64 * g + 4 * VL * v);
        wl[v] = VI_AND(w, lo4);
        wh[v] = VI_AND(VI_SRLI16(w, 4), lo4);
        if (pk32_high(T)) {
            wl[v] = with_bit(wl[v], hv[v], g, 4);
            wh[v] = with_bit(wh[v], hv[v], g + 4, 4);
        }
    }
    for (int m = 0; m < R; m++) {
        DP_BCAST(I[m], wl, x + m * K + 4 * g, NV);
        DP_BCAST(I[m], wh, x + m * K + 16 + 4 * g, NV);
    }
}

/* out[m][v] (lanes VL v .. of the tile) for R activation rows of a 32-block type T (a constant at each call):
 * xq [R][K], xd and xs [R][nb] (d and d * sum per 32), bs [R][nb] (sum of xq per 32). */
static inline __attribute__((always_inline)) void packed32_rows(const int R, const int T, const uint8_t *tile,
                                                                const int64_t nb, const int8_t *xq, const int64_t K,
                                                                const float *xd, const float *xs, const int16_t *bs,
                                                                vf_t out[PACKED_MR][2]) {
    const int NV = 16 / VL, qs = pk32_qs(T), c = T == Q8_0 ? Q8_BIAS : pk32_offset(T);
    const int64_t pb = pk32_pair_bytes(T);
    vf_t acc[PACKED_MR][2]; /* in registers, as packed_rows */
    SET_RV(acc, R, NV, VF_ZERO());
    const vi_t lo4 = VI_SET1(0x0f0f0f0f);
    for (int64_t b = 0; b < nb; b++) {
        const int h = (int)(b & 1);
        const uint8_t *o = tile + (b / 2) * pb, *q = o + h * qs;
        if (!h)
            prefetch_tile(o, pb, 4096);
        const int8_t *x = xq + 32 * b;
        vi_t I[PACKED_MR][2];
        for (int m = 0; m < R; m++)
            for (int v = 0; v < NV; v++) I[m][v] = VI_SET1(-c * bs[m * nb + b]);
        if (pk32_nib(T)) {
            vi_t hv[2];
            if (pk32_high(T))
                for (int v = 0; v < NV; v++) hv[v] = VI_LOAD(o + 2 * qs + 64 * h + 4 * VL * v);
            /* How far the group loop unrolls is a register budget. AVX-512's 4-bit types keep the most rows
             * (PACKED_MR 8) and no fifth bits: unrolled by 4 they spilled, and a pass of 8 rows took longer than
             * one of 9; unrolled by 2 they do not (`scripts/linear_timing.py --rows 8`; Q5_0 and the 256-bit
             * builds were no better or worse by 2). */
            if (GQ_512 && !pk32_high(T)) {
#pragma GCC unroll 2
                for (int g = 0; g < 4; g++) nib_group(R, T, q, g, hv, lo4, x, K, I);
            } else {
#pragma GCC unroll 4
                for (int g = 0; g < 4; g++) nib_group(R, T, q, g, hv, lo4, x, K, I);
            }
        } else {
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                vi_t w[2];
                for (int v = 0; v < NV; v++) w[v] = Q8_U(VI_LOAD(q + 64 * g + 4 * VL * v));
                for (int m = 0; m < R; m++) Q8_DP(I[m], w, x + m * K + 4 * g, NV);
            }
        }
        for (int v = 0; v < NV; v++) {
            const vf_t D = VF_F16(o + pk32_d(T) + 32 * h + 2 * VL * v);
            for (int m = 0; m < R; m++) acc[m][v] = VF_FMA(VF_CVT(I[m][v]), VF_MUL(D, VF_SET1(xd[m * nb + b])), acc[m][v]);
            if (pk32_min(T)) {
                const vf_t Mv = VF_F16(o + pk32_d(T) + 64 + 32 * h + 2 * VL * v);
                for (int m = 0; m < R; m++) acc[m][v] = VF_FMA(Mv, VF_SET1(xs[m * nb + b]), acc[m][v]);
            }
        }
    }
    COPY_RV(out, acc, R, NV);
}

/* A packed 32-block tile in gq_gemm.h's tile form (u per value; D = d, DM = the coefficient o of the block's
 * sum of x), for prompt passes. */
static void expand_packed32(int t, const uint8_t *pk, int64_t K, ktile *kt) {
    const int64_t nb = K / 32;
    const int qs = pk32_qs(t);
    const vi_t lo4 = VI_SET1(0x0f0f0f0f);
    for (int64_t b = 0; b < nb; b++) {
        const int h = (int)(b & 1);
        const uint8_t *o = pk + (b / 2) * pk32_pair_bytes(t), *q = o + h * qs;
        uint8_t *T = kt->T + b * 512; /* quads 8b .. 8b + 7, 64 bytes each */
        for (int v = 0; v < 16 / VL; v++) {
            if (pk32_nib(t)) {
                const vi_t hv = pk32_high(t) ? VI_LOAD(o + 2 * qs + 64 * h + 4 * VL * v) : VI_ZERO();
                for (int g = 0; g < 4; g++) {
                    const vi_t w = VI_LOAD(q + 64 * g + 4 * VL * v);
                    vi_t lo = VI_AND(w, lo4), hi = VI_AND(VI_SRLI16(w, 4), lo4);
                    if (pk32_high(t)) {
                        lo = with_bit(lo, hv, g, 4);
                        hi = with_bit(hi, hv, g + 4, 4);
                    }
                    VI_STORE(T + 64 * g + 4 * VL * v, lo);
                    VI_STORE(T + 64 * (4 + g) + 4 * VL * v, hi);
                }
            } else { /* u = q + 128 */
                for (int g = 0; g < 8; g++)
                    VI_STORE(T + 64 * g + 4 * VL * v, VI_XOR(VI_LOAD(q + 64 * g + 4 * VL * v), VI_SET1((int)0x80808080)));
            }
            const vf_t D = VF_F16(o + pk32_d(t) + 32 * h + 2 * VL * v);
            const vf_t O = pk32_min(t) ? VF_F16(o + pk32_d(t) + 64 + 32 * h + 2 * VL * v)
                                       : VF_MUL(D, VF_SET1(-(float)(t == Q8_0 ? 128 : pk32_offset(t))));
            VF_STORE(kt->D + b * 16 + VL * v, D);
            VF_STORE(kt->DM + b * 16 + VL * v, O);
        }
    }
}
#endif /* GQ_AVX2 */

/* Value e (0..31) of block b, lane n, of a packed 32-block tile: q (the signed value of the canonical form) */
static inline int pk32_value(int t, const uint8_t *tile, int64_t b, int n, int e) {
    const int qs = pk32_qs(t);
    const uint8_t *o = tile + (b / 2) * pk32_pair_bytes(t), *q = o + (b & 1) * qs;
    if (!pk32_nib(t)) return (int8_t)q[64 * (e / 4) + 4 * n + e % 4];
    const uint8_t byte = q[64 * ((e % 16) / 4) + 4 * n + e % 4];
    int u = e < 16 ? byte & 15 : byte >> 4;
    if (pk32_high(t)) {
        uint32_t hv;
        memcpy(&hv, o + 2 * qs + 64 * (b & 1) + 4 * n, 4);
        u |= (int)((hv >> (8 * (e % 4) + e / 4)) & 1) << 4;
    }
    return u - pk32_offset(t);
}

/* packed_tile's portable lane loop for a 32-block type: the canonical form, one lane at a time. */
static void packed32_tile_c(int t, const uint8_t *tile, int64_t M, const xquant *X, int64_t K, const float *bias,
                            const int64_t cols[16], float *y, int64_t N) {
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; m++)
        for (int n = 0; n < 16; n++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *x = X->q32 + m * K + 32 * b;
                int32_t I = 0;
                for (int e = 0; e < 32; e++) I += pk32_value(t, tile, b, n, e) * x[e];
                const uint8_t *o = tile + (b / 2) * pk32_pair_bytes(t) + pk32_d(t) + 32 * (b & 1) + 2 * n;
                acc = fmaf((float)I, rdh(o) * X->d32[m * nb + b], acc);
                if (pk32_min(t)) acc = fmaf(rdh(o + 64), X->s32[m * nb + b], acc);
            }
            y[m * N + cols[n]] = bias ? acc + bias[cols[n]] : acc;
        }
}

/* y[m, cols[n]] (+ bias) for the 16 outputs of one packed tile of type t and all M rows, from the activations
 * X (K-quants: int8 rows, d per 256, sums per 16 and per 32; 32-blocks: d, d * sum and sum per 32);
 * contiguous: cols run cols[0] ... */
static void packed_tile(int t, const uint8_t *tile, int64_t M, const xquant *X, int64_t K, const float *bias,
                        const int64_t cols[16], int contiguous, float *y, int64_t N) {
    const int64_t nsb = K / 256, nb = K / 32;
#if GQ_AVX2
    for (int64_t m0 = 0, mc; m0 < M; m0 += mc) {
        /* rows spread evenly over the passes: 5 rows in passes of 4 as 3 + 2, not 4 + 1 (too few chains) */
        /* Q2_K/Q3_K: at most 5 rows a pass (their 16-value groups keep more accumulators live: 6 or more rows
         * spill, and one pass of 8 rows took longer than two of 4; `scripts/linear_timing.py --rows 8` on a
         * Q3_K_M file) */
        /* Q6_K on the 256-bit builds: up to 8 rows a pass (gq_packed8.h); Q4_K on them 6, on AVX-512 8 (gq_packed_i16.h) */
        const int64_t mr = (t == Q2_K || t == Q3_K) && PACKED_MR > 5 ? 5 : PACKED8 && t == Q6_K ? PACKED8_MR
                         : PK_Q4K_HALF && t == Q4_K ? PACKED_I16_MR : PACKED_MR;
        const int64_t passes = (M - m0 + mr - 1) / mr;
        mc = (M - m0 + passes - 1) / passes;
        vf_t out[PACKED8_MR][2];
        if (family(t) == FAM_32) {
            const int8_t *x = X->q32 + m0 * K;
            const float *d = X->d32 + m0 * nb, *s = X->s32 + m0 * nb;
            const int16_t *bs = X->bs32 + m0 * nb;
#define P32_CASE(R)                                                                                           \
    switch (t) {                                                                                              \
    case Q4_0: packed32_rows(R, Q4_0, tile, nb, x, K, d, s, bs, out); break;                                  \
    case Q4_1: packed32_rows(R, Q4_1, tile, nb, x, K, d, s, bs, out); break;                                  \
    case Q5_0: packed32_rows(R, Q5_0, tile, nb, x, K, d, s, bs, out); break;                                  \
    case Q5_1: packed32_rows(R, Q5_1, tile, nb, x, K, d, s, bs, out); break;                                  \
    default: packed32_rows(R, Q8_0, tile, nb, x, K, d, s, bs, out); break;                                    \
    }
            PACKED_SWITCH(mc, P32_CASE);
#undef P32_CASE
        } else {
            const int8_t *x = X->qk + m0 * K;
            const float *d = X->dk + m0 * nsb;
            const int16_t *s16 = X->bk + m0 * (K / 16), *s32 = X->b32k + m0 * (K / 32);
#if PACKED8 /* R > PACKED_MR: Q6_K only (mr above) */
#define PACKED_WIDE(R) packed8_6_rows(R, tile, nsb, x, K, d, s16, out);
#define PK_SWITCH ROW_SWITCH
#else
#define PACKED_WIDE(R)
#define PK_SWITCH PACKED_SWITCH
#endif
#if PK_Q4K_HALF && !GQ_512 /* Q4_K on the 256-bit builds: gq_packed_i16.h's passes (mr above), out of line */
#define PACKED_Q4K(R) packed_i16_pass(R, tile, nsb, x, K, d, s32, out);
#else
#define PACKED_Q4K(R) packed_rows(RN(R), 0, tile, nsb, x, K, d, s32, out);
#endif
#define RN(R) ((R) > PACKED_MR ? PACKED_MR : (R)) /* the narrow kernels' R (dead code above PACKED_MR) */
#if PACKED8 && GQ_VNNI /* Q6_K passes of 2..4 rows on AVX-VNNI: one nibble half at a time (gq_packed8.h) */
#define PACKED_Q6K(R)                                                                                         \
    if ((R) > 1) packed6_half_rows(RN(R), tile, nsb, x, K, d, s16, out);                                      \
    else packed6_rows(1, tile, nsb, x, K, d, s16, out);
#else
#define PACKED_Q6K(R) packed6_rows(RN(R), tile, nsb, x, K, d, s16, out);
#endif
#define PACKED_CASE(R)                                                                                        \
    if (PK_Q4K_HALF && !GQ_512 && t == Q4_K) { PACKED_Q4K(R) }                                                 \
    else if ((R) > PACKED_MR) { PACKED_WIDE(R) }                                                              \
    else if (t == Q6_K) { PACKED_Q6K(R) }                                                                     \
    else if (t == Q3_K) packed2_rows(RN(R), 1, tile, nsb, x, K, d, s16, out);                                 \
    else if (t == Q2_K) packed2_rows(RN(R), 0, tile, nsb, x, K, d, s16, out);                                 \
    else if (t == Q5_K) packed_rows(RN(R), 1, tile, nsb, x, K, d, s32, out);                                  \
    else { PACKED_Q4K(R) }
#if PK_Q4K_HALF && GQ_512 /* Q4_K passes of 5..8 rows on AVX-512: gq_packed_i16.h's, out of line, taken before the
                           * switch, whose cases stay as they were (a call inside them moved the 1..4-row passes' code) */
            if (t == Q4_K && mc > 4) packed_i16_pass(mc, tile, nsb, x, K, d, s32, out);
            else
#endif
            PK_SWITCH(mc, PACKED_CASE);
#undef RN
#undef PK_SWITCH
#undef PACKED_WIDE
#undef PACKED_Q4K
#undef PACKED_Q6K
#undef PACKED_CASE
        }
        store_rows(out, (int)mc, 1, bias, cols, contiguous, y + m0 * N, N);
    }
#else /* the same integers and float operations, one lane at a time */
    (void)contiguous;
    (void)nb;
    (void)nsb;
    if (family(t) == FAM_32) packed32_tile_c(t, tile, M, X, K, bias, cols, y, N);
    else packedk_tile_c(t, tile, M, X, K, bias, cols, y, N);
#endif
}

#if GQ_AVX2
/* Packed tile `tile` (any packed type) in gq_gemm.h's tile form, for prompt passes */
static void expand_tile(int t, const uint8_t *tile, int64_t K, ktile *kt) {
    if (family(t) == FAM_32) expand_packed32(t, tile, K, kt);
    else if (t == Q2_K || t == Q3_K) expand_packed2(t, tile, K, kt);
    else expand_packed(t, tile, K, kt);
}
#endif

/* Repacks tiles [t0, t1) of the rows w (type t, row_bytes apart) into out */
static void pack_tiles(int t, const uint8_t *w, int64_t row_bytes, int64_t K, int64_t t0, int64_t t1, uint8_t *out) {
    if (t == Q6_K) pack_q6k_tiles(w, row_bytes, K, t0, t1, out);
    else if (t == Q4_K || t == Q5_K) pack_q4k_tiles(t, w, row_bytes, K, t0, t1, out);
    else if (t == Q2_K || t == Q3_K) pack_q23k_tiles(t, w, row_bytes, K, t0, t1, out);
    else pack_32_tiles(t, w, row_bytes, K, t0, t1, out);
}

/* Whether n rows of K values of type t are repacked (whole tiles; pairs of 32-blocks or K-quant superblocks) */
static int packable(int t, int64_t n, int64_t K) {
    if (n <= 0 || n % 16) return 0;
    if (family(t) == FAM_K) return K % 256 == 0;
    return family(t) == FAM_32 && K % 64 == 0;
}

/* bytes of one packed tile (16 rows of K values) of type t */
static int64_t packed_tile_bytes(int t, int64_t K) {
    return family(t) == FAM_32 ? K / 64 * pk32_pair_bytes(t) : K / 256 * packed_sb_bytes(t);
}

#endif /* SPECULANT_GQ_PACKED32_H */
