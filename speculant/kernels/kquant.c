/* Quantizing float rows into the GGML K-quant block types Q4_K and Q6_K, for Hugging Face models
 * loaded with --dtype q4_k / q6_k (GGUF files are never requantized: they run as stored).
 *
 * The algorithms are llama.cpp's reference quantizers without an importance matrix
 * (ggml-quants.c: quantize_row_q4_K_ref with make_qkx2_quants, quantize_row_q6_K_ref with
 * make_qx_quants), written out again here with the same float operations in the same order: the
 * `gguf` Python package dequantizes these types but has no quantizer for them. Plain scalar C built
 * with -ffp-contract=off: every ISA build (and the portable one) gives the same bytes; a row's bytes
 * do not depend on the thread count (tests/test_kquant.py).
 *
 * Block layouts (QK_K = 256 values): Q4_K 144 bytes = f16 d, f16 dmin, 12 bytes of 6-bit scales and
 * mins for 8 sub-blocks of 32, 128 bytes of 4-bit values; Q6_K 210 bytes = 128 bytes low 4 bits,
 * 64 bytes high 2 bits, 16 int8 scales (sub-blocks of 16), f16 d.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define QK_K 256
#define GROUP_MAX_EPS 1e-15f
#define T_Q4_K 12
#define T_Q6_K 14

static inline int nearest_int(float fval) { /* round half to even, |fval| <= 2^22 */
    float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}
static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float32 -> float16, round to nearest even (the branch-free conversion ggml uses without F16C). */
static uint16_t f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static float f16_to_f32_k(uint16_t h) { /* exact */
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) return (sign ? -1.f : 1.f) * ldexpf((float)man, -24);
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

/* make_qkx2_quants: a scale and (negated) min for n values in 0..nmax, weighted least squares
 * over nstep + 1 candidate scales. */
static float qkx2(int n, int nmax, const float *x, const float *weights, uint8_t *L, float *the_min, uint8_t *Laux,
                  float rmin, float rdelta, int nstep) {
    float min = x[0], max = x[0], sum_w = weights[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        const float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        *the_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min), scale = 1 / iscale, best_error = 0;
    for (int i = 0; i < n; ++i) {
        const int l = nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)imax(0, imin(nmax, l));
        float diff = scale * L[i] + min - x[i];
        diff = diff * diff;
        best_error += weights[i] * diff;
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            const int l = imax(0, imin(nmax, nearest_int(iscale * (x[i] - min))));
            Laux[i] = (uint8_t)l;
            const float w = weights[i];
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; ++i) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = diff * diff;
                cur_error += weights[i] * diff;
            }
            if (cur_error < best_error) {
                memcpy(L, Laux, (size_t)n);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

static void q4k_block(const float *x, uint8_t *y) {
    uint8_t L[QK_K], Laux[32], sc12[12] = {0};
    float weights[32], mins[8], scales[8], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; ++j) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
        const float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; ++l) weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = qkx2(32, 15, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, -1.f, 0.1f, 20);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < 8; ++j) {
        const uint8_t ls = (uint8_t)imin(63, (uint8_t)nearest_int(inv_scale * scales[j]));
        const uint8_t lm = (uint8_t)imin(63, (uint8_t)nearest_int(inv_min * mins[j]));
        if (j < 4) {
            sc12[j] = ls;
            sc12[j + 4] = lm;
        } else {
            sc12[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            sc12[j - 4] |= (uint8_t)((ls >> 4) << 6);
            sc12[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    const uint16_t hd = f32_to_f16(max_scale / 63.f), hm = f32_to_f16(max_min / 63.f);
    const float d16 = f16_to_f32_k(hd), m16 = f16_to_f32_k(hm);
    for (int j = 0; j < 8; ++j) {
        uint8_t sc, m;
        if (j < 4) {
            sc = sc12[j] & 63;
            m = sc12[j + 4] & 63;
        } else {
            sc = (uint8_t)((sc12[j + 4] & 0xF) | ((sc12[j - 4] >> 6) << 4));
            m = (uint8_t)((sc12[j + 4] >> 4) | ((sc12[j] >> 6) << 4));
        }
        const float d = d16 * sc;
        if (!d) continue;
        const float dm = m16 * m;
        for (int ii = 0; ii < 32; ++ii) L[32 * j + ii] = (uint8_t)imax(0, imin(15, nearest_int((x[32 * j + ii] + dm) / d)));
    }
    put16(y, hd);
    put16(y + 2, hm);
    memcpy(y + 4, sc12, 12);
    uint8_t *q = y + 16;
    for (int j = 0; j < QK_K; j += 64, q += 32)
        for (int l = 0; l < 32; ++l) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
}

/* make_qx_quants with rmse_type 1 (weights x^2): a signed scale for n values in -nmax..nmax-1. */
static float qx(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; ++i) {
        const float ax = fabsf(x[i]);
        if (ax > amax) { amax = ax; max = x[i]; }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / max, sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        const int l = imax(-nmax, imin(nmax - 1, nearest_int(iscale * x[i])));
        L[i] = (int8_t)(l + nmax);
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f, best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            const int l = imax(-nmax, imin(nmax - 1, nearest_int(iscale * x[i])));
            const float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i) L[i] = (int8_t)(nmax + imax(-nmax, imin(nmax - 1, nearest_int(iscale * x[i]))));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

static void q6k_block(const float *x, uint8_t *y) {
    int8_t L[QK_K], sc[16];
    float scales[16], max_scale = 0, max_abs_scale = 0;
    for (int ib = 0; ib < 16; ++ib) {
        scales[ib] = qx(16, 32, x + 16 * ib, L + 16 * ib);
        const float abs_scale = fabsf(scales[ib]);
        if (abs_scale > max_abs_scale) {
            max_abs_scale = abs_scale;
            max_scale = scales[ib];
        }
    }
    memset(y, 0, 210);
    if (max_abs_scale < GROUP_MAX_EPS) return; /* all zero, d = +0 */
    const float iscale = -128.f / max_scale;
    const uint16_t hd = f32_to_f16(1 / iscale);
    const float d16 = f16_to_f32_k(hd);
    for (int ib = 0; ib < 16; ++ib) sc[ib] = (int8_t)imin(127, nearest_int(iscale * scales[ib]));
    for (int j = 0; j < 16; ++j) {
        const float d = d16 * sc[j];
        if (!d) continue;
        for (int ii = 0; ii < 16; ++ii)
            L[16 * j + ii] = (int8_t)(imax(-32, imin(31, nearest_int(x[16 * j + ii] / d))) + 32);
    }
    uint8_t *ql = y, *qh = y + 128;
    for (int j = 0; j < QK_K; j += 128, ql += 64, qh += 32) {
        for (int l = 0; l < 32; ++l) {
            const uint8_t q1 = L[j + l] & 0xF, q2 = L[j + l + 32] & 0xF, q3 = L[j + l + 64] & 0xF,
                          q4 = L[j + l + 96] & 0xF;
            ql[l] = (uint8_t)(q1 | (q3 << 4));
            ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
            qh[l] = (uint8_t)(((uint8_t)L[j + l] >> 4) | (((uint8_t)L[j + l + 32] >> 4) << 2) |
                              (((uint8_t)L[j + l + 64] >> 4) << 4) | (((uint8_t)L[j + l + 96] >> 4) << 6));
        }
    }
    memcpy(y + 192, sc, 16);
    put16(y + 208, hd);
}

/* x[rows, k] float32 -> out[rows, k / 256 * block bytes]. Returns 0, or -2 for another type, -3 when k
 * is not a multiple of 256, -5 for a value that is not finite (named by the caller). */
int gq_quantize_k(int type, const float *x, int64_t rows, int64_t k, uint8_t *out, int nthreads) {
    if (type != T_Q4_K && type != T_Q6_K) return -2;
    if (k % QK_K) return -3;
    const int64_t nb = k / QK_K, bb = type == T_Q4_K ? 144 : 210;
    int bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 16) reduction(| : bad)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * k;
        int ok = 1;
        for (int64_t i = 0; i < k; i++) ok &= isfinite(xr[i]) != 0;
        if (!ok) {
            bad = 1;
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            if (type == T_Q4_K) q4k_block(xr + b * QK_K, out + (r * nb + b) * bb);
            else q6k_block(xr + b * QK_K, out + (r * nb + b) * bb);
        }
    }
    return bad ? -5 : 0;
}
