/* Bit-mask and packing kernels: codes of unaligned maps packed over the flattened tensor, and the ReLU
 * mask (pack y > 0, apply to a gradient). OpenMP over bytes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bits.h"

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
