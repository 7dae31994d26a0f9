/* Fused CPU kernels for DIVISION's codec (one pass per (sample, channel) map, OpenMP over maps).
 * Layout and arithmetic follow the reference implementation in division/codecs: LFC = block means rounded
 * to bf16, HFC = x - upsample(LFC), per-map minimum and scale in fp32, stochastic rounding, codes packed
 * little-end first, 8/bits codes per byte over the flattened tensor. */
#include <math.h>
#include <stdint.h>
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

static inline uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Returns the number of maps whose LFC, minimum or maximum was not finite (the caller then uses the
 * reference path, which keeps such values exactly). */
int division_encode(const float *x, int64_t maps, int64_t h, int64_t w, int64_t bh, int64_t bw, int bits,
                    uint64_t seed, int stochastic, uint16_t *lfc, float *minimum, float *scale, uint8_t *codes,
                    uint8_t *packed, int threads) {
    /* lfc == NULL: no low-frequency component (a plain per-map quantizer; maps of 1 x n are rows). */
    /* Maps whose codes fill whole bytes are packed on the fly into ``packed``; otherwise codes go to
     * ``codes`` (one byte each) and the caller packs them with pack_codes. */
    const int shift = bits == 1 ? 3 : (bits == 2 ? 2 : (bits == 4 ? 1 : 0));
    const int64_t per_mask = (1 << shift) - 1;
    const int aligned = ((h * w) & per_mask) == 0;
    const int64_t hb = (h + bh - 1) / bh, wb = (w + bw - 1) / bw, hw = h * w;
    const float levels = (float)((1 << bits) - 1);
    int bad = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+:bad)
    for (int64_t m = 0; m < maps; m++) {
        const float *xm = x + m * hw;
        uint16_t *lm = lfc ? lfc + m * hb * wb : NULL;
        float lf[4096];
        float *lfv = hb * wb <= 4096 ? lf : NULL;
        int finite = 1;
        if (!lm) {
            for (int64_t i = 0; i < hb * wb && lfv; i++) lfv[i] = 0.0f;
        }
        for (int64_t i = 0; i < hb && lm; i++) {
            int64_t h0 = i * bh, h1 = h0 + bh < h ? h0 + bh : h;
            for (int64_t j = 0; j < wb; j++) {
                int64_t w0 = j * bw, w1 = w0 + bw < w ? w0 + bw : w;
                double s = 0.0;
                for (int64_t r = h0; r < h1; r++)
                    for (int64_t c = w0; c < w1; c++) s += xm[r * w + c];
                const float mean = (float)(s / (double)((h1 - h0) * (w1 - w0)));
                finite &= isfinite(mean) != 0;
                uint16_t b = f32_to_bf16(mean);
                lm[i * wb + j] = b;
                if (lfv) lfv[i * wb + j] = bf16_to_f32(b);
            }
        }
        float mn = INFINITY, mx = -INFINITY;
        for (int64_t r = 0; r < h; r++) {
            const float *lrow = lfv ? lfv + (r / bh) * wb : NULL;
            for (int64_t j = 0; j < wb; j++) {
                const float l = lrow ? lrow[j] : bf16_to_f32(lm[(r / bh) * wb + j]);
                const int64_t w0 = j * bw, w1 = w0 + bw < w ? w0 + bw : w;
                for (int64_t c = w0; c < w1; c++) {
                    float v = xm[r * w + c] - l;
                    finite &= isfinite(v) != 0;
                    mn = v < mn ? v : mn;
                    mx = v > mx ? v : mx;
                }
            }
        }
        if (!finite || !isfinite(mn) || !isfinite(mx)) {
            bad += 1;
            continue;
        }
        float sc = (mx - mn) / levels;
        float inv = sc > 0.0f ? 1.0f / sc : 0.0f;
        minimum[m] = mn;
        scale[m] = sc;
        uint64_t state = seed ^ (0xD1B54A32D192ED03ull * (uint64_t)(m + 1));
        uint64_t z = 0;
        int have = 0;
        const int top = (int)levels;
        uint8_t *cm = aligned ? packed + ((m * hw) >> shift) : codes + m * hw;
        uint8_t acc = 0;
        for (int64_t r = 0; r < h; r++) {
            const float *lrow = lfv ? lfv + (r / bh) * wb : NULL;
            for (int64_t j = 0; j < wb; j++) {
                const float off = (lrow ? lrow[j] : bf16_to_f32(lm[(r / bh) * wb + j])) + mn;
                const int64_t w0 = j * bw, w1 = w0 + bw < w ? w0 + bw : w;
                for (int64_t c = w0; c < w1; c++) {
                    float v = (xm[r * w + c] - off) * inv;
                    if (stochastic) {  /* two 24-bit uniforms per 64-bit draw */
                        if (!have) {
                            z = splitmix64(&state);
                            have = 2;
                        }
                        v += (float)(z & 0xFFFFFFu) * (1.0f / 16777216.0f);
                        z >>= 32;
                        have--;
                    } else {
                        v += 0.5f;
                    }
                    int q = v > 0.0f ? (int)v : 0;  /* truncation == floor for v >= 0 */
                    const uint8_t code = (uint8_t)(q < top ? q : top);
                    if (aligned) {
                        const int64_t e = r * w + c;
                        acc |= (uint8_t)(code << (bits * (e & per_mask)));
                        if ((e & per_mask) == per_mask) {
                            cm[e >> shift] = acc;
                            acc = 0;
                        }
                    } else {
                        cm[r * w + c] = code;
                    }
                }
            }
        }
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

void division_decode(const uint8_t *packed, const uint16_t *lfc, const float *minimum, const float *scale,
                     int64_t maps, int64_t h, int64_t w, int64_t bh, int64_t bw, int bits, float *out, int threads) {
    const int64_t hb = (h + bh - 1) / bh, wb = (w + bw - 1) / bw, hw = h * w;
    const int shift = bits == 1 ? 3 : (bits == 2 ? 2 : (bits == 4 ? 1 : 0));  /* log2(codes per byte) */
    const int64_t per_mask = (1 << shift) - 1;
    const uint8_t mask = (uint8_t)((1 << bits) - 1);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < maps; m++) {
        const uint16_t *lm = lfc + m * hb * wb;
        const float mn = minimum[m], sc = scale[m];
        float *om = out + m * hw;
        for (int64_t r = 0; r < h; r++) {
            const uint16_t *lrow = lm + (r / bh) * wb;
            for (int64_t j = 0; j < wb; j++) {
                const float off = mn + bf16_to_f32(lrow[j]);
                const int64_t w0 = j * bw, w1 = w0 + bw < w ? w0 + bw : w;
                for (int64_t c = w0; c < w1; c++) {
                    const int64_t idx = m * hw + r * w + c;
                    const uint8_t code = (packed[idx >> shift] >> (bits * (idx & per_mask))) & mask;
                    om[r * w + c] = off + (float)code * sc;
                }
            }
        }
    }
}
