/* Max-pool that keeps, per output, only the winner's position inside its window (a code < kh * kw), and the
 * backward that scatters the gradient from those codes. Same choice of winner as PyTorch's CPU kernel: the
 * first strictly larger value in scan order, a NaN always taking over. OpenMP over (sample, channel) maps. */
#include <math.h>
#include <stdint.h>
#include <string.h>

void maxpool_codes(const float *x, int64_t maps, int64_t h, int64_t w, int kh, int kw, int sh, int sw, int ph,
                   int pw, int64_t oh, int64_t ow, float *out, uint8_t *codes, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < maps; m++) {
        const float *xm = x + m * h * w;
        float *om = out + m * oh * ow;
        uint8_t *cm = codes + m * oh * ow;
        for (int64_t i = 0; i < oh; i++) {
            const int64_t h0 = i * sh - ph, r0 = h0 < 0 ? 0 : h0, r1 = h0 + kh < h ? h0 + kh : h;
            for (int64_t j = 0; j < ow; j++) {
                const int64_t w0 = j * sw - pw, c0 = w0 < 0 ? 0 : w0, c1 = w0 + kw < w ? w0 + kw : w;
                float best = -INFINITY;
                int64_t br = r0, bc = c0;
                for (int64_t r = r0; r < r1; r++)
                    for (int64_t c = c0; c < c1; c++) {
                        const float v = xm[r * w + c];
                        if (v > best || isnan(v)) {
                            best = v;
                            br = r;
                            bc = c;
                        }
                    }
                om[i * ow + j] = best;
                cm[i * ow + j] = (uint8_t)((br - h0) * kw + (bc - w0));
            }
        }
    }
}

/* gx (zeroed by the caller) += grad at each output's winner; ``packed`` holds the codes at ``bits`` bits each
 * over the flattened output, as pack_codes lays them out. */
void maxpool_codes_backward(const float *grad, const uint8_t *packed, int bits, int64_t maps, int64_t h,
                            int64_t w, int kw, int sh, int sw, int ph, int pw, int64_t oh, int64_t ow, float *gx,
                            int threads) {
    const unsigned mask = (1u << bits) - 1u;
    int64_t step[256];  /* code -> offset of the winner from the window's origin, in elements of the map */
    for (int code = 0; code <= (int)mask; code++) step[code] = (int64_t)(code / kw) * w + code % kw;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < maps; m++) {
        const float *gm = grad + m * oh * ow;
        float *xm = gx + m * h * w;
        for (int64_t i = 0; i < oh; i++) {
            const int64_t row = (i * sh - ph) * w - pw;
            int64_t bit = (m * oh * ow + i * ow) * bits;
            for (int64_t j = 0; j < ow; j++, bit += bits) {
                const unsigned code = (packed[bit >> 3] >> (bit & 7)) & mask;
                xm[row + j * sw + step[code]] += gm[i * ow + j];
            }
        }
    }
}
