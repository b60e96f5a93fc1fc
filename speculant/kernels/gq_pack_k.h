/* Q4_K, Q5_K and Q6_K rows repacked into gq_packed.h's 16-row tiles (at load; the layouts are described there).
 * Part of gq.c, included at the end of gq_packed.h. */
#ifndef SPECULANT_GQ_PACK_K_H
#define SPECULANT_GQ_PACK_K_H

/* Repacks rows 16i .. 16i + 15 of a Q4_K or Q5_K (type t) tensor w (row_bytes apart) for i in [t0, t1). */
static void pack_q4k_tiles(int t, const uint8_t *w, int64_t row_bytes, int64_t K, int64_t t0, int64_t t1,
                           uint8_t *out) {
    const int64_t nsb = K / 256, sbb = packed_sb_bytes(t), fb = t == Q5_K ? 176 : 144;
    const int q5 = t == Q5_K;
    for (int64_t ti = t0; ti < t1; ti++)
        for (int64_t sb = 0; sb < nsb; sb++) {
            uint8_t *o = out + (ti * nsb + sb) * sbb;
            if (q5) memset(o + P5_QH, 0, 512);
            for (int n = 0; n < 16; n++) {
                const uint8_t *b = w + (16 * ti + n) * row_bytes + sb * fb, *qs = b + (q5 ? 48 : 16);
                uint8_t sc[8], m[8], u[256];
                q4k_scales(b + 4, sc, m);
                for (int j = 0; j < 4; j++) /* value 64 j + l: low nibble of qs[32 j + l]; 64 j + 32 + l: high */
                    for (int l = 0; l < 32; l++) {
                        u[64 * j + l] = qs[32 * j + l] & 15;
                        u[64 * j + 32 + l] = qs[32 * j + l] >> 4;
                    }
                if (q5) /* as decode_k: bit i of qh[l] is the fifth bit of value 32 i + l */
                    for (int i = 0; i < 8; i++)
                        for (int l = 0; l < 32; l++) u[32 * i + l] |= ((b[16 + l] >> i) & 1) << 4;
                for (int g = 0; g < 32; g++)
                    for (int i = 0; i < 4; i++) {
                        const int lo = u[4 * g + i], hi = u[128 + 4 * g + i];
                        o[64 * g + 4 * n + i] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
                        if (q5)
                            o[P5_QH + 64 * (g / 4) + 4 * n + i] |= (uint8_t)(((lo >> 4) << (g % 4)) | ((hi >> 4) << (4 + g % 4)));
                    }
                for (int j = 0; j < 8; j++) o[PK_SC + 16 * j + n] = sc[j];
                for (int j = 0; j < 8; j++) o[PK_MN + 32 * (j / 2) + 2 * n + j % 2] = m[j];
                memcpy(o + PK_D + 2 * n, b, 2); /* the file's fp16 d and dmin */
                memcpy(o + PK_DM + 2 * n, b + 2, 2);
            }
        }
}

/* The same for Q6_K (the layout above). */
static void pack_q6k_tiles(const uint8_t *w, int64_t row_bytes, int64_t K, int64_t t0, int64_t t1, uint8_t *out) {
    const int64_t nsb = K / 256;
    static const int field_shift[4] = {4, 6, 0, 2};
    for (int64_t t = t0; t < t1; t++)
        for (int64_t sb = 0; sb < nsb; sb++) {
            uint8_t *o = out + (t * nsb + sb) * PACK6_SB_BYTES;
            memset(o + P6_QH, 0, 1024);
            for (int n = 0; n < 16; n++) {
                const uint8_t *b = w + (16 * t + n) * row_bytes + sb * 210, *ql = b, *qh = b + 128;
                uint8_t u[256];
                for (int a = 0; a < 2; a++) /* as decode_k */
                    for (int h = 0; h < 2; h++)
                        for (int j = 0; j < 2; j++)
                            for (int l = 0; l < 32; l++)
                                u[128 * a + 64 * h + 32 * j + l] = ((ql[64 * a + 32 * j + l] >> (4 * h)) & 0xf) |
                                                                   (((qh[32 * a + l] >> (2 * (2 * h + j))) & 3) << 4);
                for (int g = 0; g < 32; g++)
                    for (int i = 0; i < 4; i++) {
                        o[64 * g + 4 * n + i] = (uint8_t)((u[4 * g + i] & 15) | ((u[128 + 4 * g + i] & 15) << 4));
                        const int f = g % 4, hl = g / 4, hh = 8 + g / 4;
                        o[P6_QH + 64 * hl + 4 * n + i] |= (uint8_t)((u[4 * g + i] >> 4) << field_shift[f]);
                        o[P6_QH + 64 * hh + 4 * n + i] |= (uint8_t)((u[128 + 4 * g + i] >> 4) << field_shift[f]);
                    }
                for (int g = 0; g < 16; g++) o[P6_SC + 16 * g + n] = b[192 + g];
                const float d = rdh(b + 208);
                memcpy(o + P6_D + 4 * n, &d, 4);
            }
        }
}

#endif /* SPECULANT_GQ_PACK_K_H */
