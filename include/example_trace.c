/* example_trace.c - write a v4parity trace through v4parity_trace.h from vectors stored as raw float32 files.
 *
 *     cc -std=c99 -Wall -Werror -O2 -o example_trace include/example_trace.c -lm
 *     ./example_trace DIR OUT.trace [CHECKPOINT REL]
 *
 * DIR holds `meta.txt` (one `key values...` line each: engine NAME VERSION..., model SIZE HEADER_SHA FILE,
 * model_data SHA (optional), dtype, layers L, hc H, dim D, vocab V, top_k K, tokens ..., n_prompt, chunks ...,
 * decode, positions ..., flags JSON) and one `<checkpoint>.bin` per checkpoint (embed, blk.l.attn, blk.l for every
 * layer, final_norm) plus `logits.bin`: raw little-endian float32, one row per position in `positions` order
 * (H x D per row for carriers, D for final_norm, V for logits), e.g. the arrays of `v4parity export` written
 * with numpy's `tofile`. This stands in for an engine: where it reads a row, an engine has it in memory.
 *
 * Optional, as `v4parity trace` writes them: the per-layer diagnostics (meta lines `hc_rows N`, `moe_rows N` with
 * `moe_k K`, `attn_rows N` with `sel_width S`; files hc.idx.bin int32 [N, 3] (layer, sub, pos) + hc.val.bin float32
 * [N, 2H + H*H] (pre, post, comb); moe.idx.bin int32 [N, 2 + K] (layer, pos, ids) + moe.val.bin float32 [N, K + 1]
 * (w, margin); attn.bin int32 [N, 4 + S] (layer, pos, n_comp, has_sel, sel)) and extra side-file arrays such as
 * the sub-op records (meta line `subops NAME...` for the header; `arrays.txt`: one `MEMBER DESCR DIM...` line per
 * array, its bytes in `MEMBER.bin`).
 *
 * Optional, a speculative run's rounds: `spec.txt`, one round per line: START K GAMMA CUT ACCEPTED HAS_CONF, then the
 * K drafts, the GAMMA + 1 verify argmaxes and (HAS_CONF 1) the K confidence logits; written with v4p_spec.
 *
 * With CHECKPOINT REL, the vector of CHECKPOINT at every position gets a deterministic +-1 noise (splitmix64
 * signs, another seed than the fingerprint's) scaled to REL times the vector's norm: a planted error. When
 * CHECKPOINT is a layer output blk.L, the sub-op record subop.L.hc_ffn_post (the same vectors) gets the same noise,
 * as an engine whose layer L computes this output would record it.
 */
#define V4P_TRACE_IMPLEMENTATION
#include "v4parity_trace.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXN 8192

static char line_buf[1 << 16];

static void die(const char *what, const char *detail) {
    fprintf(stderr, "example_trace: %s: %s\n", what, detail);
    exit(2);
}

/* The value text of `key` in meta.txt (first match), or NULL. */
static char *meta_value(const char *dir, const char *key, char *out, size_t cap) {
    char path[4096];
    FILE *f;
    size_t kl = strlen(key);
    snprintf(path, sizeof path, "%s/meta.txt", dir);
    f = fopen(path, "r");
    if (!f) die(path, "cannot open");
    while (fgets(line_buf, sizeof line_buf, f)) {
        line_buf[strcspn(line_buf, "\n")] = 0;
        if (!strncmp(line_buf, key, kl) && line_buf[kl] == ' ') {
            snprintf(out, cap, "%s", line_buf + kl + 1);
            fclose(f);
            return out;
        }
    }
    fclose(f);
    return NULL;
}

static char *need(const char *dir, const char *key, char *out, size_t cap) {
    if (!meta_value(dir, key, out, cap)) die("meta.txt", key);
    return out;
}

static int need_int(const char *dir, const char *key) {
    char v[64];
    return atoi(need(dir, key, v, sizeof v));
}

static int int_list(const char *dir, const char *key, int32_t *out) {
    char v[1 << 16], *p, *end;
    int n = 0;
    p = need(dir, key, v, sizeof v);
    for (;;) {
        long x = strtol(p, &end, 10);
        if (end == p) break;
        if (n == MAXN) die(key, "too many values");
        out[n++] = (int32_t)x;
        p = end;
    }
    return n;
}

static float *read_rows(const char *dir, const char *name, size_t count) {
    char path[4096];
    float *x = (float *)malloc(count * sizeof(float));
    FILE *f;
    snprintf(path, sizeof path, "%s/%s.bin", dir, name);
    f = fopen(path, "rb");
    if (!f || !x) die(path, "cannot open");
    if (fread(x, sizeof(float), count, f) != count) die(path, "too short");
    if (fgetc(f) != EOF) die(path, "too long");
    fclose(f);
    return x;
}

static void *read_bytes(const char *dir, const char *name, size_t nbytes) {
    char path[4096];
    void *x = malloc(nbytes ? nbytes : 1);
    FILE *f;
    snprintf(path, sizeof path, "%s/%s.bin", dir, name);
    f = fopen(path, "rb");
    if (!f || !x) die(path, "cannot open");
    if (fread(x, 1, nbytes, f) != nbytes) die(path, "too short");
    if (fgetc(f) != EOF) die(path, "too long");
    fclose(f);
    return x;
}

static int optional_int(const char *dir, const char *key) {
    char v[64];
    return meta_value(dir, key, v, sizeof v) ? atoi(v) : 0;
}

/* The hc / moe / attn lines, when meta.txt counts them. */
static void diagnostics(const char *dir, v4p_trace *t, int H) {
    int n = optional_int(dir, "hc_rows"), i, K, S, w = 2 * H + H * H;
    if (n) {
        int32_t *idx = (int32_t *)read_bytes(dir, "hc.idx", (size_t)n * 3 * 4);
        float *val = (float *)read_bytes(dir, "hc.val", (size_t)n * w * 4);
        for (i = 0; i < n; i++) {
            const float *v = val + (size_t)i * w;
            if (v4p_hc(t, idx[3 * i], idx[3 * i + 1], idx[3 * i + 2], v, v + H, v + 2 * H)) break;
        }
        free(idx); free(val);
    }
    n = optional_int(dir, "moe_rows");
    K = optional_int(dir, "moe_k");
    if (n) {
        int32_t *idx = (int32_t *)read_bytes(dir, "moe.idx", (size_t)n * (2 + K) * 4);
        float *val = (float *)read_bytes(dir, "moe.val", (size_t)n * (K + 1) * 4);
        for (i = 0; i < n; i++) {
            const int32_t *r = idx + (size_t)i * (2 + K);
            const float *v = val + (size_t)i * (K + 1);
            if (v4p_moe(t, r[0], r[1], r + 2, v, K, v[K])) break;
        }
        free(idx); free(val);
    }
    n = optional_int(dir, "attn_rows");
    S = optional_int(dir, "sel_width");
    if (n) {
        int32_t *rows = (int32_t *)read_bytes(dir, "attn", (size_t)n * (4 + S) * 4);
        for (i = 0; i < n; i++) {
            const int32_t *r = rows + (size_t)i * (4 + S);
            if (v4p_attn(t, r[0], r[1], r[2], r + 4, r[3] ? S : -1)) break;
        }
        free(rows);
    }
}

static void perturb(float *x, size_t n, double rel, uint64_t seed);

/* The arrays listed in arrays.txt, e.g. sub-op records; `same` (or NULL): the member holding the perturbed
 * checkpoint's vectors too (subop.L.hc_ffn_post is blk.L), perturbed row by row like it. */
static void arrays(const char *dir, v4p_trace *t, const char *same, double rel) {
    char path[4096], member[256], descr[8];
    FILE *f;
    snprintf(path, sizeof path, "%s/arrays.txt", dir);
    f = fopen(path, "r");
    if (!f) return;
    while (fgets(line_buf, sizeof line_buf, f)) {
        int64_t shape[8];
        int ndim = 0, used;
        size_t count = 1;
        char *p = line_buf;
        void *data;
        if (sscanf(p, "%255s %7s%n", member, descr, &used) != 2) die(path, "MEMBER DESCR DIM...");
        p += used;
        while (ndim < 8) {
            char *end;
            long long d = strtoll(p, &end, 10);
            if (end == p) break;
            shape[ndim++] = d;
            count *= (size_t)d;
            p = end;
        }
        data = read_bytes(dir, member, count * (descr[2] == '8' ? 8 : 4));
        if (same && !strcmp(member, same) && ndim == 3) {
            size_t row = (size_t)(shape[1] * shape[2]), i;
            for (i = 0; i < (size_t)shape[0]; i++) perturb((float *)data + i * row, row, rel, 0x5eedull + (uint64_t)i * row);
        }
        if (v4p_array(t, member, descr, shape, ndim, data)) { free(data); break; }
        free(data);
    }
    fclose(f);
}

static uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* x += rel * |x| * s / |s|, s = +-1 from splitmix64 (|s| = sqrt(n)). */
static void perturb(float *x, size_t n, double rel, uint64_t seed) {
    double norm = 0.0, scale;
    size_t i;
    for (i = 0; i < n; i++) norm += (double)x[i] * x[i];
    scale = rel * sqrt(norm) / sqrt((double)n);
    for (i = 0; i < n; i++) x[i] += (float)((mix(seed + i) >> 63) ? -scale : scale);
}

/* The rounds of DIR/spec.txt (if present) as spec records: what an engine's speculative loop has per round. */
static void spec_rounds(const char *dir, v4p_trace *t) {
    char path[4096], cut[16];
    int32_t drafts[256], verify[257];
    float conf[256];
    int start, k, gamma, accepted, has_conf, i, x;
    FILE *f;
    snprintf(path, sizeof path, "%s/spec.txt", dir);
    f = fopen(path, "r");
    if (!f) return;
    while (fscanf(f, "%d %d %d %15s %d %d", &start, &k, &gamma, cut, &accepted, &has_conf) == 6) {
        if (k < 0 || k > 256 || gamma < 0 || gamma > k) die(path, "bad round sizes");
        for (i = 0; i < k; i++) { if (fscanf(f, "%d", &x) != 1) die(path, "drafts"); drafts[i] = (int32_t)x; }
        for (i = 0; i <= gamma; i++) { if (fscanf(f, "%d", &x) != 1) die(path, "verify"); verify[i] = (int32_t)x; }
        for (i = 0; has_conf && i < k; i++) if (fscanf(f, "%f", &conf[i]) != 1) die(path, "conf");
        if (v4p_spec(t, start, drafts, k, gamma, cut, verify, accepted, has_conf ? conf : NULL)) break;
    }
    fclose(f);
}

int main(int argc, char **argv) {
    static int32_t tokens[MAXN], chunks[MAXN], positions[MAXN];
    static char engine[256], version[256], model[1024], model_data[128], dtype[64], flags[8192];
    static char names[4 * 1024 + 4][32], subop_text[1 << 12], *subops[64];
    const char *ckpts[4 * 1024 + 4], *full[4 * 1024 + 4];
    char size_text[32], hsha[128], file[512], err[512];
    v4p_header h;
    v4p_trace *t;
    float *logits;
    int L, H, D, V, P, n_ck = 0, c, i;
    const char *bad = argc == 5 ? argv[3] : NULL;
    double rel = argc == 5 ? atof(argv[4]) : 0.0;

    if (argc != 3 && argc != 5) {
        fprintf(stderr, "usage: %s DIR OUT.trace [CHECKPOINT REL]\n", argv[0]);
        return 2;
    }
    memset(&h, 0, sizeof h);
    need(argv[1], "engine", engine, sizeof engine);
    {   /* "NAME VERSION TEXT" */
        char *sp = strchr(engine, ' ');
        if (!sp) die("meta.txt", "engine needs a name and a version");
        *sp = 0;
        snprintf(version, sizeof version, "%s", sp + 1);
    }
    need(argv[1], "model", model, sizeof model);
    if (sscanf(model, "%31s %127s %511s", size_text, hsha, file) != 3) die("meta.txt", "model SIZE SHA FILE");
    L = need_int(argv[1], "layers");
    H = need_int(argv[1], "hc");
    D = need_int(argv[1], "dim");
    V = need_int(argv[1], "vocab");
    h.engine = engine;
    h.engine_version = version;
    h.model_size = strtoll(size_text, NULL, 10);
    h.model_header_sha256 = hsha;
    h.model_data_sha256 = meta_value(argv[1], "model_data", model_data, sizeof model_data);
    h.model_file = file;
    h.dtype = need(argv[1], "dtype", dtype, sizeof dtype);
    h.n_layers = L;
    h.n_hc = H;
    h.dim = D;
    h.top_k = need_int(argv[1], "top_k");
    h.tokens = tokens; h.n_tokens = int_list(argv[1], "tokens", tokens);
    h.n_prompt = need_int(argv[1], "n_prompt");
    h.chunks = chunks; h.n_chunks = int_list(argv[1], "chunks", chunks);
    h.decode = need_int(argv[1], "decode");
    h.positions = positions; h.n_positions = P = int_list(argv[1], "positions", positions);
    h.flags_json = need(argv[1], "flags", flags, sizeof flags);
    if (meta_value(argv[1], "subops", subop_text, sizeof subop_text)) {
        char *w = strtok(subop_text, " ");
        while (w && h.n_subops < 64) { subops[h.n_subops++] = w; w = strtok(NULL, " "); }
        h.subops = (const char *const *)subops;
    }
    if (L > 1024) die("meta.txt", "layers > 1024");
    snprintf(names[n_ck++], 32, "embed");
    for (i = 0; i < L; i++) {
        snprintf(names[n_ck++], 32, "blk.%d.attn", i);
        snprintf(names[n_ck++], 32, "blk.%d", i);
    }
    snprintf(names[n_ck++], 32, "final_norm");
    for (c = 0; c < n_ck; c++) ckpts[c] = full[c] = names[c];
    full[n_ck] = "logits";
    h.checkpoints = ckpts; h.n_checkpoints = n_ck;
    h.full = full; h.n_full = n_ck + 1;

    t = v4p_open(argv[2], &h, err, sizeof err);
    if (!t) die("v4p_open", err);
    logits = read_rows(argv[1], "logits", (size_t)P * V);
    for (c = 0; c < n_ck; c++) {   /* checkpoint by checkpoint: the order v4parity's own writer uses */
        int final = !strcmp(names[c], "final_norm");
        size_t row = (size_t)(final ? 1 : H) * D;
        float *x = read_rows(argv[1], names[c], (size_t)P * row);
        for (i = 0; i < P; i++) {
            if (bad && !strcmp(bad, names[c])) perturb(x + i * row, row, rel, 0x5eedull + (uint64_t)i * row);
            if (v4p_ckpt(t, names[c], positions[i], x + i * row, final ? logits + (size_t)i * V : NULL,
                         final ? V : 0))
                break;
        }
        free(x);
    }
    for (i = 0; i < P; i++)
        if (v4p_vector(t, "logits", positions[i], logits + (size_t)i * V, (size_t)V)) break;
    free(logits);
    diagnostics(argv[1], t, H);
    {
        char same[64];
        int layer = -1, used = 0;
        same[0] = 0;
        if (bad && sscanf(bad, "blk.%d%n", &layer, &used) == 1 && bad[used] == 0)
            snprintf(same, sizeof same, "subop.%d.hc_ffn_post", layer);
        arrays(argv[1], t, same[0] ? same : NULL, rel);
    }
    spec_rounds(argv[1], t);
    if (v4p_close(t, err, sizeof err)) die("v4p_close", err);
    return 0;
}
