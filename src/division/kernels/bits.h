/* Bit-level helpers shared by the CPU kernels: bf16 conversion and directed rounding, the counter-based
 * hash of stochastic rounding, packing codes into bytes and back, and spreading mask bits into bytes. */
#ifndef DIVISION_BITS_H
#define DIVISION_BITS_H
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

/* Directed rounding to bf16 (returned as float): the stored minimum rounds down and the stored scale up,
 * so that the 16-bit range still covers the map's values (stochastic rounding stays unbiased). */
static inline float bf16_down(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t t = u & 0xFFFF0000u;
    if (t != u && (u >> 31)) t += 0x10000u;  /* negative: one more unit of magnitude */
    memcpy(&f, &t, 4);
    return f;
}

static inline float bf16_up(float f) {  /* f >= 0 */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t t = u & 0xFFFF0000u;
    if (t != u) t += 0x10000u;
    memcpy(&f, &t, 4);
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

/* The 16-bit random draws of stochastic rounding for n elements: one 32-bit hash serves two elements, 16 bits
 * each (offset by half a step when used, so the rounding bias stays below 2^-17 of a quantization step). */
static inline void rounding_draws(uint32_t key, int64_t n, uint16_t *restrict rnd) {
#pragma omp simd
    for (int64_t k = 0; k < (n + 1) / 2; k++) {
        const uint32_t r = hash32(key + (uint32_t)k);
        memcpy(rnd + 2 * k, &r, 4);  /* memcpy: no aliasing between the two views */
    }
}

/* codes (one byte each, values < 2^bits) -> packed bytes, little end first; n is a multiple of 8/bits.
 * The codes of one output byte are read as one little-endian word and folded with shifts, so each loop is
 * plain lane-wise integer arithmetic that the compiler vectorises. */
static inline void pack_aligned(const uint8_t *restrict c, int64_t n, int bits, uint8_t *restrict out) {
    switch (bits) {
    case 1:
        for (int64_t k = 0; k < n / 8; k++) {
            uint64_t v;
            memcpy(&v, c + 8 * k, 8);
            out[k] = (uint8_t)((v * 0x0102040810204080ull) >> 56);  /* byte t's low bit lands on bit 56 + t, no carries */
        }
        break;
    case 2:
        for (int64_t k = 0; k < n / 4; k++) {
            uint32_t v;
            memcpy(&v, c + 4 * k, 4);
            out[k] = (uint8_t)((v & 0x3u) | ((v >> 6) & 0xCu) | ((v >> 12) & 0x30u) | ((v >> 18) & 0xC0u));
        }
        break;
    case 4:
        for (int64_t k = 0; k < n / 2; k++) {
            uint16_t v;
            memcpy(&v, c + 2 * k, 2);
            out[k] = (uint8_t)((v & 0xFu) | ((v >> 4) & 0xF0u));
        }
        break;
    default:
        memcpy(out, c, (size_t)n);
    }
}

static inline void unpack_aligned(const uint8_t *restrict in, int64_t n, int bits, uint8_t *restrict c) {
    switch (bits) {
    case 1:
        for (int64_t k = 0; k < n / 8; k++) {
            const uint8_t b = in[k];
            for (int t = 0; t < 8; t++) c[8 * k + t] = (uint8_t)((b >> t) & 1u);
        }
        break;
    case 2:
        for (int64_t k = 0; k < n / 4; k++) {
            const uint32_t b = in[k];
            const uint32_t v = (b | (b << 6) | (b << 12) | (b << 18)) & 0x03030303u;
            memcpy(c + 4 * k, &v, 4);
        }
        break;
    case 4:
        for (int64_t k = 0; k < n / 2; k++) {
            const uint16_t b = in[k];
            const uint16_t v = (uint16_t)((b | (b << 4)) & 0x0F0Fu);
            memcpy(c + 2 * k, &v, 2);
        }
        break;
    default:
        memcpy(c, in, (size_t)n);
    }
}

/* One mask byte's eight bits as eight 0/1 bytes (bit j in byte j, little end first), without a branch: the
 * multiply copies the byte into every byte, the AND keeps bit j in byte j, and adding 0x7F carries a set bit
 * into that byte's top bit (no carry crosses bytes: 0x80 + 0x7F = 0xFF). */
static inline uint64_t spread_bits(uint8_t b) {
    const uint64_t picked = ((uint64_t)b * 0x0101010101010101ull) & 0x8040201008040201ull;
    return ((picked + 0x7F7F7F7F7F7F7F7Full) >> 7) & 0x0101010101010101ull;
}

/* Mask bits as 16-lane words: bits base .. base + 15 of a packed bit mask of ``nbytes`` bytes (bits past the
 * end read as 0). Whole 16-bit words when base is a multiple of 16, else three bytes shifted. */
static inline uint32_t bits16(const uint8_t *restrict mask, int64_t nbytes, int64_t base) {
    const int64_t k = base >> 3;
    uint32_t w = 0;
    for (int t = 0; t < 3 && k + t < nbytes; t++) w |= (uint32_t)mask[k + t] << (8 * t);
    return (w >> (base & 7)) & 0xFFFFu;
}

/* The bits of one map (elements base .. base + n - 1 of a packed bit mask) as bytes. */
static inline void split_bits(const uint8_t *restrict split, int64_t base, int64_t n, uint8_t *restrict sbuf) {
    int64_t e = 0;
    if ((base & 7) == 0) {  /* whole bytes: bit t of byte k -> sbuf[8k + t], one word per byte */
        const uint8_t *restrict s = split + (base >> 3);
        for (; e + 8 <= n; e += 8) {
            /* the byte copied into all eight lanes, lane t keeps bit t, any non-zero lane becomes 1: plain
             * arithmetic (pdep does it in one instruction on Intel, but is microcoded and slow on AMD Zen 1-2) */
            const uint64_t picked = (s[e >> 3] * 0x0101010101010101ull) & 0x8040201008040201ull;
            const uint64_t v = ((picked + 0x7F7F7F7F7F7F7F7Full) >> 7) & 0x0101010101010101ull;
            memcpy(sbuf + e, &v, 8);
        }
    }
    for (; e < n; e++) sbuf[e] = (split[(base + e) >> 3] >> ((base + e) & 7)) & 1u;
}

#endif
