/* GHASH while copying: one pass over the data both moves it and hashes it, for the
 * Mooncake staging area (a put gathers a block into it, a get scatters it out).
 * Included by _disk_io.c after _ghash.h; used only where that file's native GHASH
 * is (the CPU has VPCLMULQDQ and AVX512F/BW/VL). The hash is of the bytes as they
 * are stored at `dst`: what a put sends, or what a get hands its caller.
 */
#if defined(__x86_64__)

/* n blocks of 16 bytes from src to dst, hashed as gh_blocks hashes them */
GH_TGT static void gh_blocks_copy(Ghash *g, uint8_t *dst, const uint8_t *src, size_t n) {
    const __m512i rev = _mm512_broadcast_i32x4(_mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m512i pp[8];
    for (int i = 0; i < 8; i++) pp[i] = _mm512_loadu_si512(&g->pw[4 * i]);
    while (n >= 32) {
        __m512i L = _mm512_setzero_si512(), H = _mm512_setzero_si512(), M = _mm512_setzero_si512();
        for (int i = 0; i < 8; i++) {
            __m512i v = _mm512_loadu_si512(src + 64 * i);
            _mm512_storeu_si512(dst + 64 * i, v);
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
        src += 512;
        dst += 512;
        n -= 32;
    }
    if (n) {
        memcpy(dst, src, 16 * n);
        for (; n; n--, dst += 16) gh_block(g, dst);
    }
}

/* gh_update over the bytes copied from src to dst (n of them), in one pass */
GH_TGT static void gh_update_copy(Ghash *g, uint8_t *dst, const uint8_t *src, size_t n) {
    if (g->npart) { /* finish the partial block carried from the last segment */
        size_t take = 16 - g->npart < n ? 16 - g->npart : n;
        memcpy(dst, src, take);
        gh_update(g, dst, take);
        dst += take;
        src += take;
        n -= take;
    }
    size_t whole = n / 16 * 16;
    g->total += whole;
    gh_blocks_copy(g, dst, src, whole / 16);
    if (n > whole) {
        memcpy(dst + whole, src + whole, n - whole);
        gh_update(g, dst + whole, n - whole);
    }
}
#endif
