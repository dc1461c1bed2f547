/* CPU kernels of the torch engine: exact dequantization of GGUF blocks, and a matrix-vector product that
 * dequantizes one weight row at a time into a small buffer (never the whole matrix).
 *
 * Decoding uses the float operations of ggml / gguf-py in the same order (compiled with -ffp-contract=off, so no
 * product is fused into an addition): every decoded value is bit-identical to gguf.quants.dequantize. The
 * lookup tables (f16 values, IQ2_XXS signed grid, MXFP4 values, E8M0 scales) are passed in by the caller, which
 * derives them from gguf-py. The dot products sum in a fixed order (two 16-lane partial sums over groups of 32
 * values, added lane by lane, then the tail), so a result does not depend on the thread that computes it; the order
 * differs from a BLAS sgemm's, which is the one tolerance this path adds (float32 rounding of a 4096-term sum).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSSE3__)
#include <immintrin.h>
#endif

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_Q8_K = 15, T_IQ2_XXS = 16, T_IQ2_XS = 17, T_IQ3_XXS = 18, T_IQ1_S = 19,
    T_IQ4_NL = 20, T_IQ3_S = 21, T_IQ2_S = 22, T_IQ4_XS = 23, T_IQ1_M = 29, T_BF16 = 30, T_TQ1_0 = 34, T_TQ2_0 = 35,
    T_MXFP4 = 39
};

typedef struct {
    const float *f16;         /* [65536] value of every half-precision bit pattern */
    const int8_t *iq2_signed; /* [32768][8] grid[g] * sign pattern k at row g * 128 + k */
    const float *mxfp4;       /* [16] doubled E2M1 values */
    const float *e8m0_half;   /* [256] 2^(e - 128) */
    const int8_t *iq2_xs;     /* [65536][8] grid[w & 511] * signs(ksigns[w >> 9]) at row w */
    const int8_t *iq2_s;      /* [1024 * 32][4] half h of grid row g times the signs of nibble s at g * 32 + h * 16 + s */
    const int8_t *iq3_xxs;    /* [256 * 16][4] grid row g times the signs of nibble s at g * 16 + s */
    const int8_t *iq3_s;      /* [512 * 16][4] the same for IQ3_S's grid */
    const float *iq1;         /* [4096][8] grid[g] + 1/8 at row g, grid[g] - 1/8 at row 2048 + g */
    const int8_t *iq4;        /* [16] IQ4_NL values */
    const float *tq1;         /* [256][5] the base-3 digits of byte b (as ggml extracts them) minus 1 at row b */
    const int32_t *ksigns;    /* [128] even-parity sign bytes */
} tables;

static inline uint16_t u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef uint64_t v2u64 __attribute__((vector_size(16)));
typedef uint8_t v16u8_unaligned __attribute__((vector_size(16), aligned(1)));

static inline v16u8 load16(const uint8_t *p) { return *(const v16u8_unaligned *)p; }

/* 16 bytes -> 16 floats. GCC scalarises a generic byte-to-float vector conversion, so x86 uses intrinsics. */
#if defined(__AVX512F__)
static inline v16 from_u8(v16u8 q) { return (v16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)q)); }
static inline v16 from_i8(v16u8 q) { return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)q)); }
#elif defined(__AVX2__)
static inline v16 halves(__m256 lo, __m256 hi) { v16 r; memcpy(&r, &lo, 32); memcpy((float *)&r + 8, &hi, 32); return r; }
static inline v16 from_u8(v16u8 q) {
    return halves(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32((__m128i)q)),
                  _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128((__m128i)q, 8))));
}
static inline v16 from_i8(v16u8 q) {
    return halves(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32((__m128i)q)),
                  _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128((__m128i)q, 8))));
}
#else
static inline v16 from_u8(v16u8 q) { v16 r; for (int j = 0; j < 16; j++) r[j] = (float)q[j]; return r; }
static inline v16 from_i8(v16u8 q) { v16 r; for (int j = 0; j < 16; j++) r[j] = (float)(int8_t)q[j]; return r; }
#endif

static inline v16 splat16(float a) { return (v16){a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; }
static inline void put16(float *o, v16 v) { memcpy(o, &v, 64); }

static void q8_0(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 34, o += 32) {
        const v16 d = splat16(t->f16[u16(b)]);
        for (int h = 0; h < 2; h++) {
            put16(o + 16 * h, from_i8(load16(b + 2 + 16 * h)) * d);
        }
    }
}

static void q2_k(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 84) {
        const uint8_t *sc = b, *qs = b + 16;
        const float d = t->f16[u16(b + 80)], dmin = t->f16[u16(b + 82)];
        for (int half = 0; half < 2; half++, qs += 32)
            for (int shift = 0; shift < 8; shift += 2)
                for (int part = 0; part < 2; part++, sc++, o += 16) {
                    const v16 f = from_u8((load16(qs + 16 * part) >> shift) & 3);
                    put16(o, splat16(d * (float)(*sc & 15)) * f - splat16(dmin * (float)(*sc >> 4)));
                }
    }
}

static void k4_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) { *sc = s[j] & 63; *m = s[j + 4] & 63; }
    else { *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

static void q4_k(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 144) {
        const float d = t->f16[u16(b)], dmin = t->f16[u16(b + 2)];
        const uint8_t *qs = b + 16;
        for (int j = 0; j < 8; j += 2, qs += 32, o += 64) {
            uint8_t s0, m0, s1, m1;
            k4_scale_min(b + 4, j, &s0, &m0);
            k4_scale_min(b + 4, j + 1, &s1, &m1);
            const v16 d0 = splat16(d * (float)s0), n0 = splat16(dmin * (float)m0);
            const v16 d1 = splat16(d * (float)s1), n1 = splat16(dmin * (float)m1);
            for (int h = 0; h < 2; h++) {
                const v16u8 q = load16(qs + 16 * h);
                put16(o + 16 * h, d0 * from_u8(q & 15) - n0);
                put16(o + 32 + 16 * h, d1 * from_u8(q >> 4) - n1);
            }
        }
    }
}

static void iq2_xxs(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 66) {
        const float d = t->f16[u16(b)];
        for (int g = 0; g < 8; g++) {
            const uint8_t *a = b + 2 + 8 * g;
            const uint32_t hi = u32(a + 4);
            const float s = d * (0.5f + (float)(hi >> 28)) * 0.25f;
            const v16 db = splat16(s);
            for (int l = 0; l < 4; l += 2, o += 16) {  /* two table rows (8 values each) per 16-lane vector */
                uint64_t r0, r1;
                memcpy(&r0, t->iq2_signed + 8 * (((uint32_t)a[l] << 7) | ((hi >> (7 * l)) & 127)), 8);
                memcpy(&r1, t->iq2_signed + 8 * (((uint32_t)a[l + 1] << 7) | ((hi >> (7 * l + 7)) & 127)), 8);
                const v16u8 v = (v16u8)(v2u64){r0, r1};
                put16(o, db * from_i8(v));
            }
        }
    }
}

static void mxfp4(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 17, o += 32) {
        const float d = t->e8m0_half[b[0]];
        for (int j = 0; j < 16; j++) {
            o[j] = d * t->mxfp4[b[1 + j] & 15];
            o[16 + j] = d * t->mxfp4[b[1 + j] >> 4];
        }
    }
}

typedef uint32_t v4u32 __attribute__((vector_size(16)));

/* table[idx[j]] for 16 indices below 16 (one pshufb on x86). */
static inline v16u8 lookup16(v16u8 table, v16u8 idx) {
#if defined(__SSSE3__)
    return (v16u8)_mm_shuffle_epi8((__m128i)table, (__m128i)idx);
#else
    v16u8 r;
    for (int j = 0; j < 16; j++) r[j] = table[idx[j]];
    return r;
#endif
}

static inline v16u8 splat8(uint8_t a) { return (v16u8){a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; }

/* Four 4-byte table rows side by side (16 int8 values). */
static inline v16u8 rows4(const int8_t *tab, int r0, int r1, int r2, int r3) {
    uint32_t w[4];
    memcpy(w, tab + 4 * r0, 4); memcpy(w + 1, tab + 4 * r1, 4); memcpy(w + 2, tab + 4 * r2, 4); memcpy(w + 3, tab + 4 * r3, 4);
    return (v16u8)(v4u32){w[0], w[1], w[2], w[3]};
}

/* Two 8-byte table rows side by side (16 int8 values). */
static inline v16u8 rows2(const int8_t *tab, int r0, int r1) {
    uint64_t a, c;
    memcpy(&a, tab + 8 * r0, 8); memcpy(&c, tab + 8 * r1, 8);
    return (v16u8)(v2u64){a, c};
}

static void q4_0(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 18, o += 32) {
        const v16 d = splat16(t->f16[u16(b)]);
        const v16u8 q = load16(b + 2);
        put16(o, d * from_i8((q & 15) - splat8(8)));       /* q - 8 wraps to its int8 value */
        put16(o + 16, d * from_i8((q >> 4) - splat8(8)));
    }
}

static void q4_1(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 20, o += 32) {
        const v16 d = splat16(t->f16[u16(b)]), m = splat16(t->f16[u16(b + 2)]);
        const v16u8 q = load16(b + 4);
        put16(o, d * from_u8(q & 15) + m);
        put16(o + 16, d * from_u8(q >> 4) + m);
    }
}

/* Q5_0 / Q5_1: the 5-bit codes of 16 values h (0: values 0-15, 1: 16-31), nibble | bit j of the 32-bit qh << 4. */
static inline v16u8 q5_codes(const uint8_t *qh, const uint8_t *qs, int h) {
    const v16u8 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8_t b0 = qh[2 * h], b1 = qh[2 * h + 1];
    const v16u8 hb = {b0, b0, b0, b0, b0, b0, b0, b0, b1, b1, b1, b1, b1, b1, b1, b1};
    const v16u8 q = load16(qs);
    return (h ? q >> 4 : q & 15) | ((v16u8)((hb & bit) != 0) & 16);
}

static void q5_0(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 22, o += 32) {
        const v16 d = splat16(t->f16[u16(b)]);
        for (int h = 0; h < 2; h++) put16(o + 16 * h, d * from_i8(q5_codes(b + 2, b + 6, h) - splat8(16)));
    }
}

static void q5_1(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 24, o += 32) {
        const v16 d = splat16(t->f16[u16(b)]), m = splat16(t->f16[u16(b + 2)]);
        for (int h = 0; h < 2; h++) put16(o + 16 * h, d * from_u8(q5_codes(b + 4, b + 8, h)) + m);
    }
}

static void q3_k(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 110) {
        const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
        const float d = t->f16[u16(b + 108)];
        for (int half = 0; half < 2; half++, qs += 32)
            for (int shift = 0; shift < 4; shift++) {
                const int plane = 4 * half + shift;  /* the hmask bit of these 32 values */
                for (int part = 0; part < 2; part++, o += 16) {
                    const int k = 2 * plane + part;  /* 16-value sub-block: a 6-bit scale, 4 bits low, 2 high */
                    const int low = (k < 8 ? sc[k] : sc[k - 8] >> 4) & 15, high = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
                    const float dl = d * (float)((low | (high << 4)) - 32);
                    const v16u8 ql = (load16(qs + 16 * part) >> (2 * shift)) & 3;
                    const v16u8 off = (((load16(hm + 16 * part) >> plane) & 1) ^ 1) << 2;  /* 4 where the bit is 0 */
                    put16(o, splat16(dl) * from_i8(ql - off));
                }
            }
    }
}

static void q5_k(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 176) {
        const float d = t->f16[u16(b)], dmin = t->f16[u16(b + 2)];
        const uint8_t *qh = b + 16, *qs = b + 48;
        for (int j = 0; j < 8; j++, o += 32) {  /* 32-value sub-block j: nibble j & 1 of qs[32 * (j / 2) ..], qh bit j */
            uint8_t s, m;
            k4_scale_min(b + 4, j, &s, &m);
            const v16 dl = splat16(d * (float)s), ml = splat16(dmin * (float)m);
            for (int h = 0; h < 2; h++) {
                const v16u8 q = load16(qs + 32 * (j / 2) + 16 * h);
                const v16u8 code = ((j & 1) ? q >> 4 : q & 15) | (((load16(qh + 16 * h) >> j) & 1) << 4);
                put16(o + 16 * h, dl * from_u8(code) - ml);
            }
        }
    }
}

static void q6_k(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 210, o += 256) {
        const float d = t->f16[u16(b + 208)];
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int half = 0; half < 2; half++)
            for (int p = 0; p < 2; p++) {  /* values l, l + 32, l + 64, l + 96 of the half, l = 16p .. 16p + 15 */
                const v16u8 a = load16(b + 64 * half + 16 * p), c = load16(b + 64 * half + 32 + 16 * p);
                const v16u8 h = load16(b + 128 + 32 * half + 16 * p);
                const v16u8 code[4] = {(a & 15) | ((h & 3) << 4), (c & 15) | (((h >> 2) & 3) << 4),
                                       (a >> 4) | (((h >> 4) & 3) << 4), (c >> 4) | ((h >> 6) << 4)};
                for (int k = 0; k < 4; k++) {
                    const int v = 128 * half + 32 * k + 16 * p;
                    put16(o + v, splat16(d * (float)sc[v / 16]) * from_i8(code[k] - splat8(32)));
                }
            }
    }
}

static void q8_k(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    (void)t;
    for (int64_t i = 0; i < nb; i++, b += 292) {
        float d;
        memcpy(&d, b, 4);
        const v16 dv = splat16(d);
        for (int h = 0; h < 16; h++, o += 16) put16(o, from_i8(load16(b + 4 + 16 * h)) * dv);
    }
}

static void tq1_0(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 54, o += 256) {
        const float d = t->f16[u16(b + 52)];
        for (int p = 0; p < 5; p++) {
            for (int j = 0; j < 32; j++) o[32 * p + j] = d * t->tq1[5 * b[j] + p];
            for (int j = 0; j < 16; j++) o[160 + 16 * p + j] = d * t->tq1[5 * b[32 + j] + p];
        }
        for (int p = 0; p < 4; p++)
            for (int j = 0; j < 4; j++) o[240 + 4 * p + j] = d * t->tq1[5 * b[48 + j] + p];
    }
}

static void tq2_0(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 66) {
        const v16 d = splat16(t->f16[u16(b + 64)]);
        for (int half = 0; half < 2; half++)
            for (int shift = 0; shift < 8; shift += 2)
                for (int part = 0; part < 2; part++, o += 16)
                    put16(o, d * from_i8(((load16(b + 32 * half + 16 * part) >> shift) & 3) - splat8(1)));
    }
}

static void iq4_nl(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    const v16u8 kv = load16((const uint8_t *)t->iq4);
    for (int64_t i = 0; i < nb; i++, b += 18, o += 32) {
        const v16 d = splat16(t->f16[u16(b)]);
        const v16u8 q = load16(b + 2);
        put16(o, d * from_i8(lookup16(kv, q & 15)));
        put16(o + 16, d * from_i8(lookup16(kv, q >> 4)));
    }
}

static void iq4_xs(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    const v16u8 kv = load16((const uint8_t *)t->iq4);
    for (int64_t i = 0; i < nb; i++, b += 136) {
        const float d = t->f16[u16(b)];
        const uint16_t sh = u16(b + 2);
        for (int g = 0; g < 8; g++, o += 32) {
            const int ls = ((b[4 + g / 2] >> (4 * (g & 1))) & 15) | (((sh >> (2 * g)) & 3) << 4);
            const v16 dl = splat16(d * (float)(ls - 32));
            const v16u8 q = load16(b + 8 + 16 * g);
            put16(o, dl * from_i8(lookup16(kv, q & 15)));
            put16(o + 16, dl * from_i8(lookup16(kv, q >> 4)));
        }
    }
}

/* db = d*(0.5+s)*0.25 for the 4-bit scale s of 16 values (IQ2_XS, IQ2_S), low nibble first. */
static inline float iq2_scale(float d, const uint8_t *scales, int k) {
    return d * (0.5f + (float)((scales[k / 2] >> (4 * (k & 1))) & 15)) * 0.25f;
}

static void iq2_xs(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 74) {
        const float d = t->f16[u16(b)];
        for (int l = 0; l < 32; l += 2, o += 16)  /* two 8-value code words per 16-value scale */
            put16(o, splat16(iq2_scale(d, b + 66, l / 2)) * from_i8(rows2(t->iq2_xs, u16(b + 2 + 2 * l), u16(b + 4 + 2 * l))));
    }
}

static void iq2_s(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 82) {
        const float d = t->f16[u16(b)];
        const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66;
        for (int l = 0; l < 32; l += 2, o += 16) {  /* 8 values per code byte l, as two half rows with sign nibbles */
            const int g0 = qs[l] | (((qh[l / 4] >> (2 * (l % 4))) & 3) << 8);
            const int g1 = qs[l + 1] | (((qh[l / 4] >> (2 * (l % 4) + 2)) & 3) << 8);
            const v16u8 v = rows4(t->iq2_s, 32 * g0 + (signs[l] & 15), 32 * g0 + 16 + (signs[l] >> 4),
                                  32 * g1 + (signs[l + 1] & 15), 32 * g1 + 16 + (signs[l + 1] >> 4));
            put16(o, splat16(iq2_scale(d, b + 74, l / 2)) * from_i8(v));
        }
    }
}

static void iq3_xxs(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 98) {
        const float d = t->f16[u16(b)];
        for (int g = 0; g < 8; g++) {
            const uint32_t w = u32(b + 66 + 4 * g);
            const v16 db = splat16(d * (0.5f + (float)(w >> 28)) * 0.5f);
            const uint8_t *q = b + 2 + 8 * g;
            for (int k = 0; k < 4; k += 2, o += 16) {  /* 8 values per 7-bit sign index k: two 4-value grid rows */
                const int s0 = t->ksigns[(w >> (7 * k)) & 127], s1 = t->ksigns[(w >> (7 * k + 7)) & 127];
                const v16u8 v = rows4(t->iq3_xxs, 16 * q[2 * k] + (s0 & 15), 16 * q[2 * k + 1] + (s0 >> 4),
                                      16 * q[2 * k + 2] + (s1 & 15), 16 * q[2 * k + 3] + (s1 >> 4));
                put16(o, db * from_i8(v));
            }
        }
    }
}

static void iq3_s(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 110) {
        const float d = t->f16[u16(b)];
        const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *scales = b + 106;
        for (int g = 0; g < 8; g++) {
            const v16 db = splat16(d * (float)(1 + 2 * ((scales[g / 2] >> (4 * (g & 1))) & 15)));
            for (int k = 8 * g; k < 8 * g + 8; k += 4, o += 16) {  /* 4 values per code byte k, its sign nibble */
                int r[4];
                for (int j = 0; j < 4; j++)
                    r[j] = 16 * (qs[k + j] | (((qh[(k + j) / 8] >> ((k + j) % 8)) & 1) << 8))
                         + ((signs[(k + j) / 2] >> (4 * ((k + j) & 1))) & 15);
                put16(o, db * from_i8(rows4(t->iq3_s, r[0], r[1], r[2], r[3])));
            }
        }
    }
}

/* o[0 .. 8) = s * row[0 .. 8): one IQ1 grid row (+- 1/8 included) times its scale. */
static inline void scaled8(float *o, const float *row, float s) { for (int j = 0; j < 8; j++) o[j] = s * row[j]; }

static void iq1_s(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 50) {
        const float d = t->f16[u16(b)];
        for (int g = 0; g < 8; g++) {
            const uint16_t h = u16(b + 34 + 2 * g);
            const float dl = d * (float)(2 * ((h >> 12) & 7) + 1);
            for (int k = 0; k < 4; k++, o += 8)
                scaled8(o, t->iq1 + 8 * (((h >> 15) << 11) | (((h >> (3 * k)) & 7) << 8) | b[2 + 4 * g + k]), dl);
        }
    }
}

static void iq1_m(const tables *t, const uint8_t *b, int64_t nb, float *o) {
    for (int64_t i = 0; i < nb; i++, b += 56) {
        const uint8_t *qs = b, *qh = b + 32, *sc = b + 48;
        const uint16_t w[4] = {u16(sc), u16(sc + 2), u16(sc + 4), u16(sc + 6)};
        const float d = t->f16[(w[0] >> 12) | ((w[1] >> 12) << 4) | ((w[2] >> 12) << 8) | ((w[3] >> 12) << 12)];
        for (int l = 0; l < 32; l++, o += 8) {  /* 8 values per code byte l; a 3-bit scale per 16 values */
            const int s = (w[l / 8] >> (3 * ((l / 2) % 4))) & 7;
            const int nib = (qh[l / 2] >> (4 * (l & 1))) & 15;
            scaled8(o, t->iq1 + 8 * (((nib >> 3) << 11) | ((nib & 7) << 8) | qs[l]), d * (float)(2 * s + 1));
        }
    }
}

static void f16(const tables *t, const uint8_t *b, int64_t n, float *o) {
    for (int64_t i = 0; i < n; i++) o[i] = t->f16[u16(b + 2 * i)];
}

static void bf16(const tables *t, const uint8_t *b, int64_t n, float *o) {
    (void)t;
    uint32_t *bits = (uint32_t *)o;  /* the file is compiled with -fno-strict-aliasing */
    for (int64_t i = 0; i < n; i++) bits[i] = (uint32_t)u16(b + 2 * i) << 16;
}

static void f32(const tables *t, const uint8_t *b, int64_t n, float *o) { (void)t; memcpy(o, b, 4 * n); }

typedef void (*decoder)(const tables *, const uint8_t *, int64_t, float *);

static decoder find(int type, int64_t *block) {
    switch (type) {
    case T_F32: *block = 1; return f32;
    case T_F16: *block = 1; return f16;
    case T_BF16: *block = 1; return bf16;
    case T_Q4_0: *block = 32; return q4_0;
    case T_Q4_1: *block = 32; return q4_1;
    case T_Q5_0: *block = 32; return q5_0;
    case T_Q5_1: *block = 32; return q5_1;
    case T_Q8_0: *block = 32; return q8_0;
    case T_Q2_K: *block = 256; return q2_k;
    case T_Q3_K: *block = 256; return q3_k;
    case T_Q4_K: *block = 256; return q4_k;
    case T_Q5_K: *block = 256; return q5_k;
    case T_Q6_K: *block = 256; return q6_k;
    case T_Q8_K: *block = 256; return q8_k;
    case T_IQ1_S: *block = 256; return iq1_s;
    case T_IQ1_M: *block = 256; return iq1_m;
    case T_IQ2_XXS: *block = 256; return iq2_xxs;
    case T_IQ2_XS: *block = 256; return iq2_xs;
    case T_IQ2_S: *block = 256; return iq2_s;
    case T_IQ3_XXS: *block = 256; return iq3_xxs;
    case T_IQ3_S: *block = 256; return iq3_s;
    case T_IQ4_NL: *block = 32; return iq4_nl;
    case T_IQ4_XS: *block = 256; return iq4_xs;
    case T_TQ1_0: *block = 256; return tq1_0;
    case T_TQ2_0: *block = 256; return tq2_0;
    case T_MXFP4: *block = 32; return mxfp4;
    default: return 0;
    }
}

/* out[0 .. n_values) = the values of n_values / block blocks at raw.  Returns 0, or -1 for an unknown type. */
int v4p_dequantize(const tables *t, int type, const uint8_t *raw, int64_t n_values, float *out) {
    int64_t block;
    decoder dec = find(type, &block);
    if (!dec) return -1;
    dec(t, raw, n_values / block, out);
    return 0;
}

/* sum_j a[j] * b[j], j < k: two 16-lane partial sums over full groups of 32, the lanes added in order, the tail. */
static float dot(const float *a, const float *b, int64_t k) {
    v16 s0 = splat16(0.0f), s1 = splat16(0.0f);
    int64_t j = 0;
    for (; j + 32 <= k; j += 32) {
        v16 a0, a1, b0, b1;
        memcpy(&a0, a + j, 64); memcpy(&a1, a + j + 16, 64);
        memcpy(&b0, b + j, 64); memcpy(&b1, b + j + 16, 64);
        s0 += a0 * b0; s1 += a1 * b1;
    }
    const v16 s = s0 + s1;
    float r = 0.0f;
    for (int step = 0; step < 16; step++) r += s[step];
    for (; j < k; j++) r += a[j] * b[j];
    return r;
}

/* y[i * ldy + r] = sum_j W[r, j] x[i * k + j] for rows r in [r0, r1) of a matrix of `row_bytes` bytes per row,
 * i < n.  Each row is decoded into a buffer of k floats and multiplied while it is in cache.
 * Returns 0, -1 for an unknown type, -2 when the row buffer cannot be allocated. */
int v4p_matvec(const tables *t, int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t k,
               const float *x, int64_t n, float *y, int64_t ldy) {
    int64_t block;
    decoder dec = find(type, &block);
    if (!dec) return -1;
    float *row = malloc(sizeof(float) * (size_t)k);
    if (!row) return -2;
    for (int64_t r = r0; r < r1; r++) {
        dec(t, w + r * row_bytes, k / block, row);
        for (int64_t i = 0; i < n; i++) y[i * ldy + r] = dot(row, x + i * k, k);
    }
    free(row);
    return 0;
}
