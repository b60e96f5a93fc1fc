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

/* The activations of a pass, quantized as the parts' families need (gq.c's quantize_block): int8 rows [M][K];
 * per 32 values d, d * sum and sum (32-blocks); per 256 d and the sums of each 16 and of each 32 (K-quants). */
typedef struct {
    int8_t *q32, *qk;
    float *d32, *s32, *dk;
    int16_t *bs32, *bk, *b32k;
} xquant;

#if GQ_AVX2
/* The kernel is written once over a vector of VL lanes (one output each): 16 on AVX512-VNNI builds, 8 on
 * AVX-VNNI and AVX2 builds. A pass covers two vectors of outputs (two 16-row tiles, or one tile's two
 * halves) for GEMM_MR activation rows: GEMM_MR x 2 independent integer chains (a single chain would wait
 * on each multiply's latency), every broadcast activation feeding both. */
#if GQ_512
typedef __m512i vi_t;
typedef __m512 vf_t;
#define VL 16
#define VI_ZERO() _mm512_setzero_si512()
#define VF_ZERO() _mm512_setzero_ps()
#define VI_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define VF_LOAD(p) _mm512_loadu_ps(p)
#define VF_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p))) /* VL fp16 values, exact */
#define VI_SET1(v) _mm512_set1_epi32(v)
#define VF_SET1(v) _mm512_set1_ps(v)
#define VI_ADD(a, b) _mm512_add_epi32(a, b)
#define VI_MULLO(a, b) _mm512_mullo_epi32(a, b)
#define VDP_U8(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define VDP_I16(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#define VF_CVT(v) _mm512_cvtepi32_ps(v)
#define VF_MUL(a, b) _mm512_mul_ps(a, b)
#define VF_ADD(a, b) _mm512_add_ps(a, b)
#define VF_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VF_FNMA(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define VF_STORE(p, v) _mm512_storeu_ps(p, v)
#define VI_STORE(p, v) _mm512_storeu_si512((void *)(p), v)
#define VI_GATHER(base, idx) _mm512_i32gather_epi32(idx, (const void *)(base), 1)
#define VF_GATHER(base, idx) _mm512_i32gather_ps(idx, (const void *)(base), 1)
#define VI_SLLI16(v) _mm512_slli_epi32(v, 16)
#define VI_SRAI16(v) _mm512_srai_epi32(v, 16)
#define VI_AND(a, b) _mm512_and_si512(a, b)
#define VI_SRLI16(v, n) _mm512_srli_epi16(v, n)
#define VI_U8_32(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VI_I8_32(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VI_OR(a, b) _mm512_or_si512(a, b)
#define VI_SLLI16B(v, n) _mm512_slli_epi16(v, n)
#define VI_SLLI32(v, n) _mm512_slli_epi32(v, n)
#define VI_SRLI32(v, n) _mm512_srli_epi32(v, n)
#define VI_UNPLO32(a, b) _mm512_unpacklo_epi32(a, b)
#define VI_UNPHI32(a, b) _mm512_unpackhi_epi32(a, b)
#define VI_UNPLO64(a, b) _mm512_unpacklo_epi64(a, b)
#define VI_UNPHI64(a, b) _mm512_unpackhi_epi64(a, b)
#else
typedef __m256i vi_t;
typedef __m256 vf_t;
#define VL 8
#define VI_ZERO() _mm256_setzero_si256()
#define VF_ZERO() _mm256_setzero_ps()
#define VI_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VF_LOAD(p) _mm256_loadu_ps(p)
#define VF_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p))) /* VL fp16 values, exact */
#define VI_SET1(v) _mm256_set1_epi32(v)
#define VF_SET1(v) _mm256_set1_ps(v)
#define VI_ADD(a, b) _mm256_add_epi32(a, b)
#define VI_MULLO(a, b) _mm256_mullo_epi32(a, b)
#if GQ_VNNI
#define VDP_U8(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#define VDP_I16(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#else /* u < 64, |x| <= 127: vpmaddubsw's pair sums fit int16 */
#define VDP_U8(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
#define VDP_I16(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif
#define VF_CVT(v) _mm256_cvtepi32_ps(v)
#define VF_MUL(a, b) _mm256_mul_ps(a, b)
#define VF_ADD(a, b) _mm256_add_ps(a, b)
#define VF_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VF_FNMA(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define VF_STORE(p, v) _mm256_storeu_ps(p, v)
#define VI_STORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define VI_GATHER(base, idx) _mm256_i32gather_epi32((const int *)(base), idx, 1)
#define VF_GATHER(base, idx) _mm256_i32gather_ps((const float *)(base), idx, 1)
#define VI_SLLI16(v) _mm256_slli_epi32(v, 16)
#define VI_SRAI16(v) _mm256_srai_epi32(v, 16)
#define VI_AND(a, b) _mm256_and_si256(a, b)
#define VI_SRLI16(v, n) _mm256_srli_epi16(v, n)
#define VI_U8_32(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VI_I8_32(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VI_OR(a, b) _mm256_or_si256(a, b)
#define VI_SLLI16B(v, n) _mm256_slli_epi16(v, n)
#define VI_SLLI32(v, n) _mm256_slli_epi32(v, n)
#define VI_SRLI32(v, n) _mm256_srli_epi32(v, n)
#define VI_UNPLO32(a, b) _mm256_unpacklo_epi32(a, b)
#define VI_UNPHI32(a, b) _mm256_unpackhi_epi32(a, b)
#define VI_UNPLO64(a, b) _mm256_unpacklo_epi64(a, b)
#define VI_UNPHI64(a, b) _mm256_unpackhi_epi64(a, b)
#endif
#define TILES_PER_PASS (VL == 16 ? 2 : 1) /* 16-row tiles a pass covers */
/* activation rows per pass: 4 x 2 vectors = 8 chains. The 256-bit builds' 16 ymm registers hold them with
 * spills, still the fastest of 2, 3 and 4 rows (AVX-512: 6 or 8 rows no faster than 4); prompt passes,
 * `scripts/prefill_routes.py`, docs/measurements.md "Kernel choices" */
#define GEMM_MR 4

/* 16 weight rows, packed:
 *   T[quad q][lane n] 4 bytes: u of values 4q .. 4q + 3 of row n (q over the whole row)
 *   K-quants, per superblock sb: SC[sb][g][n] int32, sc of group g (16 values); MN[sb][j][n] 2 x int16, mn of
 *   groups 2j and 2j + 1; D[sb][n], DM[sb][n]: d and dmin
 *   32-blocks, per block b: D[b][n] d and DM[b][n] the coefficient o of the block's sum of x */
typedef struct {
    uint8_t *T;
    int32_t *SC;
    int16_t *MN;
    float *D, *DM;
} ktile;

#define KTILE_BYTES(K) (26 * (size_t)(K))

static void ktile_at(ktile *kt, char *mem, int64_t K) { /* mem: 64-byte aligned, KTILE_BYTES(K) */
    kt->T = (uint8_t *)mem;
    kt->SC = (int32_t *)(mem + 16 * K);
    kt->MN = (int16_t *)(mem + 20 * K);
    kt->D = (float *)(mem + 22 * K);
    kt->DM = (float *)(mem + 24 * K);
}

/* v[c] lane n = v[n] lane c (a VL x VL transpose of 32-bit lanes) */
static inline void transpose_lanes(vi_t v[VL]) {
    vi_t t[VL];
    for (int i = 0; i < VL; i += 2) {
        t[i] = VI_UNPLO32(v[i], v[i + 1]);
        t[i + 1] = VI_UNPHI32(v[i], v[i + 1]);
    }
    for (int i = 0; i < VL; i += 4) { /* v[4a + c], 128-bit lane L: rows 4a .. 4a + 3 of column 4L + c */
        v[i] = VI_UNPLO64(t[i], t[i + 2]);
        v[i + 1] = VI_UNPHI64(t[i], t[i + 2]);
        v[i + 2] = VI_UNPLO64(t[i + 1], t[i + 3]);
        v[i + 3] = VI_UNPHI64(t[i + 1], t[i + 3]);
    }
#if GQ_512
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(v[i + j], v[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(v[i + j], v[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        v[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        v[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
#else
    for (int c = 0; c < 4; c++) {
        t[c] = _mm256_permute2x128_si256(v[c], v[c + 4], 0x20);
        t[c + 4] = _mm256_permute2x128_si256(v[c], v[c + 4], 0x31);
    }
    for (int c = 0; c < 8; c++) v[c] = t[c];
#endif
}

/* Decodes rows w, w + row_bytes, ... (16 of them) of type t into r[0..15] (drows `stride` bytes apart, fields
 * at the same offsets) and packs them into kt: VL x VL transposes for the values, gathers for the rest. */
static void pack_tile(int t, const uint8_t *w, int64_t row_bytes, int64_t K, const drow *r, int64_t stride,
                      ktile *kt) {
    for (int n = 0; n < 16; n++) decode_row(t, w + n * row_bytes, K, (drow *)r + n);
    int32_t off[16];
    for (int n = 0; n < 16; n++) off[n] = (int32_t)(n * stride);
    for (int h = 0; h < 16 / VL; h++) { /* lanes VL h .. VL h + VL - 1 */
        const vi_t idx = VI_LOAD(off + VL * h);
        for (int64_t q0 = 0; q0 < K / 4; q0 += VL) { /* quads q0 .. q0 + VL - 1; K is a multiple of 32, so the
                                                        * last VL may reach 8 quads past the row (into its padding) */
            vi_t v[VL];
            for (int n = 0; n < VL; n++) v[n] = VI_LOAD(r->u + (VL * h + n) * stride + 4 * q0);
            transpose_lanes(v);
            const int nc = K / 4 - q0 < VL ? (int)(K / 4 - q0) : VL;
            for (int c = 0; c < nc; c++) VI_STORE(kt->T + 64 * (q0 + c) + 4 * VL * h, v[c]);
        }
        if (family(t) == FAM_32) {
            for (int64_t b = 0; b < K / 32; b++) {
                VF_STORE(kt->D + b * 16 + VL * h, VF_GATHER(r->d + b, idx));
                VF_STORE(kt->DM + b * 16 + VL * h, VF_GATHER(r->dm + b, idx));
            }
            continue;
        }
        for (int64_t sb = 0; sb < K / 256; sb++) {
            for (int g = 0; g < 16; g++) { /* sce[g * 8] (int16) widened to int32 */
                const vi_t v = VI_GATHER(r->sce + sb * 128 + g * 8, idx);
                VI_STORE(kt->SC + (sb * 16 + g) * 16 + VL * h, VI_SRAI16(VI_SLLI16(v)));
            }
            for (int j = 0; j < 8; j++) /* the pair mn[2j], mn[2j + 1] */
                VI_STORE(kt->MN + ((sb * 8 + j) * 16 + VL * h) * 2, VI_GATHER(r->mn + sb * 16 + 2 * j, idx));
            VF_STORE(kt->D + sb * 16 + VL * h, VF_GATHER(r->d + sb, idx));
            VF_STORE(kt->DM + sb * 16 + VL * h, VF_GATHER(r->dm + sb, idx));
        }
    }
}

static inline vi_t bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return VI_SET1(v);
}

/* I[v] += w[v] times the 4 activation bytes at p, broadcast (v < NV). On AVX-512 (NV = 1) the broadcast is the
 * vpdpbusd's own memory operand ({1to16}), which gcc does not form from bcast4: one instruction, not two */
#if GQ_512
static inline __m512i vdp_u8_bcast(__m512i acc, __m512i w, const void *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}
#define DP_BCAST(I, w, p, NV) ((I)[0] = vdp_u8_bcast((I)[0], (w)[0], (p)))
#else
#define DP_BCAST(I, w, p, NV)                                                                                 \
    do {                                                                                                      \
        const vi_t x_ = bcast4(p);                                                                            \
        for (int v_ = 0; v_ < (NV); v_++) (I)[v_] = VDP_U8((I)[v_], (w)[v_], x_);                            \
    } while (0)
#endif

/* a[m][v] = z for the R x NV chains of a pass */
#define SET_RV(a, R, NV, z)                                                                                   \
    for (int m_ = 0; m_ < (R); m_++)                                                                          \
        for (int v_ = 0; v_ < (NV); v_++) (a)[m_][v_] = (z)

/* dst[m][v] = src[m][v] for the R x NV chains of a pass */
#define COPY_RV(dst, src, R, NV)                                                                              \
    for (int m_ = 0; m_ < (R); m_++)                                                                          \
        for (int v_ = 0; v_ < (NV); v_++) (dst)[m_][v_] = (src)[m_][v_]

/* Output vector v of a pass reads tile tv[v] at lane offset L[v]: two tiles on AVX-512, one tile's halves
 * on 256-bit builds. */
static inline void tile_views(const ktile *kt, int NV, const ktile *tv[2], int L[2]) {
    for (int v = 0; v < NV; v++) { tv[v] = kt + (VL == 16 ? v : 0); L[v] = VL == 16 ? 0 : VL * v; }
}

/* I[m][v] += the quad q (values 4q .. 4q + 3 of the row) of the unpacked tiles times activation row m's */
#define QUAD_DP(I, q, R, NV, tv, L, xq, K)                                                                    \
    do {                                                                                                      \
        vi_t w_[2];                                                                                           \
        for (int v_ = 0; v_ < (NV); v_++) w_[v_] = VI_LOAD((tv)[v_]->T + 64 * (q) + 4 * (L)[v_]);             \
        for (int m_ = 0; m_ < (R); m_++) {                                                                    \
            const vi_t x_ = bcast4((xq) + m_ * (K) + 4 * (q));                                                \
            for (int v_ = 0; v_ < (NV); v_++) (I)[m_][v_] = VDP_U8((I)[m_][v_], w_[v_], x_);                 \
        }                                                                                                     \
    } while (0)

/* out[m][v] (output vector v < NV: lanes L[v] .. L[v] + VL - 1 of tile kt + K[v]) for R activation rows:
 * xq [R][K] int8, xd [R][nsb], xb [R][K / 16]. GS groups share a scale (2 for Q4_K/Q5_K, whose scales are
 * per 32 values: half the integer multiplies). */
static inline __attribute__((always_inline)) void gemm_k_rows(const int R, const int NV, const int GS,
                                                              const ktile *kt, const int64_t nsb, const int8_t *xq,
                                                              const int64_t K, const float *xd, const int16_t *xb,
                                                              vf_t out[GEMM_MR][2]) {
    const ktile *tv[2];
    int L[2];
    tile_views(kt, NV, tv, L);
    vf_t acc[GEMM_MR][2]; /* in registers: accumulating in out (a pointer, aliased by the byte loads) was slower */
    SET_RV(acc, R, NV, VF_ZERO());
    for (int64_t sb = 0; sb < nsb; sb++) {
        vi_t S[GEMM_MR][2];
        SET_RV(S, R, NV, VI_ZERO());
        for (int g = 0; g < 16; g += GS) {
            vi_t I[GEMM_MR][2];
            SET_RV(I, R, NV, VI_ZERO());
#pragma GCC unroll 8
            for (int qq = 0; qq < 4 * GS; qq++) QUAD_DP(I, sb * 64 + 4 * g + qq, R, NV, tv, L, xq, K);
            for (int v = 0; v < NV; v++) {
                const vi_t sc = VI_LOAD(tv[v]->SC + (sb * 16 + g) * 16 + L[v]);
                for (int m = 0; m < R; m++) S[m][v] = VI_ADD(S[m][v], VI_MULLO(I[m][v], sc));
            }
        }
        vi_t Mn[GEMM_MR][2];
        SET_RV(Mn, R, NV, VI_ZERO());
        for (int j = 0; j < 8; j++) {
            vi_t mn[2];
            for (int v = 0; v < NV; v++) mn[v] = VI_LOAD(tv[v]->MN + ((sb * 8 + j) * 16 + L[v]) * 2);
            for (int m = 0; m < R; m++) {
                const vi_t b = bcast4(xb + m * (K / 16) + sb * 16 + 2 * j);
                for (int v = 0; v < NV; v++) Mn[m][v] = VDP_I16(Mn[m][v], mn[v], b);
            }
        }
        for (int v = 0; v < NV; v++) {
            const vf_t D = VF_LOAD(tv[v]->D + sb * 16 + L[v]), DM = VF_LOAD(tv[v]->DM + sb * 16 + L[v]);
            for (int m = 0; m < R; m++) {
                const vf_t dx = VF_SET1(xd[m * nsb + sb]);
                acc[m][v] = VF_FMA(VF_CVT(S[m][v]), VF_MUL(D, dx), acc[m][v]);
                acc[m][v] = VF_FNMA(VF_CVT(Mn[m][v]), VF_MUL(DM, dx), acc[m][v]);
            }
        }
    }
    COPY_RV(out, acc, R, NV);
}

/* gemm_k_rows for a 32-block type: per block b, I = sum of u * x (8 quads), acc = fma(I, d dx, acc) and
 * acc = fma(o, dx * sum(xq), acc): xd and xs [R][nb]. */
static inline __attribute__((always_inline)) void gemm_32_rows(const int R, const int NV, const ktile *kt,
                                                               const int64_t nb, const int8_t *xq, const int64_t K,
                                                               const float *xd, const float *xs,
                                                               vf_t out[GEMM_MR][2]) {
    const ktile *tv[2];
    int L[2];
    tile_views(kt, NV, tv, L);
    vf_t acc[GEMM_MR][2]; /* in registers: accumulating in out (a pointer, aliased by the byte loads) was slower */
    SET_RV(acc, R, NV, VF_ZERO());
    for (int64_t b = 0; b < nb; b++) {
        vi_t I[GEMM_MR][2];
        SET_RV(I, R, NV, VI_ZERO());
#pragma GCC unroll 8
        for (int qq = 0; qq < 8; qq++) QUAD_DP(I, 8 * b + qq, R, NV, tv, L, xq, K);
        for (int v = 0; v < NV; v++) {
            const vf_t D = VF_LOAD(tv[v]->D + b * 16 + L[v]), O = VF_LOAD(tv[v]->DM + b * 16 + L[v]);
            for (int m = 0; m < R; m++) {
                acc[m][v] = VF_FMA(VF_CVT(I[m][v]), VF_MUL(D, VF_SET1(xd[m * nb + b])), acc[m][v]);
                acc[m][v] = VF_FMA(O, VF_SET1(xs[m * nb + b]), acc[m][v]);
            }
        }
    }
    COPY_RV(out, acc, R, NV);
}

/* BODY(R) for the R = mc activation rows of a pass as a compile-time constant (as gq.c's ROW_SWITCH) */
#define GEMM_SWITCH(mc, BODY)                                                                                 \
    switch (mc) {                                                                                             \
    case 1: BODY(1); break;                                                                                   \
    case 2: BODY(2); break;                                                                                   \
    case 3: BODY(3); break;                                                                                   \
    default: BODY(4); break;                                                                                  \
    }

/* Rows y[m, cols[n]] (m < mc, n < 16 tiles) = out[m] (+ bias[cols[n]]); contiguous: cols run cols[0] ... */
static void store_rows(vf_t (*out)[2], int mc, int tiles, const float *bias, const int64_t *cols,
                       int contiguous, float *y, int64_t N) {
    float bv[32] = {0};
    if (bias)
        for (int n = 0; n < 16 * tiles; n++) bv[n] = bias[cols[n]];
    for (int m = 0; m < mc; m++) {
        float *yr = y + m * N, o[32];
        for (int v = 0; v < 16 * tiles / VL; v++)
            VF_STORE(o + VL * v, bias ? VF_ADD(out[m][v], VF_LOAD(bv + VL * v)) : out[m][v]);
        if (contiguous) memcpy(yr + cols[0], o, sizeof(float) * 16 * tiles);
        else
            for (int n = 0; n < 16 * tiles; n++) yr[cols[n]] = o[n];
    }
}

/* Whether this build's gemm multiplies type t: the K-quants, the 32-blocks (Q8_0, whose u reach 255, only
 * with VNNI: vpmaddubsw's pair sums would saturate). */
static int gemm_type(int t) { return family(t) == FAM_K || (family(t) == FAM_32 && (t != Q8_0 || GQ_VNNI)); }

/* All M rows against `tiles` packed tiles of 16 outputs (TILES_PER_PASS at most); y row-major [M, N];
 * cols[n]: the output column of output n (16 per tile); contiguous: cols[0] .. cols[0] + 16 tiles - 1. */
static void gemm_tiles(int t, int tiles, const ktile *kt, int64_t M, const xquant *X, int64_t K,
                       const float *bias, const int64_t *cols, int contiguous, float *y, int64_t N) {
    const int gs = (t == Q4_K || t == Q5_K) ? 2 : 1, nv = 16 * tiles / VL, k = family(t) == FAM_K;
    const int64_t nsb = K / 256, nb = K / 32;
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_MR) {
        const int mc = (int)(M - m0 < GEMM_MR ? M - m0 : GEMM_MR);
        vf_t out[GEMM_MR][2];
        const int8_t *xk = X->qk + m0 * K, *x32 = X->q32 + m0 * K;
        const float *dk = X->dk + m0 * nsb, *d32 = X->d32 + m0 * nb, *s32 = X->s32 + m0 * nb;
        const int16_t *bk = X->bk + m0 * (K / 16);
#define GEMM_V(R, V)                                                                                          \
    if (!k) gemm_32_rows(R, V, kt, nb, x32, K, d32, s32, out);                                                \
    else if (gs == 2) gemm_k_rows(R, V, 2, kt, nsb, xk, K, dk, bk, out);                                       \
    else gemm_k_rows(R, V, 1, kt, nsb, xk, K, dk, bk, out);
#define GEMM_CASE(R) if (nv == 2) { GEMM_V(R, 2) } else { GEMM_V(R, 1) }
        GEMM_SWITCH(mc, GEMM_CASE);
#undef GEMM_CASE
#undef GEMM_V
        store_rows(out, mc, tiles, bias, cols, contiguous, y + m0 * N, N);
    }
}
#endif /* GQ_AVX2 */

#endif /* SPECULANT_GQ_GEMM_H */
