/* int4 weights x int8 activations matmul for 1..16 activation rows (AVX2 + FMA + F16C, OpenMP).
 *
 * Plain C, no torch headers: speculant/models/int4.py compiles this file once with gcc into a
 * cache directory and calls q4_matmul through ctypes.
 *
 * Weight layout (built by int4.py), for W[N, K] with N padded to a multiple of 8 and G = K / 32:
 *   qw   uint8  [N/8][G][128]   8 rows x 32 weights of one group, 4 bits each (unsigned q + 8)
 *   sc   fp16   [N/8][G][8]     the 8 rows' scales for that group (times 2^-e, see gscale)
 * Inside the 128 bytes, byte i*32 + r*4 + b (i = 0..3, r = row 0..7, b = 0..3) holds weight
 * k = 4i + b of row r in its low nibble and weight k = 16 + 4i + b in its high nibble. One 32-byte
 * load therefore gives, after masking, a vector whose 32-bit lane r holds 4 consecutive weights of
 * row r: multiplied (maddubs) with the 4 matching activations broadcast to every lane, the 8 rows'
 * dot products build up "vertically" and never need a horizontal reduction.
 *
 * Activations are quantised per row and per group of 32 to int8 (scale = absmax / 127, like
 * llama.cpp's Q8_0). With unsigned weights u = q + 8:  sum q*x = sum u*x - 8 * sum x, and sum x is
 * computed once per activation group. Every integer sum is exact (16 products of at most 15 * 128
 * stay below 2^15 in the int16 stage), and each output row goes through the same float operations
 * in the same order whatever M and the thread count are: a row's result is bit-identical whether
 * it is computed alone or with other rows. Build with -ffp-contract=off so that the compiler does
 * not fuse multiplies and adds differently in the differently inlined variants.
 *
 * Built with -mavxvnni (int4.py does so where the CPU has AVX-VNNI), the integer dot products use
 * vpdpbusd instead of maddubs + adds; the sums are the same exact integers, so the results are
 * bit-identical to the AVX2 build.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define QK 32
#define RB 8
#define PREFETCH 2048 /* bytes */

static inline __m256i bcast32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* One group of 32 activations: x -> xq[32] int8, *xd = scale, *xs = 8 * sum(xq). */
static void quantize_group(const float *x, int8_t *xq, float *xd, int32_t *xs) {
    __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
    __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                             _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    *xd = d;
    const __m256 mul = _mm256_set1_ps(id);
    /* cvtps rounds to nearest even (the default MXCSR mode), like torch.round */
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, mul));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, mul));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, mul));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, mul));
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    *xs = 8 * _mm_cvtsi128_si32(s4);
    /* pack 32 int32 -> 32 int8 in order (packs work per 128-bit lane, then fix the order) */
    __m256i p01 = _mm256_packs_epi32(i0, i1);
    __m256i p23 = _mm256_packs_epi32(i2, i3);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)xq, p);
}

/* Sum over one group of 8 rows x 32 weights for activation group xg: int32 lane r = row r. */
static inline __attribute__((always_inline)) __m256i group_dot(const __m256i w[8], const int8_t *xg) {
#ifdef __AVXVNNI__
    /* AVX-VNNI (built with -mavxvnni where the CPU has it): the same exact integer sums */
    __m256i a = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w[0], bcast32(xg + 0));
    __m256i b = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w[1], bcast32(xg + 4));
    a = _mm256_dpbusd_avx_epi32(a, w[2], bcast32(xg + 8));
    b = _mm256_dpbusd_avx_epi32(b, w[3], bcast32(xg + 12));
    a = _mm256_dpbusd_avx_epi32(a, w[4], bcast32(xg + 16));
    b = _mm256_dpbusd_avx_epi32(b, w[5], bcast32(xg + 20));
    a = _mm256_dpbusd_avx_epi32(a, w[6], bcast32(xg + 24));
    b = _mm256_dpbusd_avx_epi32(b, w[7], bcast32(xg + 28));
    return _mm256_add_epi32(a, b);
#else
    __m256i p0 = _mm256_maddubs_epi16(w[0], bcast32(xg + 0));
    __m256i p1 = _mm256_maddubs_epi16(w[1], bcast32(xg + 4));
    __m256i p2 = _mm256_maddubs_epi16(w[2], bcast32(xg + 8));
    __m256i p3 = _mm256_maddubs_epi16(w[3], bcast32(xg + 12));
    __m256i p4 = _mm256_maddubs_epi16(w[4], bcast32(xg + 16));
    __m256i p5 = _mm256_maddubs_epi16(w[5], bcast32(xg + 20));
    __m256i p6 = _mm256_maddubs_epi16(w[6], bcast32(xg + 24));
    __m256i p7 = _mm256_maddubs_epi16(w[7], bcast32(xg + 28));
    __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(p0, p1), _mm256_add_epi16(p2, p3)),
                                 _mm256_add_epi16(_mm256_add_epi16(p4, p5), _mm256_add_epi16(p6, p7)));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

/* One block of 8 output rows for M activation rows; acc[m] = 8 outputs of row m. */
static inline __attribute__((always_inline)) void block_rows(
    const int M, const int64_t K, const int64_t G, const int8_t *xq, const float *xd, const int32_t *xs,
    const uint8_t *qw, const uint16_t *sc, __m256 *acc) {
    const __m256i lo = _mm256_set1_epi8(0x0f);
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *q = qw + g * 128;
        /* software prefetch 16 groups ahead: measured 3-8% faster than the hardware prefetcher alone */
        _mm_prefetch((const char *)(q + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + PREFETCH + 64), _MM_HINT_T0);
        __m256i w[8];
        for (int i = 0; i < 4; i++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * i));
            w[i] = _mm256_and_si256(v, lo);
            w[i + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + g * RB)));
        for (int m = 0; m < M; m++) {
            __m256i isum = group_dot(w, xq + m * K + g * QK);
            isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(xs[m * G + g]));
            const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(xd[m * G + g]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, acc[m]);
        }
    }
}

static inline __attribute__((always_inline)) void store_rows(
    const int M, const __m256 *acc, float *y, const int64_t N, const int64_t n0, const float *bias,
    const float gscale) {
    const __m256 gs = _mm256_set1_ps(gscale);
    __m256 b = _mm256_setzero_ps();
    const int full = n0 + RB <= N;
    if (bias) {
        if (full) {
            b = _mm256_loadu_ps(bias + n0);
        } else {
            float tb[RB] = {0};
            for (int64_t r = 0; n0 + r < N; r++) tb[r] = bias[n0 + r];
            b = _mm256_loadu_ps(tb);
        }
    }
    for (int m = 0; m < M; m++) {
        __m256 o = _mm256_add_ps(_mm256_mul_ps(acc[m], gs), b);
        if (full) {
            _mm256_storeu_ps(y + m * N + n0, o);
        } else {
            float t[RB];
            _mm256_storeu_ps(t, o);
            for (int64_t r = 0; n0 + r < N; r++) y[m * N + n0 + r] = t[r];
        }
    }
}

#define MAXM 16  /* rows per kernel pass; more are done in passes of MAXM */

/* y[M, N] = x[M, K] @ W^T * gscale + bias.  Returns 0, or -1 if scratch memory ran out. */
int q4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *qw, const uint16_t *sc, int64_t N,
              const float *bias, float gscale, float *y, int nthreads) {
    const int64_t G = K / QK, NB = (N + RB - 1) / RB;
    /* scratch: quantised activations, 32-byte aligned */
    size_t bytes_q = (size_t)(M * K + 63) & ~(size_t)31;
    size_t bytes = bytes_q + (size_t)(M * G) * (sizeof(float) + sizeof(int32_t));
    void *scratch = aligned_alloc(32, (bytes + 31) & ~(size_t)31);
    if (!scratch) return -1;
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)((char *)scratch + bytes_q);
    int32_t *xs = (int32_t *)(xd + M * G);
    if (nthreads < 1) nthreads = 1;
    /* small problems are not worth waking other threads */
    if ((int64_t)NB * G * (M < 4 ? M : 4) < 256) nthreads = 1;

#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < M * G; t++) {
            const int64_t m = t / G, g = t % G;
            quantize_group(x + m * K + g * QK, xq + m * K + g * QK, xd + t, xs + t);
        }
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < NB; nb++) {
            const uint8_t *q = qw + nb * G * 128;
            const uint16_t *s = sc + nb * G * RB;
            /* rows in passes of at most MAXM; later passes find this block's weights in L1/L2 */
            for (int64_t m0 = 0; m0 < M; m0 += MAXM) {
                const int mc = (int)(M - m0 < MAXM ? M - m0 : MAXM);
                const int8_t *xq0 = xq + m0 * K;
                const float *xd0 = xd + m0 * G;
                const int32_t *xs0 = xs + m0 * G;
                float *y0 = y + m0 * N;
                __m256 acc[MAXM];
                switch (mc) {  /* constant row counts let the compiler keep accumulators in registers */
                case 1: block_rows(1, K, G, xq0, xd0, xs0, q, s, acc); store_rows(1, acc, y0, N, nb * RB, bias, gscale); break;
                case 2: block_rows(2, K, G, xq0, xd0, xs0, q, s, acc); store_rows(2, acc, y0, N, nb * RB, bias, gscale); break;
                case 3: block_rows(3, K, G, xq0, xd0, xs0, q, s, acc); store_rows(3, acc, y0, N, nb * RB, bias, gscale); break;
                case 4: block_rows(4, K, G, xq0, xd0, xs0, q, s, acc); store_rows(4, acc, y0, N, nb * RB, bias, gscale); break;
                default: block_rows(mc, K, G, xq0, xd0, xs0, q, s, acc); store_rows(mc, acc, y0, N, nb * RB, bias, gscale); break;
                }
            }
        }
    }
    free(scratch);
    return 0;
}

/* Long passes (prefill) on CPUs with AVX512-BF16: the weights of blocks [nb0, nb1) are expanded
 * to bf16 rows out[(nb - nb0) * 8 + r][K] (q * d * gscale, rounded to nearest even) so that oneDNN's
 * bf16 GEMM (AMX where present) multiplies them, several times faster than the integer kernel
 * above once a pass has more than a few dozen rows. Only called where the CPU has the features
 * named in the target attribute (int4.py checks), so the rest of this file stays AVX2-only. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void q4_dequant_bf16(const uint8_t *qw, const uint16_t *sc, int64_t K, int64_t nb0, int64_t nb1, float gscale,
                     uint16_t *out, int nthreads) {
    const int64_t G = K / QK;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t nb = nb0; nb < nb1; nb++) {
        const uint8_t *q = qw + nb * G * 128;
        const uint16_t *s = sc + nb * G * RB;
        uint16_t *o = out + (nb - nb0) * RB * K;
        const __m128i lo = _mm_set1_epi8(0x0f);
        const __m512i eight = _mm512_set1_epi32(8);
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *qg = q + g * 128;
            /* 4 x (8 rows x 4 bytes) -> per row the 16 bytes (v0[r], v1[r], v2[r], v3[r]) */
            __m256i v0 = _mm256_loadu_si256((const __m256i *)(qg)), v1 = _mm256_loadu_si256((const __m256i *)(qg + 32));
            __m256i v2 = _mm256_loadu_si256((const __m256i *)(qg + 64)), v3 = _mm256_loadu_si256((const __m256i *)(qg + 96));
            __m256i t0 = _mm256_unpacklo_epi32(v0, v1), t1 = _mm256_unpackhi_epi32(v0, v1);
            __m256i t2 = _mm256_unpacklo_epi32(v2, v3), t3 = _mm256_unpackhi_epi32(v2, v3);
            __m256i rows[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                               _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
            const __m256 d8 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + g * RB))),
                                            _mm256_set1_ps(gscale));
            float d[RB];
            _mm256_storeu_ps(d, d8);
            for (int j = 0; j < 4; j++) {
                /* 128-bit lane 0 holds row j, lane 1 row j + 4 */
                for (int h = 0; h < 2; h++) {
                    const int r = j + 4 * h;
                    const __m128i b = h ? _mm256_extracti128_si256(rows[j], 1) : _mm256_castsi256_si128(rows[j]);
                    const __m512 dr = _mm512_set1_ps(d[r]);
                    const __m512i ql = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(b, lo)), eight);
                    const __m512i qh = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), lo)), eight);
                    uint16_t *row = o + (int64_t)r * K + g * QK;
                    _mm256_storeu_si256((__m256i *)row, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_cvtepi32_ps(ql), dr)));
                    _mm256_storeu_si256((__m256i *)(row + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_cvtepi32_ps(qh), dr)));
                }
            }
        }
    }
}

/* Layout constants, checked by the Python side against what it packs. */
int q4_block_rows(void) { return RB; }
int q4_group_size(void) { return QK; }
