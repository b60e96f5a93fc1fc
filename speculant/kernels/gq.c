/* GGUF block formats multiplied as the file stores them (no requantisation), for 1..32 activation rows.
 *
 * Weights are the GGUF tensor's bytes, memory-mapped: row n of W[N, K] is `row_bytes` bytes of blocks.
 * Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
 *
 * Activations are quantised per row to int8 as llama.cpp does: per 32 values for the 32-blocks
 * (Q8_0-like) and per 256 for the K-quants (Q8_K-like, with the sums of each 16), with a float32 scale
 * (absmax / 127) where llama.cpp rounds Q8_0's to fp16. The dot products then run in integers, with the
 * K-quants' integer sub-block scales folded into exact int32 sums; float arithmetic happens once per
 * block (32-blocks) or per superblock (K-quants).
 *
 * Exactness contract (tests/test_gguf_kernels.py):
 *  - every weight row is first decoded into a canonical form (unsigned integers u, integer scales and
 *    mins, float block scales); the integer sums are exact, so their order does not matter;
 *  - the float work of an output (row n, activation row m) follows one fixed lane structure, the
 *    "canonical 16 lanes" below, in every build (AVX512-VNNI, AVX-VNNI, AVX2, portable C) and whatever
 *    M or the thread count: a row's output is bit-identical whether it is computed alone or with
 *    drafted rows, on every build. Built with -ffp-contract=off; fused multiply-adds are explicit.
 *
 * Canonical form and lanes, per output (n, m):
 *  K-quants (superblocks of 256): u[256] < 64, sc[16] and mn[16] int16 per 16 values, d and dmin:
 *      W = d * sc * u - dmin * mn  (Q6_K: u = q + 32, mn = 32 sc, dmin = d; Q3_K: u = q + 4, mn = 4 sc)
 *    lane l (0..15) of I = sum over the 4 chunks c of 64 values of sc[4c + l/4] * (sum of u*x over values
 *    64c + 4l .. 64c + 4l + 3); lane j (0..7) of S = mn[2j] B[2j] + mn[2j+1] B[2j+1], B = sums of x per 16;
 *    acc[l] = fma(I[l], d * dx, acc[l]); accm[j] = fma(S[j], dmin * dx, accm[j]); y = hsum16(acc) - hsum8(accm)
 *  32-blocks: u[32] (Q8_0: q + 128), d, and the coefficient o of the block's sum of x (Q4_0: -8d, Q4_1: m):
 *    lane (b & 1) * 8 + j: acc = fma(sum of u*x over values 32b + 4j .. 4j + 3, d * dx, acc);
 *    t = fma(o, dx * sum(xq), t) in block order; y = hsum16(acc) + t
 *  F32/F16/BF16 (activations stay float): acc[e % 16] = fma(w[e], x[e], acc[e % 16]); y = hsum16(acc)
 *  K-quant parts repacked (gq_part.packed, gq_packed.h, gq_packed2.h), one output per lane: per superblock
 *    the exact S = sum of sc * (sum of u*x) over sub-blocks and Mn = sum of mn * (sum of x) (Q6_K: 32 sc), then
 *    acc = fma(S, d * dx, acc); acc = fma(-Mn, dmin * dx, acc) in superblock order; y = acc
 *  32-block parts repacked (gq_packed32.h): per block the exact I = sum of q*x (q signed), then
 *    acc = fma(I, d * dx, acc) (Q4_1, Q5_1: and acc = fma(m, dx * sum(xq), acc)) in block order; y = acc
 */
/* The parts, each included once into this one translation unit (so every helper stays static and inlined):
 *  gq_types.h    block types, the build's instruction sets, fp16 reads, prefetching
 *  gq_decode.h   a weight row into the canonical form (decoded rows; 32-blocks from raw bytes)
 *  gq_dot_k.h    canonical float reductions; K-quant dot products, decoded and from raw superblocks
 *  gq_dot_32.h   32-block and float dot products, decoded and from raw blocks
 *  gq_dequant.h  whole rows into float32 (embeddings) and bf16 (the prefill's weights)
 *  gq_gemm.h     prompt passes of the block types (an output per lane)
 *  gq_packed.h   Q4_K, Q5_K and Q6_K repacked, 16 rows per tile (an output per lane), for every pass
 *  gq_packed2.h  the same for Q2_K and Q3_K
 *  gq_packed32.h the same for the 32-block types, and the dispatch over packed types (multiply, unpack, pack)
 *  gq_xquant.h   the activations' int8 quantisation and its buffers
 * and here: the matmul and the exported functions. */
#include "gq_types.h"
#include "gq_decode.h"
#include "gq_dot_k.h"
#include "gq_dot_32.h"
#include "gq_dequant.h"
#include "gq_gemm.h"
#include "gq_packed.h"
#include "gq_packed2.h"
#include "gq_packed32.h"
#include "gq_xquant.h"

int gq_supported(int t) { return family(t) >= 0; }
int gq_block_bytes(int t) { return block_bytes(t); }
int gq_block_values(int t) { return block_values(t); }

/* ---------------------------------------------------------------- the matmul */

typedef struct {
    int32_t type;
    int32_t _pad;
    const uint8_t *w;      /* [n][row_bytes] */
    int64_t n;             /* rows of this part */
    int64_t row_bytes;
    const int32_t *perm;   /* or NULL: row r of the part goes to output column offset + perm[r] */
    const uint8_t *packed; /* or NULL: the rows repacked by gq_pack (gq_packed*.h), which every pass reads */
} gq_part;

/* Tile i of the packed parts (counted over the packed parts in order), all M rows, into y. */
static void packed_part_tile(const gq_part *parts, int nparts, int64_t i, int64_t M, const xquant *X, int64_t K,
                             const float *bias, float *y, int64_t N) {
    int64_t off = 0;
    for (int p = 0; p < nparts; p++) {
        const gq_part *P = parts + p;
        if (P->packed && i < P->n / 16) {
            int64_t cols[16];
            for (int n = 0; n < 16; n++) cols[n] = off + (P->perm ? P->perm[16 * i + n] : 16 * i + n);
            packed_tile(P->type, P->packed + i * packed_tile_bytes(P->type, K), M, X, K, bias, cols, !P->perm, y, N);
            return;
        }
        if (P->packed) i -= P->n / 16;
        off += P->n;
    }
}

/* Checks a part list against K; returns 0 or a negative code (see gq_matmul). */
static int check_parts(const gq_part *parts, int nparts, int64_t K) {
    for (int p = 0; p < nparts; p++) {
        const int t = parts[p].type, bv = block_values(t);
        if (family(t) < 0) return -2;
        if (K % 32 || K % bv || (family(t) == FAM_F && K % 16)) return -3;
        if (parts[p].row_bytes != K / bv * block_bytes(t)) return -4;
    }
    return 0;
}

/* y[M, N] = x[M, K] @ W^T (+ bias[N]), W given as parts stacked along the output dimension.
 * Returns 0; -1 out of memory; -2 an unsupported type; -3 K not a multiple of the block size;
 * -4 a part's row size does not match its type and K. */

int gq_matmul(const gq_part *parts, int nparts, const float *x, int64_t M, int64_t K, const float *bias, float *y,
              int64_t N, int nthreads) {
    int rc = check_parts(parts, nparts, K);
    if (rc) return rc;
    int need32 = 0, needk = 0;
    int64_t total = 0;
    for (int p = 0; p < nparts; p++) {
        need32 |= family(parts[p].type) == FAM_32;
        needk |= family(parts[p].type) == FAM_K;
        total += parts[p].n;
    }
    if (total != N) return -4;
    const int64_t nb = K / 32, nsb = K / 256;
    xquant X;
    if ((rc = xquant_alloc(&X, M, K, need32, needk))) return rc;
    const int8_t *xq32 = X.q32, *xqk = X.qk;
    const float *xd32 = X.d32, *xs32 = X.s32, *xdk = X.dk;
    const int16_t *xbk = X.bk;
    int64_t ptiles = 0; /* 16-row tiles of packed parts, taken before the other rows */
    for (int p = 0; p < nparts; p++) ptiles += parts[p].packed ? parts[p].n / 16 : 0;
    if (nthreads < 1) nthreads = 1;
    if (N * K < (1 << 16)) nthreads = 1; /* not worth waking other threads */

    /* Tiles are handed out in runs of `chunk` as threads ask (a run's tiles are contiguous, so each thread still
     * streams whole runs): with a static split, a thread that the OS takes off its core for a while (other
     * processes on the cores) left the others waiting at the barrier with nothing to do. The output of a tile
     * does not depend on which thread computes it. */
    const int64_t chunk = ptiles / (16 * (int64_t)nthreads) > 1 ? ptiles / (16 * (int64_t)nthreads) : 1;

#pragma omp parallel num_threads(nthreads)
    {
        xquant_fill(&X, x, M, K);
#pragma omp for schedule(dynamic, chunk) nowait
        for (int64_t i = 0; i < ptiles; i++)
            packed_part_tile(parts, nparts, i, M, &X, K, bias, y, N);
        /* one decoded row per thread (u[K], sce[K/2], mn[K/16], d/dm[K/32], f[K]) for the rows not packed */
        const size_t bytes = (size_t)K + 64 + sizeof(int16_t) * (K / 2 + K / 16) + 2 * sizeof(float) * (K / 32) +
                             sizeof(float) * K + 256;
        char *mem = 16 * ptiles < N ? alloc64(bytes) : NULL;
        drow r;
        if (mem) {
            r.u = (uint8_t *)mem;
            r.sce = (int16_t *)(mem + ((K + 64 + 63) & ~(int64_t)63));
            r.mn = r.sce + K / 2;
            r.d = (float *)(r.mn + K / 16 + 16);
            r.dm = r.d + K / 32;
            r.f = r.dm + K / 32;
        } else if (16 * ptiles < N) {
#pragma omp atomic write
            rc = -1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < (16 * ptiles < N ? N : 0); g++) { /* the rows of the other parts */
            if (!mem) continue;
            int p = 0;
            int64_t off = 0;
            while (g - off >= parts[p].n) off += parts[p++].n;
            const gq_part *P = parts + p;
            if (P->packed) continue;
            const int64_t rr = g - off;
            const int t = P->type, fam = family(t);
            const uint8_t *wrow = P->w + rr * P->row_bytes;
            const int64_t col = off + (P->perm ? P->perm[rr] : rr);
            const float bv = bias ? bias[col] : 0.0f;
            const float *wf = r.f;
            const int raw = GQ_AVX2 && (t == Q4_K || t == Q6_K || fam == FAM_32); /* GQ_512 implies GQ_AVX2 */
            if (t == F32) wf = (const float *)wrow;
            else if (!raw) decode_row(t, wrow, K, &r);
            for (int64_t m0 = 0; m0 < M; m0 += MAXR) {
                const int mc = (int)(M - m0 < MAXR ? M - m0 : MAXR);
                float o[MAXR];
                if (raw) {
#if GQ_AVX2 /* dot_k_raw / dot_32_raw: the 512-bit or the 256-bit ones, whichever this build defines */
#define KR(R) dot_k_raw(R, t == Q6_K, wrow, nsb, xqk + m0 * K, K, xdk + m0 * nsb, xbk + m0 * (K / 16), o)
#define BR(R) dot_32_raw(R, t, wrow, nb, xq32 + m0 * K, K, xd32 + m0 * nb, xs32 + m0 * nb, o)
                    if (fam == FAM_32) {
                        ROW_SWITCH(mc, BR);
                    } else {
                        ROW_SWITCH(mc, KR);
                    }
#undef KR
#undef BR
#endif
                } else if (fam == FAM_K) {
#define KB(R) dot_k(R, &r, nsb, xqk + m0 * K, K, xdk + m0 * nsb, xbk + m0 * (K / 16), o)
                    ROW_SWITCH(mc, KB);
#undef KB
                } else if (fam == FAM_32) {
#define B32(R) dot_32(R, &r, nb, t == Q8_0, xq32 + m0 * K, K, xd32 + m0 * nb, xs32 + m0 * nb, o)
                    ROW_SWITCH(mc, B32);
#undef B32
                } else {
#define FB(R) dot_f(R, wf, x + m0 * K, K, o)
                    ROW_SWITCH(mc, FB);
#undef FB
                }
                for (int m = 0; m < mc; m++) y[(m0 + m) * N + col] = bias ? o[m] + bv : o[m];
            }
        }
        free(mem);
    }
    xquant_free(&X);
    return rc;
}

/* out[i, K] = row rows[i] of W (embedding lookups). Returns 0, or -2 for an unsupported type. */
int gq_dequant_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t K, const int64_t *rows, int64_t n,
                    float *out) {
    if (family(type) < 0) return -2;
    for (int64_t i = 0; i < n; i++) dequant_row(type, w + rows[i] * row_bytes, K, out + i * K);
    return 0;
}

/* out[r1 - r0, K] = rows r0 .. r1 - 1 of W, in float32 (bf16 = 0) or as their bf16 roundings (bf16 = 1: the
 * weights long passes multiply, written straight into the chunk torch multiplies, with no float32 copy).
 * Returns 0, -1 out of memory, -2 an unsupported type. */
int gq_dequant_range(int type, const uint8_t *w, int64_t row_bytes, int64_t K, int64_t r0, int64_t r1, void *out,
                     int bf16, int nthreads) {
    if (family(type) < 0) return -2;
    if (nthreads < 1) nthreads = 1;
    int rc = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *tmp = bf16 ? malloc(sizeof(float) * K) : NULL;
        if (bf16 && !tmp) {
#pragma omp atomic write
            rc = -1;
        }
#pragma omp for schedule(static)
        for (int64_t r = r0; r < r1; r++) {
            if (!bf16) {
                dequant_row(type, w + r * row_bytes, K, (float *)out + (r - r0) * K);
            } else if (tmp) {
#if GQ_512
                if (dequant_row_bf16_512(type, w + r * row_bytes, K, (uint16_t *)out + (r - r0) * K)) continue;
#endif
                dequant_row(type, w + r * row_bytes, K, tmp);
                uint16_t *o = (uint16_t *)out + (r - r0) * K;
                for (int64_t e = 0; e < K; e++) o[e] = to_bf16(tmp[e]);
            }
        }
        free(tmp);
    }
    return rc;
}

/* y[M, N] = x[M, K] @ W^T (+ bias[N]) for prompt passes (gq_gemm.h): parts as gq_matmul's, each of a type
 * gq_gemm_type accepts and a multiple of 16 rows. Returns gq_matmul's codes, or -5 where this build or these
 * parts cannot (the caller takes another route). Not batch-invariant: short passes use gq_matmul. */
int gq_gemm(const gq_part *parts, int nparts, const float *x, int64_t M, int64_t K, const float *bias, float *y,
            int64_t N, int nthreads) {
#if GQ_AVX2
    int rc = check_parts(parts, nparts, K);
    if (rc) return rc;
    int64_t total = 0, items = 0;
    int need32 = 0, needk = 0;
    const int64_t rows = 16 * TILES_PER_PASS;
    for (int p = 0; p < nparts; p++) {
        if (!gemm_type(parts[p].type) || parts[p].n % 16) return -5;
        need32 |= family(parts[p].type) == FAM_32;
        needk |= family(parts[p].type) == FAM_K;
        total += parts[p].n;
        items += (parts[p].n + rows - 1) / rows; /* work items: `rows` rows of a part, or its last 16 */
    }
    if (total != N) return -4;
    xquant X;
    if ((rc = xquant_alloc(&X, M, K, need32, needk))) return rc;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        xquant_fill(&X, x, M, K);
        /* 16 decoded rows (u[K], sce[K/2], mn[K/16], d/dm[K/32] each, rbytes apart) and the packed tiles */
        const size_t ubytes = ((size_t)K + 64 + 63) & ~(size_t)63; /* u and the loads' overrun, to sce */
        const size_t rbytes = (ubytes + sizeof(int16_t) * (K / 2 + K / 16 + 16) + 2 * sizeof(float) * (K / 32) + 63) & ~(size_t)63;
        char *mem = alloc64(16 * rbytes + TILES_PER_PASS * KTILE_BYTES(K));
        drow r[16];
        ktile kt[TILES_PER_PASS];
        if (mem) {
            for (int n = 0; n < 16; n++) {
                char *b = mem + n * rbytes;
                r[n].u = (uint8_t *)b;
                r[n].sce = (int16_t *)(b + ubytes);
                r[n].mn = r[n].sce + K / 2;
                r[n].d = (float *)(r[n].mn + K / 16 + 16);
                r[n].dm = r[n].d + K / 32;
                r[n].f = NULL;
            }
            for (int v = 0; v < TILES_PER_PASS; v++) ktile_at(kt + v, mem + 16 * rbytes + v * KTILE_BYTES(K), K);
        } else {
#pragma omp atomic write
            rc = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (!mem) continue;
            int p = 0;
            int64_t base = 0, off = 0;
            while (i - base >= (parts[p].n + rows - 1) / rows) { base += (parts[p].n + rows - 1) / rows; off += parts[p++].n; }
            const gq_part *P = parts + p;
            const int64_t r0 = rows * (i - base);
            const int tiles = P->n - r0 >= rows ? TILES_PER_PASS : 1;
            int64_t cols[32];
            for (int n = 0; n < 16 * tiles; n++) cols[n] = off + (P->perm ? P->perm[r0 + n] : r0 + n);
            for (int v = 0; v < tiles; v++) {
                if (P->packed) /* repacked: only unpacked here */
                    expand_tile(P->type, P->packed + (r0 / 16 + v) * packed_tile_bytes(P->type, K), K, kt + v);
                else
                    pack_tile(P->type, P->w + (r0 + 16 * v) * P->row_bytes, P->row_bytes, K, r, (int64_t)rbytes, kt + v);
            }
            gemm_tiles(P->type, tiles, kt, M, &X, K, bias, cols, !P->perm, y, N);
        }
        free(mem);
    }
    xquant_free(&X);
    return rc;
#else
    (void)parts; (void)nparts; (void)x; (void)M; (void)K; (void)bias; (void)y; (void)N; (void)nthreads;
    return -5;
#endif
}

/* Whether gq_gemm multiplies type t on this build. */
int gq_gemm_type(int t) {
#if GQ_AVX2
    return gemm_type(t);
#else
    (void)t;
    return 0;
#endif
}

/* out[gq_packed_bytes(t, n, K)] = the n rows of w (type t, row_bytes each) repacked (gq_packed.h, gq_packed32.h).
 * Returns 0, or -3 where the type, n, K or row_bytes do not fit (gq_packable). */
int gq_pack(int t, const uint8_t *w, int64_t n, int64_t row_bytes, int64_t K, uint8_t *out, int nthreads) {
    if (!packable(t, n, K) || row_bytes != K / block_values(t) * block_bytes(t)) return -3;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < n / 16; i++) pack_tiles(t, w, row_bytes, K, i, i + 1, out);
    return 0;
}

int gq_packable(int t, int64_t n, int64_t K) { return packable(t, n, K); }
int64_t gq_packed_bytes(int t, int64_t n, int64_t K) { return n / 16 * packed_tile_bytes(t, K); }

/* Which build this is: 3 AVX512-VNNI, 2 AVX-VNNI, 1 AVX2, 0 portable C. */
int gq_isa(void) { return GQ_512 ? 3 : GQ_VNNI ? 2 : GQ_AVX2 ? 1 : 0; }
