/* Dequantisation of whole rows: float32 (embeddings) and bf16 (the prefill's weights).
 * Part of gq.c, included once into its one translation unit. */
#ifndef SPECULANT_GQ_DEQUANT_H
#define SPECULANT_GQ_DEQUANT_H

#include "gq_dot_32.h"

/* ---------------------------------------------------------------- dequantisation (embeddings, prefill) */

/* A Q4_K superblock straight from its bytes into floats: the values and operations of the decode_k path
 * below (same bits), in loops that gcc vectorizes, without decode_k's pair-scale expansion. The prefill
 * dequantizes every weight once per chunk, and this takes about a third of decode_k's time for Q4_K. (Q6_K
 * measured no faster this way, so it keeps the decode_k path; docs/measurements.md "Kernel choices".) Returns 0
 * for other types. */
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
    const __m512i q0 = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(q));
    const __m512i q1 = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1));
    __m512 lo = _mm512_mul_ps(_mm512_set1_ps(s0), _mm512_cvtepi32_ps(q0));
    __m512 hi = _mm512_mul_ps(_mm512_set1_ps(s1), _mm512_cvtepi32_ps(q1));
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
            const int k4 = t == Q4_K;
            bf16_values32(o, _mm512_castsi512_si256(q), dl[g], dl[g + 1], k4, ml[g], ml[g + 1]);
            bf16_values32(o + 32, _mm512_extracti64x4_epi64(q, 1), dl[g + 2], dl[g + 3], k4, ml[g + 2], ml[g + 3]);
        }
    }
    return 1;
}
#endif


#endif /* SPECULANT_GQ_DEQUANT_H */
