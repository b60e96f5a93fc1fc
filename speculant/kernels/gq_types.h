/* The GGML block types, the build's instruction sets, fp16 reads and prefetching.
 * Part of gq.c, included once into its one translation unit. */
#ifndef SPECULANT_GQ_TYPES_H
#define SPECULANT_GQ_TYPES_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#define GQ_AVX2 1
#else
#define GQ_AVX2 0
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GQ_512 1
#else
#define GQ_512 0
#endif
#if defined(__AVXVNNI__) || GQ_512
#define GQ_VNNI 1
#else
#define GQ_VNNI 0
#endif

enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
       Q5_K = 13, Q6_K = 14, BF16 = 30 };
enum { FAM_F = 0, FAM_32 = 1, FAM_K = 2 };
#define MAXR 8   /* activation rows per pass over a decoded weight row */

/* BODY(R) for R = mc (1..MAXR) activation rows as a compile-time constant */
#define ROW_SWITCH(mc, BODY)                                                                        \
    switch (mc) {                                                                                   \
    case 1: BODY(1); break;                                                                         \
    case 2: BODY(2); break;                                                                         \
    case 3: BODY(3); break;                                                                         \
    case 4: BODY(4); break;                                                                         \
    case 5: BODY(5); break;                                                                         \
    case 6: BODY(6); break;                                                                         \
    case 7: BODY(7); break;                                                                         \
    default: BODY(8); break;                                                                        \
    }


static int family(int t) {
    switch (t) {
    case F32: case F16: case BF16: return FAM_F;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return FAM_32;
    case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: return FAM_K;
    default: return -1;
    }
}

/* bytes per block and values per block of each type (gguf's GGML_QUANT_SIZES) */
static int block_bytes(int t) {
    switch (t) {
    case F32: return 4; case F16: return 2; case BF16: return 2;
    case Q4_0: return 18; case Q4_1: return 20; case Q5_0: return 22; case Q5_1: return 24; case Q8_0: return 34;
    case Q2_K: return 84; case Q3_K: return 110; case Q4_K: return 144; case Q5_K: return 176; case Q6_K: return 210;
    default: return 0;
    }
}
static int block_values(int t) {
    int f = family(t);
    return f == FAM_F ? 1 : f == FAM_32 ? 32 : f == FAM_K ? 256 : 0;
}


static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
#if defined(__F16C__)
static inline float rdh(const uint8_t *p) { return _cvtsh_ss(rd16(p)); } /* exact, as f16_to_f32 */
#else
static inline float rdh(const uint8_t *p) { return f16_to_f32(rd16(p)); }
#endif

/* Weights stream from memory once per token: each (super)block asks for the lines PREFETCH_AHEAD bytes
 * further on (the rows of a thread's share are contiguous). The hardware prefetcher alone left a decode
 * step short of the bandwidth; 2048 ahead was as good as any distance tried (docs/measurements.md "Kernel
 * choices"; `scripts/linear_timing.py` shows how close each tensor streams to memory speed). No effect on
 * results. */
#define PREFETCH_AHEAD 2048

/* Repacked tiles (gq_packed*.h) ask for the lines `ahead` bytes past a tile's superblock (block pair) as it
 * starts, into L2 (prefetcht1), not L1: prefetcht0 of a whole superblock at once (40-53 lines) made every
 * pass of several rows compute-starved (`scripts/linear_timing.py --rows 4`; docs/measurements.md "Kernel
 * choices"). Q6_K's tiles are 3392 bytes a superblock, so it looks 8192 ahead rather than 4096. The block-pair and
 * Q2_K/Q3_K tiles (gq_packed32.h, gq_packed2.h) ask this way; the Q4_K/Q5_K/Q6_K passes spread the same lines over
 * their loops (prefetch_spread). No effect on results. */
static inline __attribute__((always_inline)) void prefetch_tile(const uint8_t *o, int64_t bytes, int ahead) {
#if defined(__GNUC__)
    for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(o + ahead + l, 0, 2);
#else
    (void)o; (void)bytes; (void)ahead;
#endif
}

/* prefetch_tile's lines spread over a superblock's loop: at step g (0, 1, ...) lines 2g and 2g + 1 of the superblock
 * `ahead` bytes on, those within `bytes` (every line once over ceil(bytes / 128) steps). On the 256-bit builds a
 * burst of 37-53 prefetches at a superblock's start filled the core's miss buffers and stalled it until lines
 * arrived; asked for between the multiplies, the same lines stream faster: a Q6_K output layer at M = 1 about
 * twice the GB/s from memory (docs/measurements.md, issue 46). No effect on results. */
static inline __attribute__((always_inline)) void prefetch_spread(const uint8_t *o, int64_t bytes, int ahead, int g) {
#if defined(__GNUC__)
    if (128 * g < bytes) __builtin_prefetch(o + ahead + 128 * g, 0, 2);
    if (128 * g + 64 < bytes) __builtin_prefetch(o + ahead + 128 * g + 64, 0, 2);
#else
    (void)o; (void)bytes; (void)ahead; (void)g;
#endif
}

static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *b, int bytes) {
#if defined(__GNUC__)
    for (int l = 0; l < bytes; l += 64) __builtin_prefetch(b + PREFETCH_AHEAD + l, 0, 3);
#else
    (void)b; (void)bytes;
#endif
}


#endif /* SPECULANT_GQ_TYPES_H */
