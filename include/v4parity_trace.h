/* v4parity_trace.h - write a v4parity trace (docs/trace-format.md, version 1) from C99, libc only.
 *
 * Single header (link with -lm): in exactly one .c file
 *     #define V4P_TRACE_IMPLEMENTATION
 *     #include "v4parity_trace.h"
 * and include it without the macro everywhere else.
 *
 * What it writes: the text trace (header block, one `ckpt` line per (checkpoint, position) with min, max, rms,
 * l2s, sum_l2, the 64-number fingerprint and, on final_norm, argmax + top-K, all computed here from the vector
 * exactly as the format defines them), and the side file `<stem>.vectors.npz` holding `positions` and the full
 * vectors (one float32 .npy per name in `full`, rows in header position order) plus any extra array you add
 * (the sub-op records `subop.<l>.<name>`), as an uncompressed ("stored") zip with CRC-32s written here: no zlib,
 * no zip program. The side file carries `trace_sha256` (the sha256 of the trace bytes, computed here) and is
 * renamed into place before the trace, so the reader never pairs a trace with another run's side file.
 *
 *     v4p_header h = {...};                   fill every field (see the struct)
 *     v4p_trace *t = v4p_open("run.trace", &h, err, sizeof err);
 *     v4p_ckpt(t, "blk.3", pos, x, NULL, 0);  x: H x D floats (stream-major), D for final_norm
 *     v4p_ckpt(t, "final_norm", pos, norm, logits, vocab);
 *     v4p_vector(t, "logits", pos, logits, vocab);          only if "logits" is in h.full
 *     v4p_hc(...), v4p_moe(...), v4p_attn(...)              optional per-layer diagnostic lines
 *     v4p_array(t, "subop.0.q_path", "<f4", shape, 3, data); whole arrays, e.g. sub-op records
 *     v4p_spec(t, start_pos, drafts, k, gamma, cut, verify, accepted, conf);  one line per speculative round
 *     v4p_close(t, err, sizeof err);          writes the side file, then renames it and the trace into place
 *
 * Trunk checkpoints only (embed, blk.L.attn, blk.L, final_norm); draft checkpoints (mtp.*, dspark.*) are refused.
 * A trace of spec records alone: n_checkpoints = n_positions = 0 (no full vectors, no sub-op records, no v4p_ckpt).
 * Every function returns 0 on success, -1 on error (v4p_open: NULL); v4p_close reports the first error of the
 * whole session in `err`. Little-endian hosts only (the .npy members are written as "<f4" / "<i4" / "<i8").
 * Record lines come out in the order you call v4p_ckpt (the reader accepts any order; v4parity's own writer
 * sorts by checkpoint, then position). Sizes are limited to what a zip without zip64 holds (< 4 GiB per file).
 */
#ifndef V4PARITY_TRACE_H
#define V4PARITY_TRACE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const char *engine;              /* one word */
    const char *engine_version;      /* free text, no newline */
    int64_t model_size;              /* bytes over all shards */
    const char *model_header_sha256; /* 32 hex digits (docs/trace-format.md "Model identity") */
    const char *model_data_sha256;   /* 32 hex digits, or NULL (no model_data line) */
    const char *model_file;          /* file name, no spaces */
    const char *dtype;               /* e.g. "float32" */
    int n_layers;                    /* L: spec index k of blk.l is l + 1, of final_norm L + 1 */
    int n_hc, dim, top_k;            /* H, D, K */
    const int32_t *tokens; int n_tokens;
    int n_prompt;
    const int32_t *chunks; int n_chunks;
    int decode;
    const int32_t *positions; int n_positions;   /* ascending; 0 (and no checkpoints): spec records alone */
    const char *const *checkpoints; int n_checkpoints;
    const char *const *full; int n_full;         /* names whose full vectors go to the side file (may hold "logits") */
    const char *const *subops; int n_subops;     /* sub-op record names for the `subops` line (0: no line) */
    const char *flags_json;          /* one-line JSON object, keys sorted, no spaces: "{}" at least */
} v4p_header;

typedef struct v4p_trace v4p_trace;

/* fp[k] = (1/8) sum_i s(k, i) x[i], s from splitmix64 (docs/trace-format.md "The fingerprint"). */
void v4p_fingerprint(const float *x, uint64_t n, float fp[64]);

v4p_trace *v4p_open(const char *trace_path, const v4p_header *h, char *err, size_t errlen);
/* One ckpt record: x holds the checkpoint's vector (H x D for carriers, D for final_norm); for final_norm pass
 * the logits (vocab entries) for argmax and top-K, else NULL / 0. Stores x as the full vector when listed. */
int v4p_ckpt(v4p_trace *t, const char *name, int pos, const float *x, const float *logits, int vocab);
/* Per-layer diagnostics (docs/trace-format.md "Text form"): the HC mix of layer's attention (sub 0) or FFN (sub 1)
 * half: pre[H], post[H], comb[H*H] row-major; the router's k picks in selection order, their weights and margin
 * (NAN: not recorded); the indexer's selection sel[n_sel] (-1 padding), or n_sel < 0 on a layer without one. */
int v4p_hc(v4p_trace *t, int layer, int sub, int pos, const float *pre, const float *post, const float *comb);
int v4p_moe(v4p_trace *t, int layer, int pos, const int32_t *ids, const float *w, int k, float margin);
int v4p_attn(v4p_trace *t, int layer, int pos, int n_comp, const int32_t *sel, int n_sel);
/* The full vector `name` (a name in h.full) at position pos: n floats. */
int v4p_vector(v4p_trace *t, const char *name, int pos, const float *x, size_t n);
/* A whole extra array `<member>.npy` in the side file: descr "<f4", "<i4" or "<i8", shape of ndim dims. */
int v4p_array(v4p_trace *t, const char *member, const char *descr, const int64_t *shape, int ndim, const void *data);
/* One speculative round, in order (docs/trace-format.md "Spec records"): the anchor's position start_pos (the first
 * round's is n_prompt, each next one the previous start_pos + accepted + 1), the k >= 0 drafts (cut ones too), gamma of
 * them verified (cut: "-" or NULL exactly when gamma == k, else "gate", "max-draft" or "budget"), the gamma + 1 verify
 * argmaxes, accepted = a' (the greedy rule's: checked), conf: the k DSpark confidence logits or NULL. The committed
 * drafts and bonus must be the header's tokens. */
int v4p_spec(v4p_trace *t, int start_pos, const int32_t *drafts, int k, int gamma, const char *cut,
             const int32_t *verify, int accepted, const float *conf);
int v4p_close(v4p_trace *t, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* V4PARITY_TRACE_H */

#ifdef V4P_TRACE_IMPLEMENTATION
#ifndef V4P_TRACE_IMPLEMENTED
#define V4P_TRACE_IMPLEMENTED

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define V4P_FP_SEED 0x7634706172697479ull  /* "v4parity" */
#define V4P_MAX_MEMBERS 4096

static uint64_t v4p_splitmix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void v4p_fingerprint(const float *x, uint64_t n, float fp[64]) {
    uint64_t k, i;
    for (k = 0; k < 64; k++) {
        double acc = 0.0;
        for (i = 0; i < n; i++)
            acc += (v4p_splitmix64(V4P_FP_SEED + k * n + i) >> 63) ? -(double)x[i] : (double)x[i];
        fp[k] = (float)(acc / 8.0);
    }
}

/* ---- SHA-256 (FIPS 180-4), for the side file's trace_sha256 ---- */
typedef struct { uint32_t h[8]; unsigned char buf[64]; uint64_t len; size_t fill; } v4p_sha256;
static const uint32_t v4p_sha_k[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
    0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
    0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
    0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
    0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
    0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
    0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u};
#define V4P_ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))
static void v4p_sha_block(v4p_sha256 *c, const unsigned char *p) {
    uint32_t w[64], a, b, d, e, f, g, hh, cc, t1, t2;
    int i;
    for (i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (i = 16; i < 64; i++) {
        uint32_t s0 = V4P_ROR(w[i - 15], 7) ^ V4P_ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = V4P_ROR(w[i - 2], 17) ^ V4P_ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = c->h[0]; b = c->h[1]; cc = c->h[2]; d = c->h[3]; e = c->h[4]; f = c->h[5]; g = c->h[6]; hh = c->h[7];
    for (i = 0; i < 64; i++) {
        t1 = hh + (V4P_ROR(e, 6) ^ V4P_ROR(e, 11) ^ V4P_ROR(e, 25)) + ((e & f) ^ (~e & g)) + v4p_sha_k[i] + w[i];
        t2 = (V4P_ROR(a, 2) ^ V4P_ROR(a, 13) ^ V4P_ROR(a, 22)) + ((a & b) ^ (a & cc) ^ (b & cc));
        hh = g; g = f; f = e; e = d + t1; d = cc; cc = b; b = a; a = t1 + t2;
    }
    c->h[0] += a; c->h[1] += b; c->h[2] += cc; c->h[3] += d; c->h[4] += e; c->h[5] += f; c->h[6] += g; c->h[7] += hh;
}
static void v4p_sha_init(v4p_sha256 *c) {
    static const uint32_t h0[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                   0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    memcpy(c->h, h0, sizeof h0);
    c->len = 0; c->fill = 0;
}
static void v4p_sha_update(v4p_sha256 *c, const unsigned char *p, size_t n) {
    c->len += n;
    while (n) {
        size_t take = 64 - c->fill < n ? 64 - c->fill : n;
        memcpy(c->buf + c->fill, p, take);
        c->fill += take; p += take; n -= take;
        if (c->fill == 64) { v4p_sha_block(c, c->buf); c->fill = 0; }
    }
}
static void v4p_sha_hex(v4p_sha256 *c, char hex[65]) {
    unsigned char pad[72];
    uint64_t bits = c->len * 8;
    size_t n = (c->fill < 56 ? 56 : 120) - c->fill;
    int i;
    memset(pad, 0, sizeof pad);
    pad[0] = 0x80;
    for (i = 0; i < 8; i++) pad[n + (size_t)i] = (unsigned char)(bits >> (56 - 8 * i));
    v4p_sha_update(c, pad, n + 8);
    for (i = 0; i < 8; i++) sprintf(hex + 8 * i, "%08lx", (unsigned long)c->h[i]);
}

/* ---- CRC-32 (zip's polynomial 0xEDB88320) ---- */
static uint32_t v4p_crc_table[256];
static int v4p_crc_ready = 0;
static uint32_t v4p_crc32(uint32_t crc, const unsigned char *p, size_t n) {
    size_t i;
    if (!v4p_crc_ready) {
        uint32_t c; int j; unsigned b;
        for (b = 0; b < 256; b++) {
            c = b;
            for (j = 0; j < 8; j++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            v4p_crc_table[b] = c;
        }
        v4p_crc_ready = 1;
    }
    crc = ~crc;
    for (i = 0; i < n; i++) crc = v4p_crc_table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return ~crc;
}

typedef struct {
    char name[256];
    FILE *data;           /* temp file holding the member's bytes (.npy header + data) */
    uint64_t size;
    int full_index;       /* >= 0: full vector of h.full[full_index] (rows written at any time) */
    uint64_t row_bytes;   /* full vectors: bytes of one row */
    long data_at;         /* full vectors: offset of row 0 in `data` */
    unsigned char *written;   /* full vectors: which rows were written */
} v4p_member;

struct v4p_trace {
    v4p_header h;
    char path[4096], tmp[4200], side[4200], side_tmp[4300];
    FILE *text;
    v4p_member *members; int n_members;
    char err[512];
    int n_spec, spec_next;           /* spec rounds written; the next round's start position */
    uint64_t sign_n[4], *signs[4];   /* cached fingerprint signs per vector length: bit k of signs[i] = s(k, i) < 0 */
};

static int v4p_fail(v4p_trace *t, const char *fmt, ...) {
    if (!t->err[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(t->err, sizeof t->err, fmt, ap);
        va_end(ap);
    }
    return -1;
}

static void v4p_put_le(unsigned char *p, uint64_t v, int n) {
    int i;
    for (i = 0; i < n; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* A .npy header (format 1.0) for `descr` and `shape`, padded so preamble + dict + '\n' is a multiple of 64. */
static int v4p_npy_header(unsigned char *out, size_t cap, const char *descr, const int64_t *shape, int ndim) {
    char dict[512], dims[400];
    int n = 0, i, pad, hlen;
    dims[0] = 0;
    for (i = 0; i < ndim; i++)
        n += snprintf(dims + n, sizeof dims - (size_t)n, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (ndim == 1) snprintf(dims + n, sizeof dims - (size_t)n, ",");
    n = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }", descr, dims);
    pad = 63 - (10 + n) % 64;
    hlen = n + pad + 1;
    if ((size_t)(10 + hlen) > cap) return -1;
    memcpy(out, "\x93NUMPY\x01\x00", 8);
    out[8] = (unsigned char)(hlen & 0xff); out[9] = (unsigned char)(hlen >> 8);
    memcpy(out + 10, dict, (size_t)n);
    memset(out + 10 + n, ' ', (size_t)pad);
    out[10 + hlen - 1] = '\n';
    return 10 + hlen;
}

static v4p_member *v4p_add_member(v4p_trace *t, const char *name, const char *descr, const int64_t *shape,
                                  int ndim, uint64_t item) {
    unsigned char head[600];
    int hn;
    v4p_member *m;
    int i;
    uint64_t count = 1;
    for (i = 0; i < t->n_members; i++)
        if (!strcmp(t->members[i].name + 0, name)) { v4p_fail(t, "side-file member %s written twice", name); return NULL; }
    if (t->n_members == V4P_MAX_MEMBERS) { v4p_fail(t, "more than %d side-file members", V4P_MAX_MEMBERS); return NULL; }
    if (strlen(name) + 5 > sizeof m->name) { v4p_fail(t, "member name too long: %.40s...", name); return NULL; }
    m = &t->members[t->n_members];
    memset(m, 0, sizeof *m);
    snprintf(m->name, sizeof m->name, "%s.npy", name);
    m->full_index = -1;
    hn = v4p_npy_header(head, sizeof head, descr, shape, ndim);
    if (hn < 0) { v4p_fail(t, "member %s: shape too long", name); return NULL; }
    for (i = 0; i < ndim; i++) count *= (uint64_t)shape[i];
    m->data = tmpfile();
    if (!m->data) { v4p_fail(t, "member %s: cannot create a temp file", name); return NULL; }
    if (fwrite(head, 1, (size_t)hn, m->data) != (size_t)hn) { v4p_fail(t, "member %s: write failed", name); return NULL; }
    m->data_at = hn;
    m->size = (uint64_t)hn + count * item;
    if (m->size >= 0xFFFFFFFFull) { v4p_fail(t, "member %s: %llu bytes, beyond a zip without zip64", name,
                                             (unsigned long long)m->size); return NULL; }
    t->n_members++;
    return m;
}

static int v4p_write_data(v4p_trace *t, v4p_member *m, uint64_t at, const void *p, size_t n) {
    if (fseek(m->data, (long)(m->data_at + (long)at), SEEK_SET) || fwrite(p, 1, n, m->data) != n)
        return v4p_fail(t, "member %s: write failed", m->name);
    return 0;
}

static int v4p_is_full_dims(const v4p_trace *t, const char *name, int64_t *shape, int *ndim) {
    shape[0] = t->h.n_positions;
    if (!strcmp(name, "logits")) { *ndim = 2; shape[1] = -1; return 1; }   /* vocab: known at the first row */
    if (!strcmp(name, "final_norm")) { *ndim = 2; shape[1] = t->h.dim; return 1; }
    *ndim = 3; shape[1] = t->h.n_hc; shape[2] = t->h.dim;
    return 1;
}

/* embed, final_norm, blk.L or blk.L.attn with L in [0, n_layers) written without leading zeros. */
static int v4p_trunk_name(const char *name, int n_layers) {
    const char *p = name + 4;
    long l = 0;
    if (!strcmp(name, "embed") || !strcmp(name, "final_norm")) return 1;
    if (strncmp(name, "blk.", 4) || *p < '0' || *p > '9' || (p[0] == '0' && p[1] >= '0' && p[1] <= '9')) return 0;
    while (*p >= '0' && *p <= '9' && l < 100000) l = 10 * l + (*p++ - '0');
    return l < n_layers && (!*p || !strcmp(p, ".attn"));
}

v4p_trace *v4p_open(const char *trace_path, const v4p_header *h, char *err, size_t errlen) {
    v4p_trace *t = (v4p_trace *)calloc(1, sizeof *t);
    const char *dot, *slash;
    int i;
    if (!t) { if (err && errlen) snprintf(err, errlen, "out of memory"); return NULL; }
    t->h = *h;
    t->members = (v4p_member *)calloc(V4P_MAX_MEMBERS, sizeof *t->members);
    if (!t->members) { v4p_fail(t, "out of memory"); goto fail; }
    if (!h->engine || !h->engine_version || !h->model_header_sha256 || !h->model_file || !h->dtype ||
        !h->flags_json || !h->tokens || !h->chunks || (!h->positions && h->n_positions) ||
        (!h->checkpoints && h->n_checkpoints)) {
        v4p_fail(t, "v4p_header: a required field is NULL (engine, engine_version, model_header_sha256, "
                 "model_file, dtype, flags_json, tokens, chunks, positions, checkpoints)");
        goto fail;
    }
    if (h->n_hc < 1 || h->dim < 1 || h->top_k < 1 || h->n_layers < 1 || h->n_positions < 0 ||
        (h->n_positions < 1) != (h->n_checkpoints < 1)) {
        v4p_fail(t, "v4p_header: n_hc, dim, top_k and n_layers must be >= 1, n_positions and n_checkpoints both >= 1 "
                 "(or both 0: spec records alone)");
        goto fail;
    }
    if (!h->n_positions && (h->n_full || h->n_subops)) {
        v4p_fail(t, "v4p_header: a trace of spec records alone has no full vectors or sub-op records");
        goto fail;
    }
    t->spec_next = h->n_prompt;
    if (h->n_hc > 64) { v4p_fail(t, "v4p_header: n_hc %d > 64", h->n_hc); goto fail; }
    for (i = 0; i < h->n_checkpoints; i++)
        if (!v4p_trunk_name(h->checkpoints[i], h->n_layers)) {
            v4p_fail(t, "v4p_header: checkpoint '%.40s' is not embed, blk.L.attn, blk.L (L < n_layers) or final_norm "
                     "(draft checkpoints are not written by this header)", h->checkpoints[i]);
            goto fail;
        }
    for (i = 0; i < h->n_full; i++) {
        int c, listed = !strcmp(h->full[i], "logits");
        for (c = 0; c < h->n_checkpoints; c++) listed |= !strcmp(h->checkpoints[c], h->full[i]);
        if (!listed) { v4p_fail(t, "v4p_header: full '%.40s' is neither a checkpoint nor logits", h->full[i]); goto fail; }
    }
    if (strlen(trace_path) >= sizeof t->path) { v4p_fail(t, "trace path too long"); goto fail; }
    strcpy(t->path, trace_path);
    snprintf(t->tmp, sizeof t->tmp, "%s.v4p-tmp", trace_path);
    slash = strrchr(trace_path, '/');
    dot = strrchr(slash ? slash : trace_path, '.');
    if (dot) snprintf(t->side, sizeof t->side, "%.*s.vectors.npz", (int)(dot - trace_path), trace_path);
    else snprintf(t->side, sizeof t->side, "%s.vectors.npz", trace_path);
    snprintf(t->side_tmp, sizeof t->side_tmp, "%s.v4p-tmp", t->side);
    if (!strcmp(t->side, t->path)) { v4p_fail(t, "%s: the trace and its side file would share a name", trace_path); goto fail; }
    t->text = fopen(t->tmp, "wb");
    if (!t->text) { v4p_fail(t, "%s: cannot open for writing", t->tmp); goto fail; }
    fprintf(t->text, "v4parity-trace 1\nengine %s %s\nmodel %lld %s %s\n", h->engine, h->engine_version,
            (long long)h->model_size, h->model_header_sha256, h->model_file);
    if (h->model_data_sha256) fprintf(t->text, "model_data %s\n", h->model_data_sha256);
    fprintf(t->text, "dtype %s\nhc %d\ndim %d\ntop_k %d\ntokens", h->dtype, h->n_hc, h->dim, h->top_k);
    for (i = 0; i < h->n_tokens; i++) fprintf(t->text, " %d", (int)h->tokens[i]);
    fprintf(t->text, "\nn_prompt %d\nchunks", h->n_prompt);
    for (i = 0; i < h->n_chunks; i++) fprintf(t->text, " %d", (int)h->chunks[i]);
    fprintf(t->text, "\ndecode %d\npositions", h->decode);
    for (i = 0; i < h->n_positions; i++) fprintf(t->text, " %d", (int)h->positions[i]);
    fprintf(t->text, "\ncheckpoints");
    for (i = 0; i < h->n_checkpoints; i++) fprintf(t->text, " %s", h->checkpoints[i]);
    fprintf(t->text, "\nfull");
    if (!h->n_full) fprintf(t->text, " -");
    for (i = 0; i < h->n_full; i++) fprintf(t->text, " %s", h->full[i]);
    if (h->n_subops) {
        fprintf(t->text, "\nsubops");
        for (i = 0; i < h->n_subops; i++) fprintf(t->text, " %s", h->subops[i]);
    }
    fprintf(t->text, "\nflags %s\nend\n", h->flags_json);
    if (h->n_full || h->n_subops) {
        int64_t shape[3];
        int ndim;
        int64_t one = h->n_positions;
        v4p_member *m = v4p_add_member(t, "positions", "<i8", &one, 1, 8);
        if (!m) goto fail;
        for (i = 0; i < h->n_positions; i++) {
            int64_t p = h->positions[i];
            if (v4p_write_data(t, m, (uint64_t)i * 8, &p, 8)) goto fail;
        }
        for (i = 0; i < h->n_full; i++) {
            v4p_is_full_dims(t, h->full[i], shape, &ndim);
            if (shape[1] < 0) continue;   /* logits: created at its first row */
            m = v4p_add_member(t, h->full[i], "<f4", shape, ndim, 4);
            if (!m) goto fail;
            m->full_index = i;
            m->row_bytes = (uint64_t)shape[1] * (ndim == 3 ? (uint64_t)shape[2] : 1) * 4;
            m->written = (unsigned char *)calloc((size_t)h->n_positions, 1);
            if (!m->written) { v4p_fail(t, "out of memory"); goto fail; }
        }
    }
    return t;
fail:
    if (err && errlen) snprintf(err, errlen, "%s", t->err);
    v4p_close(t, NULL, 0);
    return NULL;
}

static int v4p_row(const v4p_trace *t, int pos) {
    int i;
    for (i = 0; i < t->h.n_positions; i++)
        if (t->h.positions[i] == pos) return i;
    return -1;
}

static v4p_member *v4p_find(v4p_trace *t, const char *npy_name) {
    int i;
    for (i = 0; i < t->n_members; i++)
        if (!strncmp(t->members[i].name, npy_name, strlen(npy_name)) && !strcmp(t->members[i].name + strlen(npy_name), ".npy"))
            return &t->members[i];
    return NULL;
}

int v4p_vector(v4p_trace *t, const char *name, int pos, const float *x, size_t n) {
    int row = v4p_row(t, pos), i, listed = 0;
    v4p_member *m;
    for (i = 0; i < t->h.n_full; i++) listed |= !strcmp(t->h.full[i], name);
    if (!listed) return v4p_fail(t, "v4p_vector: %s is not in the header's full list", name);
    if (row < 0) return v4p_fail(t, "v4p_vector: position %d is not in the header's positions", pos);
    m = v4p_find(t, name);
    if (!m && !strcmp(name, "logits")) {
        int64_t shape[2];
        shape[0] = t->h.n_positions; shape[1] = (int64_t)n;
        m = v4p_add_member(t, name, "<f4", shape, 2, 4);
        if (!m) return -1;
        m->full_index = 0;
        m->row_bytes = (uint64_t)n * 4;
        m->written = (unsigned char *)calloc((size_t)t->h.n_positions, 1);
        if (!m->written) return v4p_fail(t, "out of memory");
    }
    if (!m) return v4p_fail(t, "v4p_vector: no member for %s", name);
    if ((uint64_t)n * 4 != m->row_bytes)
        return v4p_fail(t, "v4p_vector: %s at position %d: %zu floats, expected %llu", name, pos, n,
                        (unsigned long long)(m->row_bytes / 4));
    if (m->written[row]) return v4p_fail(t, "v4p_vector: %s at position %d written twice", name, pos);
    m->written[row] = 1;
    return v4p_write_data(t, m, (uint64_t)row * m->row_bytes, x, n * 4);
}

int v4p_array(v4p_trace *t, const char *member, const char *descr, const int64_t *shape, int ndim,
              const void *data) {
    v4p_member *m;
    uint64_t count = 1;
    int i;
    if (strcmp(descr, "<f4") && strcmp(descr, "<i4") && strcmp(descr, "<i8"))
        return v4p_fail(t, "v4p_array %s: descr %s (use <f4, <i4 or <i8)", member, descr);
    if (ndim < 1 || ndim > 8) return v4p_fail(t, "v4p_array %s: ndim %d (1 to 8)", member, ndim);
    for (i = 0; i < ndim; i++) {
        if (shape[i] < 0) return v4p_fail(t, "v4p_array %s: negative dimension", member);
        count *= (uint64_t)shape[i];
    }
    m = v4p_add_member(t, member, descr, shape, ndim, descr[2] == '8' ? 8 : 4);
    if (!m) return -1;
    return count ? v4p_write_data(t, m, 0, data, (size_t)(count * (descr[2] == '8' ? 8 : 4))) : 0;
}

/* v4p_fingerprint with the 64 x N signs computed once per vector length (same summation order). */
static int v4p_fp_cached(v4p_trace *t, const float *x, uint64_t n, float fp[64]) {
    double acc[64];
    uint64_t i, k, *s = NULL;
    int slot;
    for (slot = 0; slot < 4 && t->signs[slot]; slot++)
        if (t->sign_n[slot] == n) { s = t->signs[slot]; break; }
    if (!s) {
        if (slot == 4) { v4p_fingerprint(x, n, fp); return 0; }   /* a fifth length: uncached */
        s = (uint64_t *)calloc((size_t)n, sizeof *s);
        if (!s) return v4p_fail(t, "out of memory");
        for (k = 0; k < 64; k++)
            for (i = 0; i < n; i++)
                s[i] |= (v4p_splitmix64(V4P_FP_SEED + k * n + i) >> 63) << k;
        t->signs[slot] = s; t->sign_n[slot] = n;
    }
    for (k = 0; k < 64; k++) acc[k] = 0.0;
    for (i = 0; i < n; i++) {
        double v = (double)x[i];
        for (k = 0; k < 64; k++) acc[k] += ((s[i] >> k) & 1) ? -v : v;
    }
    for (k = 0; k < 64; k++) fp[k] = (float)(acc[k] / 8.0);
    return 0;
}

static int v4p_spec_index(const v4p_trace *t, const char *name) {   /* names checked by v4p_open */
    if (!strcmp(name, "embed")) return 0;
    if (!strcmp(name, "final_norm")) return t->h.n_layers + 1;
    return atoi(name + 4) + 1;
}

/* The top-K order: higher logit first, ties (and NaNs, ranked after every number) by lower id. */
static int v4p_ranks_before(float va, int ia, float vb, int ib) {
    if (va != va || vb != vb) return (va != va) == (vb != vb) ? ia < ib : vb != vb;
    return va > vb || (va == vb && ia < ib);
}

static void v4p_g(FILE *f, double v) {
    if (v != v) fputs("nan", f);
    else if (v == HUGE_VAL) fputs("inf", f);
    else if (v == -HUGE_VAL) fputs("-inf", f);
    else fprintf(f, "%.9g", v);
}

static void v4p_floats(FILE *f, const float *a, int n) {
    int i;
    for (i = 0; i < n; i++) {
        if (i) fputc(',', f);
        v4p_g(f, (double)a[i]);
    }
}

int v4p_ckpt(v4p_trace *t, const char *name, int pos, const float *x, const float *logits, int vocab) {
    const v4p_header *h = &t->h;
    int is_final = !strcmp(name, "final_norm");
    int H = is_final ? 1 : h->n_hc, D = h->dim, c, hh, d, row = v4p_row(t, pos), listed = 0;
    uint64_t N = (uint64_t)H * (uint64_t)D;
    double total = 0.0, sum_sq = 0.0;
    float mn, mx, l2s[64], fp[64];
    int has_nan = 0;
    for (c = 0; c < h->n_checkpoints; c++) listed |= !strcmp(h->checkpoints[c], name);
    if (!listed) return v4p_fail(t, "v4p_ckpt: %s is not in the header's checkpoints", name);
    if (row < 0) return v4p_fail(t, "v4p_ckpt: position %d is not in the header's positions", pos);
    if (pos >= h->n_tokens) return v4p_fail(t, "v4p_ckpt: position %d has no token", pos);
    if (H > 64) return v4p_fail(t, "v4p_ckpt: n_hc %d > 64", H);
    mn = mx = x[0];
    for (hh = 0; hh < H; hh++) {
        double sq = 0.0;
        for (d = 0; d < D; d++) {
            float v = x[(uint64_t)hh * D + d];
            sq += (double)v * v;
            if (v != v) has_nan = 1;
            if (v < mn) mn = v;
            if (v > mx) mx = v;
        }
        l2s[hh] = (float)sqrt(sq);
        total += sq;
    }
    for (d = 0; d < D; d++) {
        double s = 0.0;
        for (hh = 0; hh < H; hh++) s += x[(uint64_t)hh * D + d];
        sum_sq += s * s;
    }
    if (has_nan) mn = mx = (float)NAN;   /* as numpy's min / max */
    if (v4p_fp_cached(t, x, N, fp)) return -1;
    fprintf(t->text, "ckpt %d %s pos %d tok %d: min=", v4p_spec_index(t, name), name, pos, (int)h->tokens[pos]);
    v4p_g(t->text, mn); fputs(" max=", t->text); v4p_g(t->text, mx);
    fputs(" rms=", t->text); v4p_g(t->text, (float)sqrt(total / (double)N));
    fputs(" l2s=", t->text); v4p_floats(t->text, l2s, H);
    fputs(" sum_l2=", t->text); v4p_g(t->text, (float)sqrt(sum_sq));
    fputs(" fp=", t->text); v4p_floats(t->text, fp, 64);
    if (is_final) {
        /* top-K by logit, descending, ties by lower id */
        int k, j, K = h->top_k, last = -1;
        float lastv = 0.0f;
        if (!logits || vocab < 1) return v4p_fail(t, "v4p_ckpt: final_norm at position %d needs the logits", pos);
        if (vocab < K) return v4p_fail(t, "v4p_ckpt: vocab %d < top_k %d (top ids must be real tokens)", vocab, K);
        fputs(" argmax=", t->text);
        for (k = 0; k < K; k++) {
            int best = -1;
            for (j = 0; j < vocab; j++) {
                if (last >= 0 && !v4p_ranks_before(lastv, last, logits[j], j)) continue;   /* ranked already */
                if (best < 0 || v4p_ranks_before(logits[j], j, logits[best], best)) best = j;
            }
            if (k == 0) fprintf(t->text, "%d top=", best);
            else fputc(',', t->text);
            fprintf(t->text, "%d:", best);
            v4p_g(t->text, logits[best]);
            last = best; lastv = logits[best];
        }
    }
    fputc('\n', t->text);
    if (ferror(t->text)) return v4p_fail(t, "%s: write failed", t->tmp);
    for (c = 0; c < h->n_full; c++)
        if (!strcmp(h->full[c], name)) return v4p_vector(t, name, pos, x, (size_t)N);
    return 0;
}

static int v4p_diag_pos(v4p_trace *t, const char *what, int layer, int pos) {
    if (layer < 0 || layer >= t->h.n_layers) return v4p_fail(t, "%s: layer %d out of range", what, layer);
    if (v4p_row(t, pos) < 0) return v4p_fail(t, "%s: position %d is not in the header's positions", what, pos);
    return 0;
}

static void v4p_ints(FILE *f, const int32_t *a, int n) {
    int i;
    for (i = 0; i < n; i++) fprintf(f, i ? ",%d" : "%d", (int)a[i]);
}

int v4p_hc(v4p_trace *t, int layer, int sub, int pos, const float *pre, const float *post, const float *comb) {
    int H = t->h.n_hc;
    if (v4p_diag_pos(t, "v4p_hc", layer, pos)) return -1;
    if (sub != 0 && sub != 1) return v4p_fail(t, "v4p_hc: sub %d (0 attn, 1 ffn)", sub);
    fprintf(t->text, "hc %d %s pos %d: pre=", layer, sub ? "ffn" : "attn", pos);
    v4p_floats(t->text, pre, H);
    fputs(" post=", t->text); v4p_floats(t->text, post, H);
    fputs(" comb=", t->text); v4p_floats(t->text, comb, H * H);
    fputc('\n', t->text);
    return ferror(t->text) ? v4p_fail(t, "%s: write failed", t->tmp) : 0;
}

int v4p_moe(v4p_trace *t, int layer, int pos, const int32_t *ids, const float *w, int k, float margin) {
    if (v4p_diag_pos(t, "v4p_moe", layer, pos)) return -1;
    if (k < 1) return v4p_fail(t, "v4p_moe: k %d < 1", k);
    fprintf(t->text, "moe %d pos %d: ids=", layer, pos);
    v4p_ints(t->text, ids, k);
    fputs(" w=", t->text); v4p_floats(t->text, w, k);
    fputs(" margin=", t->text); v4p_g(t->text, margin);
    fputc('\n', t->text);
    return ferror(t->text) ? v4p_fail(t, "%s: write failed", t->tmp) : 0;
}

int v4p_attn(v4p_trace *t, int layer, int pos, int n_comp, const int32_t *sel, int n_sel) {
    if (v4p_diag_pos(t, "v4p_attn", layer, pos)) return -1;
    fprintf(t->text, "attn %d pos %d: n_comp=%d sel=", layer, pos, n_comp);
    if (n_sel < 0) fputc('-', t->text);
    else v4p_ints(t->text, sel, n_sel);
    fputc('\n', t->text);
    return ferror(t->text) ? v4p_fail(t, "%s: write failed", t->tmp) : 0;
}

int v4p_spec(v4p_trace *t, int start_pos, const int32_t *drafts, int k, int gamma, const char *cut,
             const int32_t *verify, int accepted, const float *conf) {
    const v4p_header *h = &t->h;
    int i, rule = 0, all = !cut || !strcmp(cut, "-");
    if (k < 0) return v4p_fail(t, "v4p_spec: round %d: k %d < 0", t->n_spec, k);
    if (start_pos != t->spec_next)
        return v4p_fail(t, "v4p_spec: round %d starts at position %d, expected %d", t->n_spec, start_pos, t->spec_next);
    if (start_pos >= h->n_tokens)
        return v4p_fail(t, "v4p_spec: round %d: position %d is past the header's tokens", t->n_spec, start_pos);
    if (gamma < 0 || gamma > k) return v4p_fail(t, "v4p_spec: round %d: gamma %d not in [0, %d]", t->n_spec, gamma, k);
    for (i = 0; i < k || i <= gamma; i++)
        if ((i < k && drafts[i] < 0) || (i <= gamma && verify[i] < 0))
            return v4p_fail(t, "v4p_spec: round %d: a negative token id", t->n_spec);
    if (!all && strcmp(cut, "gate") && strcmp(cut, "max-draft") && strcmp(cut, "budget"))
        return v4p_fail(t, "v4p_spec: round %d: cut '%.20s' (-, gate, max-draft, budget)", t->n_spec, cut);
    if (all != (gamma == k))
        return v4p_fail(t, "v4p_spec: round %d: %d of %d drafts verified, cut must be '-' exactly when all are",
                        t->n_spec, gamma, k);
    while (rule < gamma && drafts[rule] == verify[rule]) rule++;
    if (accepted != rule)
        return v4p_fail(t, "v4p_spec: round %d: accepted %d, the greedy rule accepts %d", t->n_spec, accepted, rule);
    for (i = 0; i <= accepted && start_pos + 1 + i < h->n_tokens; i++) {
        int32_t tok = i < accepted ? drafts[i] : verify[accepted];
        if (tok != h->tokens[start_pos + 1 + i])
            return v4p_fail(t, "v4p_spec: round %d commits token %d at position %d, the header's tokens say %d",
                            t->n_spec, (int)tok, start_pos + 1 + i, (int)h->tokens[start_pos + 1 + i]);
    }
    fprintf(t->text, "spec %d pos %d: drafts=", t->n_spec, start_pos);
    if (k) v4p_ints(t->text, drafts, k);
    else fputc('-', t->text);
    fprintf(t->text, " verified=%d cut=%s verify=", gamma, all ? "-" : cut);
    v4p_ints(t->text, verify, gamma + 1);
    fprintf(t->text, " accepted=%d conf=", accepted);
    if (conf && k) v4p_floats(t->text, conf, k);
    else fputc('-', t->text);
    fputc('\n', t->text);
    t->n_spec++;
    t->spec_next = start_pos + accepted + 1;
    return ferror(t->text) ? v4p_fail(t, "%s: write failed", t->tmp) : 0;
}

/* Copy member bytes into the zip, computing the CRC-32 on the way. */
static int v4p_copy(v4p_trace *t, FILE *out, v4p_member *m, uint32_t *crc) {
    unsigned char buf[1 << 16];
    uint64_t left = m->size;
    *crc = 0;
    if (fseek(m->data, 0, SEEK_SET)) return v4p_fail(t, "member %s: seek failed", m->name);
    while (left) {
        size_t want = left < sizeof buf ? (size_t)left : sizeof buf, got = fread(buf, 1, want, m->data);
        if (got < want) return v4p_fail(t, "member %s: read failed", m->name);
        *crc = v4p_crc32(*crc, buf, want);
        if (fwrite(buf, 1, want, out) != want) return v4p_fail(t, "%s: write failed", t->side_tmp);
        left -= want;
    }
    return 0;
}

static int v4p_write_zip(v4p_trace *t) {
    FILE *out = fopen(t->side_tmp, "wb");
    uint32_t *crcs, *offsets;
    uint64_t at = 0, cd_start, cd_size = 0;
    unsigned char hd[46];
    int i;
    if (!out) return v4p_fail(t, "%s: cannot open for writing", t->side_tmp);
    crcs = (uint32_t *)calloc((size_t)t->n_members + 1, sizeof *crcs);
    offsets = (uint32_t *)calloc((size_t)t->n_members + 1, sizeof *offsets);
    if (!crcs || !offsets) { fclose(out); free(crcs); free(offsets); return v4p_fail(t, "out of memory"); }
    for (i = 0; i < t->n_members; i++) {   /* local header (CRC patched after the data), then the stored data */
        v4p_member *m = &t->members[i];
        size_t nl = strlen(m->name);
        long crc_at;
        offsets[i] = (uint32_t)at;
        memset(hd, 0, 30);
        v4p_put_le(hd, 0x04034b50, 4); v4p_put_le(hd + 4, 20, 2);      /* version needed 2.0, flags 0, stored */
        v4p_put_le(hd + 10, 0, 2); v4p_put_le(hd + 12, (1 << 5) | 1, 2); /* 1980-01-01 00:00:00 */
        v4p_put_le(hd + 18, m->size, 4); v4p_put_le(hd + 22, m->size, 4); v4p_put_le(hd + 26, nl, 2);
        crc_at = (long)at + 14;
        if (fwrite(hd, 1, 30, out) != 30 || fwrite(m->name, 1, nl, out) != nl) break;
        if (v4p_copy(t, out, m, &crcs[i])) break;
        at += 30 + nl + m->size;
        v4p_put_le(hd, crcs[i], 4);
        if (fseek(out, crc_at, SEEK_SET) || fwrite(hd, 1, 4, out) != 4 || fseek(out, 0, SEEK_END)) break;
        if (at >= 0xFFFFFFFFull) { v4p_fail(t, "%s: beyond 4 GiB (no zip64)", t->side); break; }
    }
    cd_start = at;
    if (i == t->n_members) {
        for (i = 0; i < t->n_members; i++) {   /* central directory */
            v4p_member *m = &t->members[i];
            size_t nl = strlen(m->name);
            memset(hd, 0, 46);
            v4p_put_le(hd, 0x02014b50, 4); v4p_put_le(hd + 4, 20, 2); v4p_put_le(hd + 6, 20, 2);
            v4p_put_le(hd + 12, 0, 2); v4p_put_le(hd + 14, (1 << 5) | 1, 2);
            v4p_put_le(hd + 16, crcs[i], 4); v4p_put_le(hd + 20, m->size, 4); v4p_put_le(hd + 24, m->size, 4);
            v4p_put_le(hd + 28, nl, 2); v4p_put_le(hd + 42, offsets[i], 4);
            if (fwrite(hd, 1, 46, out) != 46 || fwrite(m->name, 1, nl, out) != nl) break;
            cd_size += 46 + nl;
        }
        memset(hd, 0, 22);   /* end of central directory */
        v4p_put_le(hd, 0x06054b50, 4); v4p_put_le(hd + 8, (uint64_t)t->n_members, 2);
        v4p_put_le(hd + 10, (uint64_t)t->n_members, 2); v4p_put_le(hd + 12, cd_size, 4);
        v4p_put_le(hd + 16, cd_start, 4);
        if (i < t->n_members || fwrite(hd, 1, 22, out) != 22) v4p_fail(t, "%s: write failed", t->side_tmp);
    } else {
        v4p_fail(t, "%s: write failed", t->side_tmp);
    }
    free(crcs); free(offsets);
    if (fclose(out)) v4p_fail(t, "%s: write failed", t->side_tmp);
    return t->err[0] ? -1 : 0;
}

/* The side file's trace_sha256 member: the sha256 (hex) of the trace bytes, as a numpy "<U64" array of one. */
static void v4p_bind(v4p_trace *t) {
    unsigned char buf[1 << 14], ucs[256];
    char hex[65];
    size_t n;
    int64_t one = 1;
    int i;
    v4p_sha256 c;
    v4p_member *m;
    FILE *f = fopen(t->tmp, "rb");
    if (!f) { v4p_fail(t, "%s: cannot read back", t->tmp); return; }
    v4p_sha_init(&c);
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) v4p_sha_update(&c, buf, n);
    if (ferror(f)) v4p_fail(t, "%s: read failed", t->tmp);
    fclose(f);
    v4p_sha_hex(&c, hex);
    memset(ucs, 0, sizeof ucs);
    for (i = 0; i < 64; i++) ucs[4 * i] = (unsigned char)hex[i];   /* UCS-4 little-endian */
    m = v4p_add_member(t, "trace_sha256", "<U64", &one, 1, 256);
    if (m) v4p_write_data(t, m, 0, ucs, sizeof ucs);
}

int v4p_close(v4p_trace *t, char *err, size_t errlen) {
    int i, rc;
    if (!t) return -1;
    if (t->text && !t->err[0]) {
        int f;
        for (f = 0; f < t->h.n_full; f++) {
            v4p_member *m = v4p_find(t, t->h.full[f]);
            if (!m) { v4p_fail(t, "full vector %s listed but never written", t->h.full[f]); continue; }
            for (i = 0; i < t->h.n_positions; i++)
                if (!m->written[i])
                    v4p_fail(t, "full vector %s at position %d never written", t->h.full[f], (int)t->h.positions[i]);
        }
        if (!t->h.n_positions && !t->n_spec) v4p_fail(t, "a trace without checkpoints needs spec records (v4p_spec)");
        if (t->n_spec && t->h.n_tokens > t->h.n_prompt + 1 && t->spec_next < t->h.n_tokens - 1)
            v4p_fail(t, "the spec rounds commit tokens up to position %d, the header's tokens go on to %d: a round "
                     "is missing", t->spec_next, t->h.n_tokens - 1);
    }
    if (t->text) {
        if (fclose(t->text)) v4p_fail(t, "%s: write failed", t->tmp);
        t->text = NULL;
        if (!t->err[0] && t->n_members) v4p_bind(t);
        if (!t->err[0] && t->n_members) {
            if (!v4p_write_zip(t) && rename(t->side_tmp, t->side)) v4p_fail(t, "%s: rename failed", t->side);
        }
        if (!t->err[0] && rename(t->tmp, t->path)) v4p_fail(t, "%s: rename failed", t->path);
        if (t->err[0]) { remove(t->tmp); remove(t->side_tmp); }
    }
    for (i = 0; i < t->n_members; i++) {
        if (t->members[i].data) fclose(t->members[i].data);
        free(t->members[i].written);
    }
    rc = t->err[0] ? -1 : 0;
    if (err && errlen) snprintf(err, errlen, "%s", t->err);
    for (i = 0; i < 4; i++) free(t->signs[i]);
    free(t->members); free(t);
    return rc;
}

#endif /* V4P_TRACE_IMPLEMENTED */
#endif /* V4P_TRACE_IMPLEMENTATION */
