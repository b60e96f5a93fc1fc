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
 * Built with -mavxvnni (native.py does so where the CPU has AVX-VNNI), the integer dot products use
 * vpdpbusd instead of maddubs + adds; the sums are the same exact integers, so the results are
 * bit-identical to the AVX2 build. Built with AVX512-VNNI, two neighbouring blocks (16 rows) go
 * through one 512-bit register: half the instructions per weight for the same per-lane operations,
 * so again bit-identical (an odd last block takes the 256-bit path).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define QK 32
#define RB 8
#define PREFETCH 2048 /* bytes */
#define MAXM 16  /* rows per kernel pass; more are done in passes of MAXM */

static inline __m256i bcast32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* One group of 32 activations: x -> xq[32] int8, *xd = scale, *xs = -8 * sum(xq) (the unsigned weights' offset). */
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
    *xs = -8 * _mm_cvtsi128_si32(s4);
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
            isum = _mm256_add_epi32(isum, _mm256_set1_epi32(xs[m * G + g]));
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


#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define WIDE 1
static inline __attribute__((always_inline)) __m512i bcast32x16(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* group_dot for two blocks at once: int32 lanes 0-7 = rows of block a, 8-15 = rows of block b. */
static inline __attribute__((always_inline)) __m512i group_dot16(const __m512i w[8], const int8_t *xg, const int32_t *xs) {
    /* the sum starts from the offset -8 * sum(x): one instruction less per row and group */
    __m512i a = _mm512_dpbusd_epi32(_mm512_set1_epi32(*xs), w[0], bcast32x16(xg + 0));
    __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], bcast32x16(xg + 4));
    a = _mm512_dpbusd_epi32(a, w[2], bcast32x16(xg + 8));
    b = _mm512_dpbusd_epi32(b, w[3], bcast32x16(xg + 12));
    a = _mm512_dpbusd_epi32(a, w[4], bcast32x16(xg + 16));
    b = _mm512_dpbusd_epi32(b, w[5], bcast32x16(xg + 20));
    a = _mm512_dpbusd_epi32(a, w[6], bcast32x16(xg + 24));
    b = _mm512_dpbusd_epi32(b, w[7], bcast32x16(xg + 28));
    return _mm512_add_epi32(a, b);
}

/* block_rows for the neighbouring blocks qa, qb (scales sa, sb): lo[m], hi[m] = their 8 outputs. */
static inline __attribute__((always_inline)) void block_rows2(
    const int M, const int64_t K, const int64_t G, const int8_t *xq, const float *xd, const int32_t *xs,
    const uint8_t *qa, const uint8_t *qb, const uint16_t *sa, const uint16_t *sb, __m256 *lo, __m256 *hi) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    __m512 acc[MAXM];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *pa = qa + g * 128, *pb = qb + g * 128;
        _mm_prefetch((const char *)(pa + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(pa + PREFETCH + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(pb + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(pb + PREFETCH + 64), _MM_HINT_T0);
        __m512i w[8];
        for (int i = 0; i < 4; i++) {
            const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(pa + 32 * i))),
                                                 _mm256_loadu_si256((const __m256i *)(pb + 32 * i)), 1);
            w[i] = _mm512_and_si512(v, mask);
            w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        }
        const __m256i s16 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(sa + g * RB))),
                                                    _mm_loadu_si128((const __m128i *)(sb + g * RB)), 1);
        const __m512 dw = _mm512_cvtph_ps(s16);
        for (int m = 0; m < M; m++) {
            const __m512i isum = group_dot16(w, xq + m * K + g * QK, xs + m * G + g);
            const __m512 d = _mm512_mul_ps(dw, _mm512_set1_ps(xd[m * G + g]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), d, acc[m]);
        }
    }
    for (int m = 0; m < M; m++) {
        lo[m] = _mm512_castps512_ps256(acc[m]);
        hi[m] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m]), 1));
    }
}
#else
#define WIDE 0
#endif

/* Calls BODY(R) with R a compile-time constant for the row counts of decoding and of speculative
 * verification (1-8 rows), so that their accumulators stay in registers; more rows go through the
 * generic loop (measured: 7 rows x a 17920x1536 weight took 0.60 ms that way, 0.55 ms with this). */
#define ROW_SWITCH(mc, BODY)                                                                          \
    switch (mc) {                                                                                   \
    case 1: BODY(1); break;                                                                         \
    case 2: BODY(2); break;                                                                         \
    case 3: BODY(3); break;                                                                         \
    case 4: BODY(4); break;                                                                         \
    case 5: BODY(5); break;                                                                         \
    case 6: BODY(6); break;                                                                         \
    case 7: BODY(7); break;                                                                         \
    case 8: BODY(8); break;                                                                         \
    default: BODY(mc); break;                                                                       \
    }

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
        for (int64_t pair = 0; pair < (NB + 1) / 2; pair++) {
            /* blocks 2 * pair and 2 * pair + 1: through one 512-bit register where built for it */
            for (int64_t m0 = 0; m0 < M; m0 += MAXM) {
                /* rows in passes of at most MAXM; later passes find these weights in L1/L2 */
                const int mc = (int)(M - m0 < MAXM ? M - m0 : MAXM);
                const int8_t *xq0 = xq + m0 * K;
                const float *xd0 = xd + m0 * G;
                const int32_t *xs0 = xs + m0 * G;
                float *y0 = y + m0 * N;
                int64_t nb = 2 * pair;
#if WIDE
                if (nb + 1 < NB) {
                    const uint8_t *qa = qw + nb * G * 128, *qb = qa + G * 128;
                    const uint16_t *sa = sc + nb * G * RB, *sb = sa + G * RB;
                    __m256 lo[MAXM], hi[MAXM];
                    /* constant row counts let the compiler keep the accumulators in registers */
#define PAIR(R) block_rows2(R, K, G, xq0, xd0, xs0, qa, qb, sa, sb, lo, hi)
                    ROW_SWITCH(mc, PAIR);
#undef PAIR
                    store_rows(mc, lo, y0, N, nb * RB, bias, gscale);
                    store_rows(mc, hi, y0, N, (nb + 1) * RB, bias, gscale);
                    continue;
                }
#endif
                for (; nb < NB && nb < 2 * pair + 2; nb++) {
                    const uint8_t *q = qw + nb * G * 128;
                    const uint16_t *s = sc + nb * G * RB;
                    __m256 acc[MAXM];
#define ONE(R) block_rows(R, K, G, xq0, xd0, xs0, q, s, acc); store_rows(R, acc, y0, N, nb * RB, bias, gscale)
                    ROW_SWITCH(mc, ONE);
#undef ONE
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
