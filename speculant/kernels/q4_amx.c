/* Long passes (prompt prefill) of the int4 matmul on AMX tiles, in bf16 (Sapphire Rapids and later).
 *
 * Why: the fallback expands the int4 weights to bf16 in 32 MB chunks for oneDNN's GEMM, so every
 * prefill writes and reads back 2 bytes per weight (2.6 GB for the 1.5B model), and oneDNN rounds
 * its outputs to bf16. Here each thread expands four pairs of 8-row blocks (64 output rows) into an
 * L2-resident buffer and multiplies it by all activation rows right away; the tiles keep fp32 sums
 * over the whole K. Measured on 2 cores (M = 130 rows): 17920x1536 5.0 ms vs oneDNN 9.4 ms,
 * 1536x8960 3.3 vs 4.7 ms. Passes of more rows fall off once the activations outgrow L2 (they are
 * re-read for every 64 outputs), so the Transformer prefills long prompts in chunks (PREFILL_CHUNK).
 *
 * Values: every weight becomes bf16(q * d * gscale), rounded to nearest even, exactly what
 * q4_dequant_bf16 writes for oneDNN (q * d computed as fma(u, d, -8 d), one rounding of the same
 * exact product); products and sums are fp32 (tdpbf16ps), bias added in fp32. Each output is
 * computed by one thread in a fixed order, so results do not depend on the thread count.
 *
 * Tiles (palette 1): C0-C3 [16][16] fp32 sums of 16 activation rows for four pairs of blocks
 * (64 output rows); A (tile 4) [16][32] bf16 activation rows (one group of K), loaded once for the
 * four; B (tiles 5-7) [16][32] bf16 weights of that group for one pair, in pair order (row kk =
 * weights 2kk, 2kk+1 of each of its 16 output rows). xb is padded to a multiple of 16 rows.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define QK 32
#define RB 8
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

/* Asks Linux for the AMX tile state of this process (idempotent); 0 on success. */
int q4_amx_init(void) { return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

/* Expands group g of blocks qa, qb (qb NULL: zeros) into the B tile layout at out[16][32] bf16. */
AMX static void expand_group(const uint8_t *qa, const uint8_t *qb, const uint16_t *sa, const uint16_t *sb,
                             float gscale, uint16_t *out) {
    const uint8_t *q[2] = {qa, qb};
    const uint16_t *s[2] = {sa, sb};
    __m512i lo_bf[2][4], hi_bf[2][4]; /* per block and chunk i: 32 bf16 in (row, b) order */
    const __m512i rows03 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i rows47 = _mm512_add_epi32(rows03, _mm512_set1_epi32(4));
    for (int blk = 0; blk < 2; blk++) {
        if (!q[blk]) {
            for (int i = 0; i < 4; i++) lo_bf[blk][i] = hi_bf[blk][i] = _mm512_setzero_si512();
            continue;
        }
        const __m512 d8 = _mm512_castps256_ps512(
            _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s[blk])), _mm256_set1_ps(gscale)));
        const __m512 d03 = _mm512_permutexvar_ps(rows03, d8), d47 = _mm512_permutexvar_ps(rows47, d8);
        const __m512 m03 = _mm512_mul_ps(d03, _mm512_set1_ps(-8.0f)), m47 = _mm512_mul_ps(d47, _mm512_set1_ps(-8.0f));
        for (int i = 0; i < 4; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q[blk] + 32 * i));
            const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
            const __m256i nib[2] = {lo, hi};
            for (int h = 0; h < 2; h++) {
                const __m512 u0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(nib[h])));
                const __m512 u1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(nib[h], 1)));
                /* (u - 8) * d with one rounding, as q4_dequant_bf16's q * d */
                const __m512 w0 = _mm512_fmadd_ps(u0, d03, m03), w1 = _mm512_fmadd_ps(u1, d47, m47);
                const __m512i bf = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);
                if (h) hi_bf[blk][i] = bf; else lo_bf[blk][i] = bf;
            }
        }
    }
    /* dword r*2 + j of a chunk holds (k = 4i + 2j, 4i + 2j + 1) of row r: pair rows 2i + j */
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int i = 0; i < 4; i++) {
        _mm512_store_si512((__m512i *)(out + 32 * (2 * i)), _mm512_permutex2var_epi32(lo_bf[0][i], even, lo_bf[1][i]));
        _mm512_store_si512((__m512i *)(out + 32 * (2 * i + 1)), _mm512_permutex2var_epi32(lo_bf[0][i], odd, lo_bf[1][i]));
        _mm512_store_si512((__m512i *)(out + 32 * (8 + 2 * i)), _mm512_permutex2var_epi32(hi_bf[0][i], even, hi_bf[1][i]));
        _mm512_store_si512((__m512i *)(out + 32 * (9 + 2 * i)), _mm512_permutex2var_epi32(hi_bf[0][i], odd, hi_bf[1][i]));
    }
}

#define PAIRS 4 /* pairs of blocks (64 output rows) per task: one A tile load serves four B tiles */

AMX static inline void store_tile(const float *c, float *y, int64_t N, int64_t n0, int cols, int64_t mb, int64_t M,
                                  const float *bias) {
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    for (int64_t m = mb; m < M && m < mb + 16; m++)
        _mm512_mask_storeu_ps(y + m * N + n0, keep, _mm512_add_ps(_mm512_load_ps(c + (m - mb) * 16), b));
}

/* y[M, N] = x[M, K] @ W^T (+ bias) with xb = x as bf16, padded with zero rows to Mp, a multiple of
 * 16 rows, and laid out as A tiles [Mp / 16][K / 32][16][32] (each tile 1 KB, contiguous, so the
 * passes stream through it). Returns 0, -1 if scratch memory ran out, -2 if Linux refused the AMX state. */
AMX int q4_matmul_amx(const uint16_t *xb, int64_t M, int64_t K, const uint8_t *qw, const uint16_t *sc, int64_t N,
                      const float *bias, float gscale, float *y, int nthreads) {
    const int64_t G = K / QK, NB = (N + RB - 1) / RB, pairs = (NB + 1) / 2, Mp = (M + 15) / 16 * 16;
    const int64_t tasks = (pairs + PAIRS - 1) / PAIRS;
    if (q4_amx_init() != 0) return -2; /* idempotent; without it the first tile instruction faults */
    if (nthreads < 1) nthreads = 1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* the task's weights as B tiles: [pair][group][16][32] bf16 (1.1 MB for K = 8960) */
        uint16_t *wb = (uint16_t *)aligned_alloc(64, (size_t)PAIRS * G * 512 * sizeof(uint16_t));
        if (!wb) {
#pragma omp atomic write
            failed = 1;
        }
        tilecfg cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        if (wb) _tile_loadconfig(&cfg);
        float c[16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (!wb) continue;
            const int64_t p0 = task * PAIRS;
            const int np = (int)(pairs - p0 < PAIRS ? pairs - p0 : PAIRS);
            for (int p = 0; p < np; p++) {
                const int64_t na = 2 * (p0 + p), nb = na + 1;
                const uint8_t *qa = qw + na * G * 128, *qb = nb < NB ? qw + nb * G * 128 : NULL;
                const uint16_t *sa = sc + na * G * RB, *sb = nb < NB ? sc + nb * G * RB : NULL;
                for (int64_t g = 0; g < G; g++)
                    expand_group(qa + g * 128, qb ? qb + g * 128 : NULL, sa + g * RB, sb ? sb + g * RB : NULL,
                                 gscale, wb + (p * G + g) * 512);
            }
            const uint16_t *w0 = wb, *w1 = wb + G * 512, *w2 = wb + 2 * G * 512, *w3 = wb + 3 * G * 512;
            for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                const uint16_t *xr = xb + m0 * K; /* this pass's A tiles, [G][16][32] */
                for (int64_t g = 0; g < G; g++) {
                    _tile_loadd(4, xr + g * 512, 64);
                    _tile_loadd(5, w0 + g * 512, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    if (np > 1) {
                        _tile_loadd(6, w1 + g * 512, 64);
                        _tile_dpbf16ps(1, 4, 6);
                    }
                    if (np > 2) {
                        _tile_loadd(7, w2 + g * 512, 64);
                        _tile_dpbf16ps(2, 4, 7);
                    }
                    if (np > 3) {
                        _tile_loadd(5, w3 + g * 512, 64);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                for (int p = 0; p < np; p++) {
                    switch (p) {
                    case 0: _tile_stored(0, c, 64); break;
                    case 1: _tile_stored(1, c, 64); break;
                    case 2: _tile_stored(2, c, 64); break;
                    default: _tile_stored(3, c, 64); break;
                    }
                    const int64_t n0 = 2 * (p0 + p) * RB;
                    store_tile(c, y, N, n0, (int)(N - n0 < 16 ? N - n0 : 16), m0, M, bias);
                }
            }
        }
        if (wb) _tile_release();
        free(wb);
    }
    return failed ? -1 : 0;
}
