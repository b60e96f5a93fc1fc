/* Q2_K and Q3_K repacked at load: 16 weight rows per tile, one output per lane, as gq_packed.h does for Q4_K.
 * Part of gq.c, included once into its one translation unit, after gq_packed.h (with_bit, the tile sizes).
 *
 * Read in the file's layout, these rows were decoded value by value into bytes before every dot product, an order
 * of magnitude slower than llama.cpp on the same files (`speculant bench speed`; docs/measurements.md "Kernel
 * choices"). Repacked, the values stay 2-bit fields (and Q3_K's third bit a plane of
 * its own), so a tile reads about the file's bytes: 1344 bytes per superblock of 16 rows as the file's (Q2_K),
 * 1824 against 1760 (Q3_K).
 *
 * Layout per superblock (packed_sb_bytes):
 *   qs[16 quads g][16 lanes][4 bytes]: byte i of lane n holds u of value 64c + 4g + i at bits 2c .. 2c + 1 (c = 0..3);
 *   Q3_K: h[8][16 lanes][4 bytes] at P3_H: byte i of word g / 2 holds u's bit 2 of value 64c + 4g + i at bit
 *   4 (g % 2) + c;
 *   sc[8 pairs p][16 lanes][2 bytes] at P2_SC / P3_SC: the bytes of groups 2p and 2p + 1 (16 values each): Q3_K its
 *   scale (int8), Q2_K the file's byte (scale | min << 4);
 *   d[16] fp16, then (Q2_K) dmin[16] fp16, the file's.
 * Group h (values 16h .. 16h + 15) is quads 4(h % 4) .. 4(h % 4) + 3 of field c = h / 4.
 *
 * Canonical form, as Q6_K's: per superblock the exact S = sum over groups of sc * (sum of u*x) and Mn = sum over
 * groups of mn * B16 (Q3_K: u = q + 4, mn = 4 sc, dmin = d), then
 *   acc = fma(S, d * dx, acc); acc = fma(-Mn, dmin * dx, acc)   (superblock order; y = acc + bias). */
#ifndef SPECULANT_GQ_PACKED2_H
#define SPECULANT_GQ_PACKED2_H

static inline int packed2_sc_at(int q3) { return q3 ? P3_SC : P2_SC; }

/* Repacks rows 16i .. 16i + 15 of a Q2_K or Q3_K (type t) tensor w (row_bytes apart) for i in [t0, t1). */
static void pack_q23k_tiles(int t, const uint8_t *w, int64_t row_bytes, int64_t K, int64_t t0, int64_t t1,
                            uint8_t *out) {
    const int64_t nsb = K / 256, sbb = packed_sb_bytes(t), fb = block_bytes(t);
    const int q3 = t == Q3_K, sc_at = packed2_sc_at(q3), d_at = sc_at + 256;
    uint8_t u[256];
    int16_t sce[128], mn[16];
    float d, dm;
    drow r = {u, sce, mn, &d, &dm, NULL}; /* one superblock, decoded as the file-layout path decodes it */
    const int d_off = q3 ? 108 : 80; /* the file's fp16 d (Q2_K: then dmin) */
    for (int64_t ti = t0; ti < t1; ti++)
        for (int64_t sb = 0; sb < nsb; sb++) {
            uint8_t *o = out + (ti * nsb + sb) * sbb;
            memset(o, 0, (size_t)sbb);
            for (int n = 0; n < 16; n++) {
                const uint8_t *b = w + (16 * ti + n) * row_bytes + sb * fb;
                decode_k(t, b, &r, 0);
                for (int g = 0; g < 16; g++)
                    for (int i = 0; i < 4; i++)
                        for (int c = 0; c < 4; c++) {
                            const int v = u[64 * c + 4 * g + i];
                            o[64 * g + 4 * n + i] |= (uint8_t)((v & 3) << (2 * c));
                            if (q3) o[P3_H + 64 * (g / 2) + 4 * n + i] |= (uint8_t)((v >> 2) << (4 * (g % 2) + c));
                        }
                for (int h = 0; h < 16; h++) /* sce: the group's scale per pair of values */
                    o[sc_at + 32 * (h / 2) + 2 * n + h % 2] = q3 ? (uint8_t)(int8_t)sce[8 * h]
                                                                 : (uint8_t)(sce[8 * h] | (mn[h] << 4));
                memcpy(o + d_at + 2 * n, b + d_off, 2);
                if (!q3) memcpy(o + d_at + 32 + 2 * n, b + d_off + 2, 2);
            }
        }
}

#if GQ_AVX2
/* The scale bytes of pair p as int16 pairs, one per lane (lanes VL v ..): Q3_K's signed, Q2_K's unsigned */
static inline vi_t sc_pairs(int q3, const uint8_t *o, int p, int v) {
    return pairs16(o + packed2_sc_at(q3) + 32 * p + 2 * VL * v, q3);
}

/* The scale of group 2p + half per lane as int32, from sc_pairs */
static inline vi_t pair_scale(int q3, vi_t P, int half) {
    if (q3) return half ? VI_SRAI16(P) : VI_SRAI16(VI_SLLI16(P));
    return VI_AND(half ? VI_SRLI32(P, 16) : P, VI_SET1(15));
}

/* The mins of groups 2p, 2p + 1 as int16 pairs (Q3_K: sc, times 4 after the sum), from sc_pairs */
static inline vi_t pair_mins(int q3, vi_t P) { return q3 ? P : VI_SRLI16(P, 4); }

/* u of values 64c + 4g + i (quad g's word q, Q3_K's third-bit word h) */
static inline vi_t field_u(int q3, vi_t q, vi_t h, int g, int c) {
    const vi_t u = VI_AND(c ? VI_SRLI16(q, 2 * c) : q, VI_SET1(0x03030303));
    return q3 ? with_bit(u, h, 4 * (g % 2) + c, 2) : u;
}

/* out[m][v] (lanes VL v .. of the tile) for R activation rows: xq [R][K], xd [R][nsb], b16 [R][K / 16]. */
static inline __attribute__((always_inline)) void packed2_rows(const int R, const int q3, const uint8_t *tile,
                                                               const int64_t nsb, const int8_t *xq, const int64_t K,
                                                               const float *xd, const int16_t *b16,
                                                               vf_t out[PACKED_MR][2]) {
    const int NV = 16 / VL;
    vf_t acc[PACKED_MR][2]; /* in registers, as packed_rows */
    SET_RV(acc, R, NV, VF_ZERO());
    const int64_t sbb = q3 ? PACK3_SB_BYTES : PACK2_SB_BYTES;
    const int d_at = packed2_sc_at(q3) + 256;
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *o = tile + sb * sbb;
        prefetch_tile(o, sbb, 4096);
        vi_t S[PACKED_MR][2];
        SET_RV(S, R, NV, VI_ZERO());
        const int8_t *x = xq + sb * 256;
        for (int s = 0; s < 4; s++) { /* quads 4s .. 4s + 3: group 4c + s of each field c */
            vi_t q[4][2], h[2][2];
            for (int v = 0; v < NV; v++) {
                for (int j = 0; j < 4; j++) q[j][v] = VI_LOAD(o + 64 * (4 * s + j) + 4 * VL * v);
                for (int j = 0; j < 2; j++) h[j][v] = q3 ? VI_LOAD(o + P3_H + 64 * (2 * s + j) + 4 * VL * v) : q[j][v];
            }
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                vi_t I[PACKED_MR][2];
                SET_RV(I, R, NV, VI_ZERO());
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    vi_t wv[2];
                    for (int v = 0; v < NV; v++) wv[v] = field_u(q3, q[j][v], h[j / 2][v], j, c);
                    for (int m = 0; m < R; m++) DP_BCAST(I[m], wv, x + m * K + 64 * c + 4 * (4 * s + j), NV);
                }
                for (int v = 0; v < NV; v++) { /* group 4c + s: pair 2c + s / 2, half s % 2 */
                    const vi_t sc = pair_scale(q3, sc_pairs(q3, o, 2 * c + s / 2, v), s % 2);
                    for (int m = 0; m < R; m++) S[m][v] = VI_ADD(S[m][v], VI_MULLO(I[m][v], sc));
                }
            }
        }
        for (int v = 0; v < NV; v++) {
            vi_t Mn[PACKED_MR];
            for (int m = 0; m < R; m++) Mn[m] = VI_ZERO();
            for (int p = 0; p < 8; p++) {
                const vi_t mn = pair_mins(q3, sc_pairs(q3, o, p, v));
                for (int m = 0; m < R; m++) Mn[m] = VDP_I16(Mn[m], mn, bcast4(b16 + m * (K / 16) + sb * 16 + 2 * p));
            }
            const vf_t D = VF_F16(o + d_at + 2 * VL * v);
            const vf_t DM = q3 ? D : VF_F16(o + d_at + 32 + 2 * VL * v);
            for (int m = 0; m < R; m++) {
                const vf_t dx = VF_SET1(xd[m * nsb + sb]);
                acc[m][v] = VF_FMA(VF_CVT(S[m][v]), VF_MUL(D, dx), acc[m][v]);
                acc[m][v] = VF_FNMA(VF_CVT(q3 ? VI_SLLI32(Mn[m], 2) : Mn[m]), VF_MUL(DM, dx), acc[m][v]);
            }
        }
    }
    COPY_RV(out, acc, R, NV);
}

/* A packed Q2_K/Q3_K tile in gq_gemm.h's tile form (as expand_packed), for prompt passes */
static void expand_packed2(int t, const uint8_t *pk, int64_t K, ktile *kt) {
    const int q3 = t == Q3_K;
    const int64_t nsb = K / 256, sbb = packed_sb_bytes(t);
    const int d_at = packed2_sc_at(q3) + 256;
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *o = pk + sb * sbb;
        uint8_t *T = kt->T + sb * 4096;
        for (int g = 0; g < 16; g++)
            for (int v = 0; v < 16 / VL; v++) {
                const vi_t q = VI_LOAD(o + 64 * g + 4 * VL * v);
                const vi_t h = q3 ? VI_LOAD(o + P3_H + 64 * (g / 2) + 4 * VL * v) : q;
                for (int c = 0; c < 4; c++) VI_STORE(T + 64 * (16 * c + g) + 4 * VL * v, field_u(q3, q, h, g, c));
            }
        for (int v = 0; v < 16 / VL; v++) {
            for (int p = 0; p < 8; p++) {
                const vi_t P = sc_pairs(q3, o, p, v);
                VI_STORE(kt->SC + (sb * 16 + 2 * p) * 16 + VL * v, pair_scale(q3, P, 0));
                VI_STORE(kt->SC + (sb * 16 + 2 * p + 1) * 16 + VL * v, pair_scale(q3, P, 1));
                VI_STORE(kt->MN + ((sb * 8 + p) * 16 + VL * v) * 2, q3 ? VI_SLLI16B(P, 2) : pair_mins(q3, P));
            }
            const vf_t D = VF_F16(o + d_at + 2 * VL * v);
            VF_STORE(kt->D + sb * 16 + VL * v, D);
            VF_STORE(kt->DM + sb * 16 + VL * v, q3 ? D : VF_F16(o + d_at + 32 + 2 * VL * v));
        }
    }
}
#endif

/* One output (lane n, activation row m) of a packed Q2_K/Q3_K superblock o, for the portable lane loop
 * (packedk_tile_c): the exact S and Mn, d and dmin. */
static void packed2_sb_c(int q3, const uint8_t *o, int n, const int8_t *x, const int16_t *b16, int32_t *S,
                         int32_t *Mn, float *d, float *dm) {
    const int sc_at = packed2_sc_at(q3);
    *S = *Mn = 0;
    for (int h = 0; h < 16; h++) {
        int32_t I = 0;
        for (int e = 16 * h; e < 16 * h + 16; e++) {
            const int c = e / 64, g = (e % 64) / 4, i = e % 4;
            int u = (o[64 * g + 4 * n + i] >> (2 * c)) & 3;
            if (q3) u |= ((o[P3_H + 64 * (g / 2) + 4 * n + i] >> (4 * (g % 2) + c)) & 1) << 2;
            I += u * x[e];
        }
        const uint8_t b = o[sc_at + 32 * (h / 2) + 2 * n + h % 2];
        const int32_t sc = q3 ? (int8_t)b : b & 15;
        *S += sc * I;
        *Mn += (q3 ? sc : b >> 4) * b16[h];
    }
    if (q3) *Mn *= 4;
    *d = rdh(o + sc_at + 256 + 2 * n);
    *dm = q3 ? *d : rdh(o + sc_at + 288 + 2 * n);
}

/* packed_tile's portable lane loop for the packed K-quants (Q2_K .. Q6_K, gq_packed.h's layouts and this file's):
 * the canonical form, one lane at a time. Here rather than in gq_packed.h so that the headers include one way:
 * this file builds on gq_packed.h, never the reverse. */
static void packedk_tile_c(int t, const uint8_t *tile, int64_t M, const xquant *X, int64_t K, const float *bias,
                           const int64_t cols[16], float *y, int64_t N) {
    const int64_t nsb = K / 256;
    const int8_t *xq = X->qk;
    const float *xd = X->dk;
    const int16_t *b16 = X->bk, *b32 = X->b32k;
    const int sbb = (int)packed_sb_bytes(t);
    for (int64_t m = 0; m < M; m++)
        for (int n = 0; n < 16; n++) {
            float acc = 0.0f;
            for (int64_t sb = 0; sb < nsb; sb++) {
                const uint8_t *o = tile + sb * sbb;
                const int8_t *x = xq + m * K + sb * 256;
                const float dx = xd[m * nsb + sb];
                int32_t S = 0, Mn = 0;
                float d, dm;
                if (t == Q2_K || t == Q3_K) {
                    packed2_sb_c(t == Q3_K, o, n, x, b16 + m * (K / 16) + sb * 16, &S, &Mn, &d, &dm);
                } else if (t == Q6_K) {
                    static const int field_shift[4] = {4, 6, 0, 2};
                    for (int g16 = 0; g16 < 16; g16++) { /* values 16 g16 .. 16 g16 + 15 */
                        int32_t I = 0;
                        for (int e = 16 * g16; e < 16 * g16 + 16; e++) {
                            const int hi = e >= 128, v = e % 128, g = v / 4, i = v % 4;
                            const uint8_t q = o[64 * g + 4 * n + i];
                            const uint8_t h = o[P6_QH + 64 * (8 * hi + g / 4) + 4 * n + i];
                            const int u = (hi ? q >> 4 : q & 15) | (((h >> field_shift[g % 4]) & 3) << 4);
                            I += u * x[e];
                        }
                        const int32_t sc = (int8_t)o[P6_SC + 16 * g16 + n];
                        S += sc * I;
                        Mn += sc * b16[m * (K / 16) + sb * 16 + g16];
                    }
                    Mn *= 32;
                    memcpy(&d, o + P6_D + 4 * n, 4);
                    dm = d;
                } else {
                    for (int j = 0; j < 8; j++) {
                        int32_t I = 0;
                        for (int g = 8 * (j % 4); g < 8 * (j % 4) + 8; g++)
                            for (int i = 0; i < 4; i++) {
                                const uint8_t q = o[64 * g + 4 * n + i];
                                int32_t u = j < 4 ? q & 15 : q >> 4;
                                if (t == Q5_K) /* P5_QH: bit g % 4 (low nibbles) or 4 + g % 4 (high) */
                                    u |= ((o[P5_QH + 64 * (g / 4) + 4 * n + i] >> ((j < 4 ? 0 : 4) + g % 4)) & 1) << 4;
                                I += u * x[(j < 4 ? 0 : 128) + 4 * g + i];
                            }
                        S += (int32_t)o[PK_SC + 16 * j + n] * I;
                    }
                    for (int j = 0; j < 8; j++) Mn += o[PK_MN + 32 * (j / 2) + 2 * n + j % 2] * b32[m * (K / 32) + sb * 8 + j];
                    d = rdh(o + PK_D + 2 * n);
                    dm = rdh(o + PK_DM + 2 * n);
                }
                acc = fmaf((float)S, d * dx, acc);
                acc = fmaf(-(float)Mn, dm * dx, acc);
            }
            y[m * N + cols[n]] = bias ? acc + bias[cols[n]] : acc;
        }
}

#endif /* SPECULANT_GQ_PACKED2_H */
