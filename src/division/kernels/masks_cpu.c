/* Bit-mask and packing kernels: codes of unaligned maps packed over the flattened tensor, and the ReLU
 * mask (pack y > 0, apply to a gradient, unpack to bytes), WRPN's k-bit ReLU with its mask. OpenMP over bytes. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bits.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

void pack_codes(const uint8_t *codes, int64_t numel, int bits, uint8_t *out, int threads) {
    /* Whole bytes in parallel chunks through the vectorised packer, then the last partial byte. */
    const int64_t per = 8 / bits, full = numel / per, chunk = 1 << 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k0 = 0; k0 < full; k0 += chunk) {
        const int64_t k1 = k0 + chunk < full ? k0 + chunk : full;
        pack_aligned(codes + k0 * per, (k1 - k0) * per, bits, out + k0);
    }
    if (numel % per) {
        uint8_t b = 0;
        for (int64_t idx = full * per; idx < numel; idx++) b |= (uint8_t)(codes[idx] << (bits * (idx - full * per)));
        out[full] = b;
    }
}

/* ReLU mask: bit i of byte k is y[8k + i] > 0 (NaN and -0 give 0), as pack_bits lays out 1-bit codes.
 * Sixteen elements make one little-endian 16-bit word of the mask. */
void mask_positive(const float *y, int64_t n, uint8_t *out, int threads) {
    const int64_t words = n / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < words; k++) {
        const float *v = y + 16 * k;
#ifdef __AVX512F__
        const uint16_t b = (uint16_t)_mm512_cmp_ps_mask(_mm512_loadu_ps(v), _mm512_setzero_ps(), _CMP_GT_OQ);
#else
        uint16_t b = 0;
        for (int t = 0; t < 16; t++) b |= (uint16_t)((v[t] > 0.0f) << t);
#endif
        memcpy(out + 2 * k, &b, 2);
    }
    for (int64_t i = words * 16; i < n; i += 8) {
        uint8_t b = 0;
        for (int64_t j = i; j < i + 8 && j < n; j++) b |= (uint8_t)((y[j] > 0.0f) << (j - i));
        out[i / 8] = b;
    }
}

/* ReLU and its mask in one pass: y = x where x > 0 or x is NaN, else 0 (y may be x: in place), and bit i of
 * the mask = x[i] > 0, as mask_positive lays it out. */
void relu_mask(const float *x, int64_t n, float *y, uint8_t *out, int threads) {
    const int64_t words = n / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < words; k++) {
#ifdef __AVX512F__
        const __m512 v = _mm512_loadu_ps(x + 16 * k);
        const __mmask16 pos = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        _mm512_storeu_ps(y + 16 * k, _mm512_maskz_mov_ps(pos | nan, v));
        const uint16_t b = (uint16_t)pos;
#else
        uint16_t b = 0;
        for (int t = 0; t < 16; t++) {
            const float v = x[16 * k + t];
            b |= (uint16_t)((v > 0.0f) << t);
            y[16 * k + t] = (v > 0.0f || v != v) ? v : 0.0f;
        }
#endif
        memcpy(out + 2 * k, &b, 2);
    }
    for (int64_t i = words * 16; i < n; i += 8) {
        uint8_t b = 0;
        for (int64_t j = i; j < i + 8 && j < n; j++) {
            const float v = x[j];
            b |= (uint8_t)((v > 0.0f) << (j - i));
            y[j] = (v > 0.0f || v != v) ? v : 0.0f;
        }
        out[i / 8] = b;
    }
}

/* WRPN's k-bit activation, one element: round(clamp(x, 0, 1) * levels) / levels, rounding half to even as
 * torch.round does; NaN stays NaN. */
static inline float quant_level(float v, float levels) {
    if (v != v) return v;
    const float c = v > 0.0f ? (v < 1.0f ? v : 1.0f) : 0.0f;
    return nearbyintf(c * levels) / levels;
}

/* WRPN's k-bit ReLU and the mask of its gradient in one pass: y = quant_level(x) and bit i of the mask =
 * 0 < x[i] < 1 (where the clamp passes the gradient), laid out as mask_positive's. */
void quant_relu_mask(const float *x, int64_t n, int levels, float *y, uint8_t *out, int threads) {
    const float l = (float)levels;
    const int64_t words = n / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < words; k++) {
#ifdef __AVX512F__
        const __m512 v = _mm512_loadu_ps(x + 16 * k), zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
        const __mmask16 in = _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ) & _mm512_cmp_ps_mask(v, one, _CMP_LT_OQ);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __m512 c = _mm512_min_ps(_mm512_max_ps(v, zero), one), vl = _mm512_set1_ps(l);
        const __m512 q = _mm512_div_ps(_mm512_roundscale_ps(_mm512_mul_ps(c, vl), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), vl);
        _mm512_storeu_ps(y + 16 * k, _mm512_mask_mov_ps(q, nan, v));
        const uint16_t b = (uint16_t)in;
#else
        uint16_t b = 0;
        for (int t = 0; t < 16; t++) {
            const float v = x[16 * k + t];
            b |= (uint16_t)((v > 0.0f && v < 1.0f) << t);
            y[16 * k + t] = quant_level(v, l);
        }
#endif
        memcpy(out + 2 * k, &b, 2);
    }
    for (int64_t i = words * 16; i < n; i += 8) {
        uint8_t b = 0;
        for (int64_t j = i; j < i + 8 && j < n; j++) {
            b |= (uint8_t)((x[j] > 0.0f && x[j] < 1.0f) << (j - i));
            y[j] = quant_level(x[j], l);
        }
        out[i / 8] = b;
    }
}

/* out = g where the mask bit is set, else 0 (like ReLU's own backward, a NaN gradient under a 0 bit
 * gives 0). */
void mask_apply(const float *g, const uint8_t *mask, int64_t n, float *out, int threads) {
    const int64_t words = n / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < words; k++) {
        uint16_t b;
        memcpy(&b, mask + 2 * k, 2);
#ifdef __AVX512F__
        _mm512_storeu_ps(out + 16 * k, _mm512_maskz_loadu_ps((__mmask16)b, g + 16 * k));
#else
        for (int t = 0; t < 16; t++) out[16 * k + t] = ((b >> t) & 1u) ? g[16 * k + t] : 0.0f;
#endif
    }
    for (int64_t e = words * 16; e < n; e++) out[e] = ((mask[e >> 3] >> (e & 7)) & 1u) ? g[e] : 0.0f;
}

/* Inverse of pack_codes at 1 bit: out[i] = bit i of the mask (0 or 1, a bool tensor's bytes). */
void unpack_mask(const uint8_t *packed, int64_t n, uint8_t *out, int threads) {
    const int64_t full = n / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < full; k++) {
        const uint64_t v = spread_bits(packed[k]);
        memcpy(out + 8 * k, &v, 8);
    }
    for (int64_t e = full * 8; e < n; e++) out[e] = (uint8_t)((packed[e >> 3] >> (e & 7)) & 1u);
}

/* A convolution's input rebuilt from its batch norm's input y (maps of hw elements, channel m % channels):
 * out = mask ? y * alpha[c] + beta[c] : 0, in one pass (the ReLU's exact mask over the flattened tensor). */
void bn_relu_rebuild(const float *y, const float *alpha, const float *beta, const uint8_t *mask, int64_t maps,
                     int64_t channels, int64_t hw, float *out, int threads) {
    const int64_t nbytes = (maps * hw + 7) / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < maps; m++) {
        const float a = alpha[m % channels], b = beta[m % channels];
        const float *restrict ym = y + m * hw;
        float *restrict om = out + m * hw;
        int64_t e = 0;
#ifdef __AVX512F__
        const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
        for (; e < hw; e += 16) {
            const __mmask16 live = hw - e >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (hw - e)) - 1u);
            const __mmask16 bits = (__mmask16)bits16(mask, nbytes, m * hw + e) & live;
            const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(live, ym + e), va), vb);
            _mm512_mask_storeu_ps(om + e, live, _mm512_maskz_mov_ps(bits, v));
        }
#else
        (void)nbytes;
        for (; e < hw; e++) {
            const int64_t idx = m * hw + e;
            om[e] = ((mask[idx >> 3] >> (idx & 7)) & 1u) ? ym[e] * a + b : 0.0f;
        }
#endif
    }
}
