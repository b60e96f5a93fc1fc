/* Prompt prefill of K-quant weights on AVX512-VNNI builds: an integer GEMM with one output per lane.
 * Part of gq.c, included once into its one translation unit.
 *
 * Short passes (decoding, verification) keep gq_matmul's canonical 16 lanes per output, which make a row's
 * output the same bits alone or with drafted rows. A prompt's pass has hundreds of rows and no such
 * contract (it used to multiply bf16 roundings of the weights, gq_dequant_range), so here each of 16
 * outputs has a lane of its own: 16 weight rows are decoded into the canonical form (decode_row) and packed
 * so that one vpdpbusd multiplies 4 values of 16 outputs by 4 values of one activation row (broadcast).
 * Per superblock and activation row, the integers are exact, as in gq_matmul:
 *   S = sum over groups g of sc[g] * (sum of u * x over g),   Mn = sum over g of mn[g] * B[g]
 * and the float work is  acc = fma(S, d * dx, acc); acc = fnmadd(Mn, dmin * dx, acc)  in superblock order.
 * Against the bf16 route it reads the file's blocks as they are (no bf16 rounding of weights, activations or
 * outputs; activations quantized per 256 as the short passes and llama.cpp do) and does twice the
 * multiply-adds per instruction (vpdpbusd: 64 int8 products, vdpbf16ps: 32). */
#ifndef SPECULANT_GQ_GEMM_H
#define SPECULANT_GQ_GEMM_H

#include "gq_decode.h"

#if GQ_512
#define GEMM_MR 4 /* activation rows per pass over the packed tiles */

/* 16 weight rows of a K-quant, packed per superblock sb:
 *   T[sb][quad q][lane n] 4 bytes: u of values 4q .. 4q + 3 of row n
 *   SC[sb][g][n] int32: sc of group g (16 values);  MN[sb][j][n] 2 x int16: mn of groups 2j, 2j + 1
 *   D[sb][n], DM[sb][n]: d and dmin */
typedef struct {
    uint8_t *T;
    int32_t *SC;
    int16_t *MN;
    float *D, *DM;
} ktile;

#define KTILE_BYTES_PER_SB (4096 + 1024 + 1024 + 64 + 64)

static void ktile_at(ktile *kt, char *mem, int64_t nsb) { /* mem: 64-byte aligned, nsb * KTILE_BYTES_PER_SB */
    kt->T = (uint8_t *)mem;
    kt->SC = (int32_t *)(mem + nsb * 4096);
    kt->MN = (int16_t *)(mem + nsb * (4096 + 1024));
    kt->D = (float *)(mem + nsb * (4096 + 2048));
    kt->DM = kt->D + nsb * 16;
}

/* Decodes rows w, w + row_bytes, ... (16 of them) of type t through r and packs them into kt. */
static void pack_ktile(int t, const uint8_t *w, int64_t row_bytes, int64_t K, drow *r, ktile *kt) {
    const int64_t nsb = K / 256;
    for (int n = 0; n < 16; n++) {
        decode_row(t, w + n * row_bytes, K, r);
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *u = r->u + sb * 256;
            uint8_t *T = kt->T + sb * 4096 + 4 * n;
            for (int q = 0; q < 64; q++) memcpy(T + 64 * q, u + 4 * q, 4);
            for (int g = 0; g < 16; g++) {
                kt->SC[(sb * 16 + g) * 16 + n] = r->sce[sb * 128 + g * 8];
                kt->MN[((sb * 8 + g / 2) * 16 + n) * 2 + (g & 1)] = r->mn[sb * 16 + g];
            }
            kt->D[sb * 16 + n] = r->d[sb];
            kt->DM[sb * 16 + n] = r->dm[sb];
        }
    }
}

static inline __m512i bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* out[m][v] (16 outputs of tile v < NV) for R activation rows: xq [R][K] int8, xd [R][nsb], xb [R][K / 16].
 * R x NV independent vpdpbusd chains (8 at R = 4, NV = 2: a chain of one would wait on the instruction's
 * latency), and every broadcast activation feeds NV tiles. GS groups share a scale (2 for Q4_K/Q5_K, whose
 * scales are per 32 values: half the integer multiplies). */
static inline __attribute__((always_inline)) void gemm_k_rows(const int R, const int NV, const int GS,
                                                              const ktile *kt, const int64_t nsb, const int8_t *xq,
                                                              const int64_t K, const float *xd, const int16_t *xb,
                                                              __m512 out[GEMM_MR][2]) {
    __m512 acc[GEMM_MR][2];
    for (int m = 0; m < R; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        __m512i S[GEMM_MR][2];
        for (int m = 0; m < R; m++)
            for (int v = 0; v < NV; v++) S[m][v] = _mm512_setzero_si512();
        const int8_t *x = xq + sb * 256;
        for (int g = 0; g < 16; g += GS) {
            __m512i I[GEMM_MR][2];
            for (int m = 0; m < R; m++)
                for (int v = 0; v < NV; v++) I[m][v] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int qq = 0; qq < 4 * GS; qq++) {
                const int q = 4 * g + qq;
                __m512i w[2];
                for (int v = 0; v < NV; v++) w[v] = _mm512_load_si512((const void *)(kt[v].T + sb * 4096 + 64 * q));
                for (int m = 0; m < R; m++) {
                    const __m512i xv = bcast4(x + m * K + 4 * q);
                    for (int v = 0; v < NV; v++) I[m][v] = _mm512_dpbusd_epi32(I[m][v], w[v], xv);
                }
            }
            for (int v = 0; v < NV; v++) {
                const __m512i sc = _mm512_load_si512((const void *)(kt[v].SC + (sb * 16 + g) * 16));
                for (int m = 0; m < R; m++) S[m][v] = _mm512_add_epi32(S[m][v], _mm512_mullo_epi32(I[m][v], sc));
            }
        }
        __m512i Mn[GEMM_MR][2];
        for (int m = 0; m < R; m++)
            for (int v = 0; v < NV; v++) Mn[m][v] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            __m512i mn[2];
            for (int v = 0; v < NV; v++) mn[v] = _mm512_load_si512((const void *)(kt[v].MN + (sb * 8 + j) * 32));
            for (int m = 0; m < R; m++) {
                const __m512i b = bcast4(xb + m * (K / 16) + sb * 16 + 2 * j);
                for (int v = 0; v < NV; v++) Mn[m][v] = _mm512_dpwssd_epi32(Mn[m][v], mn[v], b);
            }
        }
        for (int v = 0; v < NV; v++) {
            const __m512 D = _mm512_load_ps(kt[v].D + sb * 16), DM = _mm512_load_ps(kt[v].DM + sb * 16);
            for (int m = 0; m < R; m++) {
                const __m512 dx = _mm512_set1_ps(xd[m * nsb + sb]);
                acc[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[m][v]), _mm512_mul_ps(D, dx), acc[m][v]);
                acc[m][v] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(Mn[m][v]), _mm512_mul_ps(DM, dx), acc[m][v]);
            }
        }
    }
    for (int m = 0; m < R; m++)
        for (int v = 0; v < NV; v++) out[m][v] = acc[m][v];
}

/* All M rows against NV packed tiles of 16 outputs; y row-major [M, N]; cols[16 v + n]: the output column of
 * lane n of tile v; contiguous: cols[0] .. cols[0] + 16 NV - 1 in order. */
static void gemm_k_tile(int t, int NV, const ktile *kt, int64_t nsb, int64_t M, const int8_t *xq, int64_t K,
                        const float *xd, const int16_t *xb, const float *bias, const int64_t *cols, int contiguous,
                        float *y, int64_t N) {
    const int gs = (t == Q4_K || t == Q5_K) ? 2 : 1;
    __m512 b[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    if (bias) {
        float bv[32];
        for (int n = 0; n < 16 * NV; n++) bv[n] = bias[cols[n]];
        for (int v = 0; v < NV; v++) b[v] = _mm512_loadu_ps(bv + 16 * v);
    }
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_MR) {
        const int mc = (int)(M - m0 < GEMM_MR ? M - m0 : GEMM_MR);
        __m512 out[GEMM_MR][2];
        const int8_t *x = xq + m0 * K;
        const float *d = xd + m0 * nsb;
        const int16_t *s = xb + m0 * (K / 16);
#define GEMM_GS(R, V) if (gs == 2) gemm_k_rows(R, V, 2, kt, nsb, x, K, d, s, out); else gemm_k_rows(R, V, 1, kt, nsb, x, K, d, s, out);
#define GEMM_CASE(R) if (NV == 2) { GEMM_GS(R, 2) } else { GEMM_GS(R, 1) }
        switch (mc) {
        case 1: GEMM_CASE(1); break;
        case 2: GEMM_CASE(2); break;
        case 3: GEMM_CASE(3); break;
        default: GEMM_CASE(4); break;
        }
#undef GEMM_CASE
#undef GEMM_GS
        for (int m = 0; m < mc; m++) {
            float *yr = y + (m0 + m) * N;
            for (int v = 0; v < NV; v++) {
                const __m512 o = _mm512_add_ps(out[m][v], b[v]);
                if (contiguous) {
                    _mm512_storeu_ps(yr + cols[0] + 16 * v, o);
                } else {
                    float f[16];
                    _mm512_storeu_ps(f, o);
                    for (int n = 0; n < 16; n++) yr[cols[16 * v + n]] = f[n];
                }
            }
        }
    }
}
#endif /* GQ_512 */

#endif /* SPECULANT_GQ_GEMM_H */
