/* Fused CPU kernels for DIVISION's codec (one pass per (sample, channel) map, OpenMP over maps).
 * Layout and arithmetic follow the reference implementation in division/codecs: LFC = block means rounded
 * to bf16, HFC = x - upsample(LFC), per-map minimum and scale in fp32, stochastic rounding (a counter-based
 * hash per element), codes packed little-end first, 8/bits codes per byte over the flattened tensor. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);  /* round to nearest even */
    return (uint16_t)((u + rounding) >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A counter-based 32-bit hash (lowbias32): one uniform per element, computed in SIMD lanes. */
static inline uint32_t hash32(uint32_t z) {
    z ^= z >> 16;
    z *= 0x7FEB352Du;
    z ^= z >> 15;
    z *= 0x846CA68Bu;
    return z ^ (z >> 16);
}

/* codes (one byte each, values < 2^bits) -> packed bytes, little end first; n is a multiple of 8/bits. */
static void pack_aligned(const uint8_t *restrict c, int64_t n, int bits, uint8_t *restrict out) {
    switch (bits) {
    case 1:
        for (int64_t k = 0; k < n / 8; k++)
            out[k] = (uint8_t)(c[8 * k] | c[8 * k + 1] << 1 | c[8 * k + 2] << 2 | c[8 * k + 3] << 3 |
                               c[8 * k + 4] << 4 | c[8 * k + 5] << 5 | c[8 * k + 6] << 6 | c[8 * k + 7] << 7);
        break;
    case 2:
        for (int64_t k = 0; k < n / 4; k++)
            out[k] = (uint8_t)(c[4 * k] | c[4 * k + 1] << 2 | c[4 * k + 2] << 4 | c[4 * k + 3] << 6);
        break;
    case 4:
        for (int64_t k = 0; k < n / 2; k++) out[k] = (uint8_t)(c[2 * k] | c[2 * k + 1] << 4);
        break;
    default:
        memcpy(out, c, (size_t)n);
    }
}

static void unpack_aligned(const uint8_t *restrict in, int64_t n, int bits, uint8_t *restrict c) {
    switch (bits) {
    case 1:
        for (int64_t k = 0; k < n / 8; k++)
            for (int t = 0; t < 8; t++) c[8 * k + t] = (in[k] >> t) & 1u;
        break;
    case 2:
        for (int64_t k = 0; k < n / 4; k++)
            for (int t = 0; t < 4; t++) c[4 * k + t] = (in[k] >> (2 * t)) & 3u;
        break;
    case 4:
        for (int64_t k = 0; k < n / 2; k++) {
            c[2 * k] = in[k] & 15u;
            c[2 * k + 1] = in[k] >> 4;
        }
        break;
    default:
        memcpy(c, in, (size_t)n);
    }
}

/* Returns the number of maps whose LFC, minimum or maximum was not finite (the caller then uses the
 * reference path, which keeps such values exactly). */
int division_encode(const float *x, int64_t maps, int64_t h, int64_t w, int64_t bh, int64_t bw, int bits,
                    uint64_t seed, int stochastic, uint16_t *lfc, float *minimum, float *scale, uint8_t *codes,
                    uint8_t *packed, int threads, int fixed_range) {
    /* lfc == NULL: no low-frequency component (a plain per-map quantizer; maps of 1 x n are rows).
     * fixed_range: minimum[m] and scale[m] are inputs (one range for many maps, BLPA), not outputs. */
    /* Maps whose codes fill whole bytes are packed here into ``packed``; otherwise codes go to ``codes``
     * (one byte each) and the caller packs them with pack_codes. Each map is worked row by row in
     * straight loops over a row (upsampled LFC, HFC, codes) that the compiler vectorises. */
    const int shift = bits == 1 ? 3 : (bits == 2 ? 2 : (bits == 4 ? 1 : 0));
    const int64_t per_mask = (1 << shift) - 1;
    const int aligned = ((h * w) & per_mask) == 0;
    const int64_t hb = lfc ? (h + bh - 1) / bh : 1, wb = lfc ? (w + bw - 1) / bw : 1, hw = h * w;
    const int64_t rows_per_block = lfc ? bh : h;
    const float levels = (float)((1 << bits) - 1);
    const int top = (int)levels;
    int bad = 0;
#pragma omp parallel num_threads(threads) reduction(+:bad)
    {
        float *lrow = malloc((size_t)w * sizeof(float));
        float *hfc = malloc((size_t)hw * sizeof(float));
        uint8_t *cbuf = malloc((size_t)hw);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < maps; m++) {
            if (!lrow || !hfc || !cbuf) {  /* out of memory: the caller falls back to the reference path */
                bad += 1;
                continue;
            }
            const float *xm = x + m * hw;
            uint16_t *lm = lfc ? lfc + m * hb * wb : NULL;
            float check = 0.0f;  /* becomes NaN when any LFC or HFC value is NaN or infinite */
            for (int64_t i = 0; i < hb; i++) {
                const int64_t h0 = i * rows_per_block, h1 = h0 + rows_per_block < h ? h0 + rows_per_block : h;
                if (lm) {
                    for (int64_t c = 0; c < w; c++) lrow[c] = 0.0f;
                    for (int64_t r = h0; r < h1; r++)
                        for (int64_t c = 0; c < w; c++) lrow[c] += xm[r * w + c];
                    for (int64_t j = 0; j < wb; j++) {
                        const int64_t w0 = j * bw, w1 = w0 + bw < w ? w0 + bw : w;
                        float s = 0.0f;
                        for (int64_t c = w0; c < w1; c++) s += lrow[c];
                        const uint16_t b = f32_to_bf16(s / (float)((h1 - h0) * (w1 - w0)));
                        lm[i * wb + j] = b;
                        const float l = bf16_to_f32(b);
                        for (int64_t c = w0; c < w1; c++) lrow[c] = l;
                    }
                } else {
                    for (int64_t c = 0; c < w; c++) lrow[c] = 0.0f;
                }
                for (int64_t r = h0; r < h1; r++)
                    for (int64_t c = 0; c < w; c++) hfc[r * w + c] = xm[r * w + c] - lrow[c];
            }
            float mn = INFINITY, mx = -INFINITY;
            for (int64_t e = 0; e < hw; e++) {
                const float v = hfc[e];
                check += v * 0.0f;
                mn = v < mn ? v : mn;
                mx = v > mx ? v : mx;
            }
            if (check != 0.0f || !isfinite(mn) || !isfinite(mx)) {
                bad += 1;
                continue;
            }
            float sc = (mx - mn) / levels;
            if (fixed_range) {
                mn = minimum[m];
                sc = scale[m];
            } else {
                minimum[m] = mn;
                scale[m] = sc;
            }
            const float inv = sc > 0.0f ? 1.0f / sc : 0.0f;
            const uint32_t key = (uint32_t)splitmix64(seed ^ (0xD1B54A32D192ED03ull * (uint64_t)(m + 1)));
            for (int64_t e = 0; e < hw; e++) {
                const float u = stochastic ? (float)(hash32(key + (uint32_t)e) >> 8) * (1.0f / 16777216.0f) : 0.5f;
                const float v = (hfc[e] - mn) * inv + u;
                int q = v > 0.0f ? (int)v : 0;  /* truncation == floor for v >= 0 */
                q = q < 0 ? 0 : q;
                cbuf[e] = (uint8_t)(q < top ? q : top);
            }
            if (aligned)
                pack_aligned(cbuf, hw, bits, packed + ((m * hw) >> shift));
            else
                memcpy(codes + m * hw, cbuf, (size_t)hw);
        }
        free(lrow);
        free(hfc);
        free(cbuf);
    }
    return bad;
}

void pack_codes(const uint8_t *codes, int64_t numel, int bits, uint8_t *out, int threads) {
    const int64_t per = 8 / bits;
    const int64_t nbytes = (numel * bits + 7) / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < nbytes; i++) {
        uint8_t b = 0;
        for (int64_t k = 0; k < per; k++) {
            int64_t idx = i * per + k;
            if (idx < numel) b |= (uint8_t)(codes[idx] << (bits * k));
        }
        out[i] = b;
    }
}

/* Returns the number of maps not decoded for lack of memory (the caller raises). */
int division_decode(const uint8_t *packed, const uint16_t *lfc, const float *minimum, const float *scale,
                     int64_t maps, int64_t h, int64_t w, int64_t bh, int64_t bw, int bits, float *out, int threads) {
    const int64_t hb = (h + bh - 1) / bh, wb = (w + bw - 1) / bw, hw = h * w;
    const int shift = bits == 1 ? 3 : (bits == 2 ? 2 : (bits == 4 ? 1 : 0));  /* log2(codes per byte) */
    const int64_t per_mask = (1 << shift) - 1;
    const int aligned = (hw & per_mask) == 0;
    const uint8_t mask = (uint8_t)((1 << bits) - 1);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(+:failed)
    {
        float *off = malloc((size_t)w * sizeof(float));
        uint8_t *cbuf = malloc((size_t)hw);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < maps; m++) {
            if (!off || !cbuf) {
                failed += 1;
                continue;
            }
            const uint16_t *lm = lfc + m * hb * wb;
            const float mn = minimum[m], sc = scale[m];
            float *om = out + m * hw;
            if (aligned) {
                unpack_aligned(packed + ((m * hw) >> shift), hw, bits, cbuf);
            } else {
                for (int64_t e = 0; e < hw; e++) {
                    const int64_t idx = m * hw + e;
                    cbuf[e] = (packed[idx >> shift] >> (bits * (idx & per_mask))) & mask;
                }
            }
            for (int64_t i = 0; i < hb; i++) {
                const int64_t h0 = i * bh, h1 = h0 + bh < h ? h0 + bh : h;
                for (int64_t j = 0; j < wb; j++) {
                    const float o = mn + bf16_to_f32(lm[i * wb + j]);
                    const int64_t w0 = j * bw, w1 = w0 + bw < w ? w0 + bw : w;
                    for (int64_t c = w0; c < w1; c++) off[c] = o;
                }
                for (int64_t r = h0; r < h1; r++)
                    for (int64_t c = 0; c < w; c++) om[r * w + c] = off[c] + (float)cbuf[r * w + c] * sc;
            }
        }
        free(off);
        free(cbuf);
    }
    return failed;
}

/* ReLU mask: bit i of byte k is y[8k + i] > 0 (NaN and -0 give 0), as pack_bits lays out 1-bit codes. */
void mask_positive(const float *y, int64_t n, uint8_t *out, int threads) {
    const int64_t full = n / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < full; k++) {
        const float *v = y + 8 * k;
        uint8_t b = 0;
        for (int t = 0; t < 8; t++) b |= (uint8_t)((v[t] > 0.0f) << t);
        out[k] = b;
    }
    if (n % 8) {
        uint8_t b = 0;
        for (int64_t i = full * 8; i < n; i++) b |= (uint8_t)((y[i] > 0.0f) << (i - full * 8));
        out[full] = b;
    }
}

/* out = g where the mask bit is set, else 0 (like ReLU's own backward, a NaN gradient under a 0 bit
 * gives 0). */
void mask_apply(const float *g, const uint8_t *mask, int64_t n, float *out, int threads) {
    const int64_t nbytes = (n + 7) / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < nbytes; k++) {
        const uint8_t b = mask[k];
        const int64_t e0 = 8 * k, e1 = e0 + 8 < n ? e0 + 8 : n;
        for (int64_t e = e0; e < e1; e++) out[e] = ((b >> (e - e0)) & 1u) ? g[e] : 0.0f;
    }
}
