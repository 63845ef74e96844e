/* GHASH while copying: one pass over the data both moves it and hashes it, for the
 * Mooncake staging area (a put gathers a block into it, a get scatters it out).
 * Included by _disk_io.c after _ghash.h; used only where that file's native GHASH
 * is (the CPU has VPCLMULQDQ and AVX512F/BW/VL). The hash is of the bytes as they
 * are stored at `dst`: what a put sends, or what a get hands its caller.
 */
#if defined(__x86_64__)

/* n blocks of 16 bytes from src to dst, hashed as gh_blocks hashes them */
GH_TGT static void gh_blocks_copy(Ghash *g, uint8_t *dst, const uint8_t *src, size_t n) {
    gh_blocks_into(g, dst, src, n);
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
