/* The activations of a pass quantised to int8 per row, as llama.cpp does (gq.c's header comment), into xquant
 * (gq_gemm.h), and the buffers that hold them.
 * Part of gq.c, included once into its one translation unit. */
#ifndef SPECULANT_GQ_XQUANT_H
#define SPECULANT_GQ_XQUANT_H

/* Per-row int8 quantisation of x[M, K] in blocks of `blk` (32 or 256): xq[M, K], xd[M, K / blk] scales;
 * for blk = 256 also xb[M, K / 16] sums of each 16; for blk = 32 also xs[M, K / 32] = scale * sum.
 * Returns the block's sum of xq. */
static int32_t quantize_block(const float *x, int blk, int8_t *xq, float *xd, int16_t *xb, float *xs) {
    float amax = 0.0f;
    for (int i = 0; i < blk; i++) { /* = fmaxf(amax, |x|) (amax is never NaN; a NaN x is skipped), but
                                       * inline: gcc calls libm's fmaxf for each value (a decode step of
                                       * the 1.5B makes ~380,000 such calls) */
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    *xd = d;
    int32_t sum = 0;
    for (int i = 0; i < blk; i++) {
        float v = nearbyintf(x[i] * id);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        xq[i] = (int8_t)v;
        sum += xq[i];
    }
    if (xb)
        for (int g = 0; g < blk / 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += xq[16 * g + i];
            xb[g] = (int16_t)s;
        }
    if (xs) *xs = d * (float)sum;
    return sum;
}

/* 64-byte aligned: the activation rows are read in 64-byte loads, and malloc's 16-byte alignment split every
 * one across two cache lines (a few percent of a pass of 8 rows; docs/measurements.md "Kernel choices"). */
static void *alloc64(size_t n) { return aligned_alloc(64, (n + 63) & ~(size_t)63); }

static void xquant_free(xquant *X) {
    free(X->q32); free(X->d32); free(X->s32); free(X->bs32); free(X->qk); free(X->dk); free(X->bk); free(X->b32k);
}

/* Returns 0, or -1 out of memory (X freed). */
static int xquant_alloc(xquant *X, int64_t M, int64_t K, int need32, int needk) {
    memset(X, 0, sizeof(*X));
    if (need32) {
        X->q32 = alloc64(M * K + 64);
        X->d32 = malloc(sizeof(float) * (M * (K / 32) + 1));
        X->s32 = malloc(sizeof(float) * (M * (K / 32) + 1));
        X->bs32 = malloc(sizeof(int16_t) * (M * (K / 32) + 1));
    }
    if (needk) {
        X->qk = alloc64(M * K + 64);
        X->dk = malloc(sizeof(float) * (M * (K / 256) + 1));
        X->bk = alloc64(sizeof(int16_t) * (M * (K / 16) + 32));
        X->b32k = alloc64(sizeof(int16_t) * (M * (K / 32) + 32));
    }
    if ((need32 && (!X->q32 || !X->d32 || !X->s32 || !X->bs32)) || (needk && (!X->qk || !X->dk || !X->bk || !X->b32k))) {
        xquant_free(X);
        return -1;
    }
    return 0;
}

/* Fills X from x[M, K]; called by every thread of an OpenMP team. */
static void xquant_fill(const xquant *X, const float *x, int64_t M, int64_t K) {
    if (X->q32) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * (K / 32); i++)
            X->bs32[i] = (int16_t)quantize_block(x + i * 32, 32, X->q32 + i * 32, X->d32 + i, NULL, X->s32 + i);
    }
    if (X->qk) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * (K / 256); i++) {
            quantize_block(x + i * 256, 256, X->qk + i * 256, X->dk + i, X->bk + i * 16, NULL);
            for (int j = 0; j < 8; j++) X->b32k[i * 8 + j] = (int16_t)(X->bk[i * 16 + 2 * j] + X->bk[i * 16 + 2 * j + 1]);
        }
    }
}

#endif /* SPECULANT_GQ_XQUANT_H */
