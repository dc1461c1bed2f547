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
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { T_F32 = 0, T_F16 = 1, T_Q8_0 = 8, T_Q2_K = 10, T_Q4_K = 12, T_IQ2_XXS = 16, T_BF16 = 30, T_MXFP4 = 39 };

typedef struct {
    const float *f16;         /* [65536] value of every half-precision bit pattern */
    const int8_t *iq2_signed; /* [32768][8] grid[g] * sign pattern k at row g * 128 + k */
    const float *mxfp4;       /* [16] doubled E2M1 values */
    const float *e8m0_half;   /* [256] 2^(e - 128) */
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
    case T_Q8_0: *block = 32; return q8_0;
    case T_Q2_K: *block = 256; return q2_k;
    case T_Q4_K: *block = 256; return q4_k;
    case T_IQ2_XXS: *block = 256; return iq2_xxs;
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
