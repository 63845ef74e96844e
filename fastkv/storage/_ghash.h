/* GMAC with VPCLMULQDQ (AVX-512): GCM's GHASH over the data, masked; included by
 * _disk_io.c, which uses it when the CPU has VPCLMULQDQ and AVX512F/BW/VL and
 * libcrypto's GMAC otherwise (tests check that both give the same bytes).
 *
 * Elements of GF(2^128) are kept byte-reversed in a register, so the coefficient
 * of x^k sits at bit 127 - k. A carry-less product of two such values is the
 * reversed product shifted right by one bit; `gh_reduce` shifts it back and folds
 * the terms of degree >= 128 with x^128 = 1 + x + x^2 + x^7 (whose overflow, the
 * lowest 7 bits shifted out, is folded first). `gh_blocks` multiplies 32 blocks at
 * a time by H^32..H^1, four per 512-bit register, and reduces once per 32.
 */
#if defined(__x86_64__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    __m128i h;          /* H, byte-reversed: coefficient of x^k at bit 127 - k */
    __m128i pw[32];     /* H^32 .. H^1 in that order (pw[j] = H^(32 - j)) */
    __m128i y;          /* the running GHASH */
    uint8_t part[16];   /* a partial block carried between segments */
    size_t npart, total;
} Ghash;

#define GH_TGT __attribute__((target("pclmul,sse4.1,avx512f,avx512bw,avx512vl,vpclmulqdq")))

GH_TGT static inline __m128i gh_bswap(__m128i x) {
    return _mm_shuffle_epi8(x, _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* 128-bit shifts (whole register) */
GH_TGT static inline __m128i gh_shr(__m128i x, int j) { /* 0 < j < 64 */
    return _mm_or_si128(_mm_srli_epi64(x, j), _mm_slli_epi64(_mm_srli_si128(x, 8), 64 - j));
}

/* Reduce the unreduced product hi:lo (of byte-reversed operands) to one element. */
GH_TGT static inline __m128i gh_reduce(__m128i hi, __m128i lo) {
    /* shift the 256-bit value left by one: x^k moves to bit 255 - k */
    __m128i hi1 = _mm_or_si128(_mm_slli_epi64(hi, 1), _mm_srli_epi64(_mm_slli_si128(hi, 8), 63));
    hi1 = _mm_or_si128(hi1, _mm_srli_epi64(_mm_srli_si128(lo, 8), 63));
    __m128i lo1 = _mm_or_si128(_mm_slli_epi64(lo, 1), _mm_srli_epi64(_mm_slli_si128(lo, 8), 63));
    /* lo1 holds x^128..x^255: fold with x^128 = 1 + x + x^2 + x^7 */
    __m128i w = _mm_xor_si128(_mm_xor_si128(_mm_slli_epi64(lo1, 63), _mm_slli_epi64(lo1, 62)), _mm_slli_epi64(lo1, 57));
    __m128i d = _mm_xor_si128(lo1, _mm_slli_si128(w, 8));
    __m128i r = _mm_xor_si128(d, gh_shr(d, 1));
    r = _mm_xor_si128(r, gh_shr(d, 2));
    r = _mm_xor_si128(r, gh_shr(d, 7));
    return _mm_xor_si128(hi1, r);
}

GH_TGT static inline void gh_mul_parts(__m128i a, __m128i b, __m128i *hi, __m128i *lo) {
    __m128i l = _mm_clmulepi64_si128(a, b, 0x00), h = _mm_clmulepi64_si128(a, b, 0x11);
    __m128i m = _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x01), _mm_clmulepi64_si128(a, b, 0x10));
    *lo = _mm_xor_si128(l, _mm_slli_si128(m, 8));
    *hi = _mm_xor_si128(h, _mm_srli_si128(m, 8));
}

GH_TGT static inline __m128i gh_mul(__m128i a, __m128i b) {
    __m128i hi, lo;
    gh_mul_parts(a, b, &hi, &lo);
    return gh_reduce(hi, lo);
}

/* h_be: H = E_K(0) as the 16 bytes AES gives */
GH_TGT static void gh_init(Ghash *g, const uint8_t h_be[16]) {
    g->h = gh_bswap(_mm_loadu_si128((const __m128i *)h_be));
    __m128i p = g->h;
    for (int k = 1; k <= 32; k++) {
        g->pw[32 - k] = p;
        p = gh_mul(p, g->h);
    }
    g->y = _mm_setzero_si128();
    g->npart = g->total = 0;
}

GH_TGT static inline void gh_block(Ghash *g, const uint8_t *p) {
    g->y = gh_mul(_mm_xor_si128(g->y, gh_bswap(_mm_loadu_si128((const __m128i *)p))), g->h);
}

/* n blocks of 16 bytes from p, 32 at a time with one reduction; with dst, also
 * copied there, in the same pass (the hash is of the bytes as stored at dst). A
 * constant NULL dst compiles to the hash alone. */
GH_TGT static inline __attribute__((always_inline)) void gh_blocks_into(Ghash *g, uint8_t *dst, const uint8_t *p,
                                                                     size_t n) {
    const __m512i rev = _mm512_broadcast_i32x4(_mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m512i pp[8];
    for (int i = 0; i < 8; i++) pp[i] = _mm512_loadu_si512(&g->pw[4 * i]);
    while (n >= 32) {
        __m512i L = _mm512_setzero_si512(), H = _mm512_setzero_si512(), M = _mm512_setzero_si512();
        for (int i = 0; i < 8; i++) {
            __m512i v = _mm512_loadu_si512(p + 64 * i);
            if (dst) _mm512_storeu_si512(dst + 64 * i, v);
            __m512i x = _mm512_shuffle_epi8(v, rev);
            if (i == 0) x = _mm512_xor_si512(x, _mm512_zextsi128_si512(g->y)); /* Y joins block 0 */
            L = _mm512_xor_si512(L, _mm512_clmulepi64_epi128(x, pp[i], 0x00));
            H = _mm512_xor_si512(H, _mm512_clmulepi64_epi128(x, pp[i], 0x11));
            M = _mm512_xor_si512(M, _mm512_clmulepi64_epi128(x, pp[i], 0x01));
            M = _mm512_xor_si512(M, _mm512_clmulepi64_epi128(x, pp[i], 0x10));
        }
        L = _mm512_xor_si512(L, _mm512_bslli_epi128(M, 8));
        H = _mm512_xor_si512(H, _mm512_bsrli_epi128(M, 8));
        __m128i l = _mm_xor_si128(_mm_xor_si128(_mm512_extracti32x4_epi32(L, 0), _mm512_extracti32x4_epi32(L, 1)),
                                  _mm_xor_si128(_mm512_extracti32x4_epi32(L, 2), _mm512_extracti32x4_epi32(L, 3)));
        __m128i h = _mm_xor_si128(_mm_xor_si128(_mm512_extracti32x4_epi32(H, 0), _mm512_extracti32x4_epi32(H, 1)),
                                  _mm_xor_si128(_mm512_extracti32x4_epi32(H, 2), _mm512_extracti32x4_epi32(H, 3)));
        g->y = gh_reduce(h, l);
        p += 512;
        if (dst) dst += 512;
        n -= 32;
    }
    if (dst && n) {
        memcpy(dst, p, 16 * n);
        p = dst; /* the rest hashed as stored */
    }
    for (; n; n--, p += 16) gh_block(g, p);
}

GH_TGT static void gh_blocks(Ghash *g, const uint8_t *p, size_t n) { gh_blocks_into(g, NULL, p, n); }

GH_TGT static void gh_update(Ghash *g, const uint8_t *p, size_t n) {
    g->total += n;
    if (g->npart) {
        size_t take = 16 - g->npart < n ? 16 - g->npart : n;
        memcpy(g->part + g->npart, p, take);
        g->npart += take;
        p += take;
        n -= take;
        if (g->npart < 16) return;
        gh_block(g, g->part);
        g->npart = 0;
    }
    gh_blocks(g, p, n / 16);
    p += n / 16 * 16;
    n %= 16;
    if (n) {
        memcpy(g->part, p, n);
        g->npart = n;
    }
}

/* mask_be: E_K(J0). Writes the 16-byte GMAC. */
GH_TGT static void gh_final(Ghash *g, const uint8_t mask_be[16], uint8_t out[16]) {
    if (g->npart) {
        memset(g->part + g->npart, 0, 16 - g->npart);
        gh_block(g, g->part);
    }
    uint8_t len[16] = {0};
    uint64_t bits = (uint64_t)g->total * 8;
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)(bits >> (56 - 8 * i));
    gh_block(g, len);
    __m128i t = _mm_xor_si128(gh_bswap(g->y), _mm_loadu_si128((const __m128i *)mask_be));
    _mm_storeu_si128((__m128i *)out, t);
}
#endif
