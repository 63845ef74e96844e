/* CRC-32C and the crc32c-3way block checksum; included by _disk_io.c.
 *
 * crc32c-3way, per segment: three CRC-32C lanes over its 8-byte words (word i
 * feeds lane i % 3; trailing bytes feed lane 0 after its words); the block
 * checksum is CRC-32C over the little-endian lanes of all segments in order.
 * fastkv.storage.block_header.reference_checksum is the same definition in
 * Python. The value is on the wire (PD notices) and in storage headers: every
 * implementation here computes exactly it (tests compare them all with the
 * reference over random sizes and alignments, `set_crc_impl`).
 *
 * Implementations, fastest the CPU has first:
 * - "vector" (VPCLMULQDQ, AVX-512): each lane is folded with carry-less
 *   multiplies, 64 bytes of lane at a time. 192 bytes of segment hold 8 words of
 *   each lane; two permutes gather a lane's 8 words into one 512-bit register
 *   (four 16-byte chunks of the lane's message, in order), and the lane's
 *   accumulator A becomes A * x^512 + chunk (mod P) with two multiplies. At the
 *   segment's end the four 128-bit parts are folded into one, which the crc32
 *   instruction reduces (its CRC from state 0 over those 16 bytes is the lane's
 *   state); the lane's last words and bytes go through the crc32 instruction.
 * - "hw" (SSE4.2): the crc32 instruction, three lanes interleaved (latency 3,
 *   throughput 1 per cycle: about 3x one lane).
 * - "sw": tables, 8 bytes at a time.
 *
 * Polynomials here are in the reflected order of CRC-32C: in a 128-bit register,
 * bit i holds the coefficient of x^(127 - i) (the first message bit is the
 * highest degree), in a 64-bit word of x^(63 - i). A carry-less product of a
 * 64-bit word (a) and a constant k stored in the low 32 bits as rev32(K) is the
 * 128-bit a * K * x^33: so the constant for "multiply by x^n" is
 * rev32(x^(n - 33) mod P) (`crc_xpow`).
 *
 * Prefetch: the segments of a layer's blocks are scattered (one block after
 * another, K and V apart), and the hardware prefetcher learns each new stream
 * only after a few misses: measured here, 32 KiB segments in reverse order cost
 * 2x the CPU of one contiguous run. While a segment is summed, the loop also
 * prefetches the next segment (its first PF_SPAN bytes) into L2, a little faster
 * than it consumes this one, so the next one starts on lines in flight.
 */
#if defined(__x86_64__)
#include <immintrin.h>
#include <nmmintrin.h>
#endif
#include <stdint.h>
#include <string.h>

#define CRC_POLY_REFLECTED 0x82F63B78u
#define PF_SPAN (64 << 10) /* bytes of the next segment prefetched while one is summed */
#define PF_HINT _MM_HINT_T1
#define VEC_MIN_BYTES 768 /* shorter segments take the crc32 path (4 x 192 bytes) */

enum { CRC_SW = 0, CRC_HW = 1, CRC_VECTOR = 2 };

static uint32_t crc_table[8][256];
static int crc_impl;      /* CRC_*: what block_checksum uses */
static int crc_impl_best; /* the fastest this CPU has */
static uint64_t crc_k512[2], crc_kfin[8]; /* folding constants (crc_init) */

/* rev32(x^n mod P) for the reflected CRC-32C polynomial. */
static uint32_t crc_xpow(unsigned n) {
    uint32_t r = 0x80000000u; /* x^0 */
    while (n--) r = (r >> 1) ^ (r & 1 ? CRC_POLY_REFLECTED : 0);
    return r;
}

/* The constant of a carry-less multiply by x^n (see the top of this file). */
static uint64_t crc_fold_k(unsigned n) { return crc_xpow(n - 33); }

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ CRC_POLY_REFLECTED : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
    /* A 128-bit part H:L (H of higher degree, in the low 64 bits) times x^n is
     * H * x^(n + 64) + L * x^n: the low-word constant is for n + 64. */
    crc_k512[0] = crc_fold_k(512 + 64);
    crc_k512[1] = crc_fold_k(512);
    for (int j = 0; j < 3; j++) { /* part j of 4 is followed by 3 - j parts of 128 bits */
        crc_kfin[2 * j] = crc_fold_k(128 * (3 - j) + 64);
        crc_kfin[2 * j + 1] = crc_fold_k(128 * (3 - j));
    }
    crc_kfin[6] = crc_kfin[7] = 0; /* the last part is added as it is */
    crc_impl_best = CRC_SW;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) crc_impl_best = CRC_HW;
    if (crc_impl_best == CRC_HW && __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
        crc_impl_best = CRC_VECTOR;
#endif
    crc_impl = crc_impl_best;
}

static inline uint32_t sw_u8(uint32_t c, uint8_t b) { return (c >> 8) ^ crc_table[0][(c ^ b) & 0xff]; }

static inline uint32_t sw_u64(uint32_t c, uint64_t w) {
    w ^= c;
    return crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^ crc_table[5][(w >> 16) & 0xff] ^
           crc_table[4][(w >> 24) & 0xff] ^ crc_table[3][(w >> 32) & 0xff] ^
           crc_table[2][(w >> 40) & 0xff] ^ crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
}

static inline uint64_t load64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* ---- lanes: crc32 instruction ---------------------------------------------------- */

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c, const uint8_t *p, size_t n) {
    uint64_t c64 = c;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) c64 = _mm_crc32_u64(c64, load64(p + i));
    c = (uint32_t)c64;
    for (; i < n; i++) c = _mm_crc32_u8(c, p[i]);
    return c;
}

/* Words [i, nw) of a segment into the lanes c[3] (word j to lane j % 3), then the
 * trailing bytes [8 * nw, n) into lane 0; out = the lanes, finished. */
__attribute__((target("sse4.2"))) static void lanes_hw_tail(const uint8_t *p, size_t n, size_t i, uint64_t c[3],
                                                           uint32_t out[3]) {
    size_t nw = n / 8;
    for (; i < nw; i++) c[i % 3] = _mm_crc32_u64(c[i % 3], load64(p + 8 * i));
    uint32_t t0 = (uint32_t)c[0];
    for (size_t b = nw * 8; b < n; b++) t0 = _mm_crc32_u8(t0, p[b]);
    out[0] = ~t0;
    out[1] = ~(uint32_t)c[1];
    out[2] = ~(uint32_t)c[2];
}

__attribute__((target("sse4.2"))) static void lanes_hw(const uint8_t *p, size_t n, uint32_t out[3], const char *pf,
                                                      const char *pf_end) {
    uint64_t c0 = 0xffffffffu, c1 = 0xffffffffu, c2 = 0xffffffffu;
    size_t nw = n / 8, i = 0;
    for (; i + 12 <= nw; i += 12) { /* unrolled: same lanes, fewer loop branches */
        const uint8_t *q = p + 8 * i;
        if (pf < pf_end) { /* 128 bytes of the next segment per 96 of this one */
            _mm_prefetch(pf, PF_HINT);
            _mm_prefetch(pf + 64, PF_HINT);
            pf += 128;
        }
        c0 = _mm_crc32_u64(c0, load64(q));
        c1 = _mm_crc32_u64(c1, load64(q + 8));
        c2 = _mm_crc32_u64(c2, load64(q + 16));
        c0 = _mm_crc32_u64(c0, load64(q + 24));
        c1 = _mm_crc32_u64(c1, load64(q + 32));
        c2 = _mm_crc32_u64(c2, load64(q + 40));
        c0 = _mm_crc32_u64(c0, load64(q + 48));
        c1 = _mm_crc32_u64(c1, load64(q + 56));
        c2 = _mm_crc32_u64(c2, load64(q + 64));
        c0 = _mm_crc32_u64(c0, load64(q + 72));
        c1 = _mm_crc32_u64(c1, load64(q + 80));
        c2 = _mm_crc32_u64(c2, load64(q + 88));
    }
    uint64_t c[3] = {c0, c1, c2};
    lanes_hw_tail(p, n, i, c, out);
}

/* ---- lanes: carry-less multiply folding ----------------------------------------- */

#define VEC_TGT __attribute__((target("sse4.2,pclmul,avx512f,avx512bw,avx512vl,vpclmulqdq")))

/* acc * x^512 + next (mod P), per 128-bit part. */
VEC_TGT static inline __m512i vec_fold(__m512i acc, __m512i k, __m512i next) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, k, 0x00), _mm512_clmulepi64_epi128(acc, k, 0x11),
                                     next, 0x96);
}

/* A lane's four 128-bit parts folded into one, reduced by the crc32 instruction:
 * the lane's CRC state. */
VEC_TGT static inline uint64_t vec_finish(__m512i acc, __m512i kfin) {
    __m512i m = _mm512_xor_si512(_mm512_clmulepi64_epi128(acc, kfin, 0x00), _mm512_clmulepi64_epi128(acc, kfin, 0x11));
    __m128i x = _mm_xor_si128(_mm512_castsi512_si128(m), _mm512_extracti32x4_epi32(m, 1));
    x = _mm_xor_si128(x, _mm512_extracti32x4_epi32(m, 2));
    x = _mm_xor_si128(x, _mm512_extracti32x4_epi32(acc, 3)); /* the last part, as it is */
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    return _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(x, 1));
}

VEC_TGT static void lanes_vec(const uint8_t *p, size_t n, uint32_t out[3], const char *pf, const char *pf_end) {
    /* 192 bytes = words w0..w23; lane l takes w(l), w(l+3), ..., w(l+21): first the
     * ones in the first 128 bytes (two-source permute), then those in the last 64. */
    const __m512i ia0 = _mm512_setr_epi64(0, 3, 6, 9, 12, 15, 0, 0), ib0 = _mm512_setr_epi64(0, 0, 0, 0, 0, 0, 2, 5);
    const __m512i ia1 = _mm512_setr_epi64(1, 4, 7, 10, 13, 0, 0, 0), ib1 = _mm512_setr_epi64(0, 0, 0, 0, 0, 0, 3, 6);
    const __m512i ia2 = _mm512_setr_epi64(2, 5, 8, 11, 14, 0, 0, 0), ib2 = _mm512_setr_epi64(0, 0, 0, 0, 0, 1, 4, 7);
    const __m512i k = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)crc_k512));
    const __m512i kfin = _mm512_loadu_si512((const void *)crc_kfin);
    size_t nb = n / 192;
    __m512i x0 = _mm512_loadu_si512((const void *)p), x1 = _mm512_loadu_si512((const void *)(p + 64)),
            x2 = _mm512_loadu_si512((const void *)(p + 128));
    /* the lanes' initial state ~0: xored into the first 4 bytes of each lane */
    const __m512i init = _mm512_setr_epi64(0xffffffff, 0, 0, 0, 0, 0, 0, 0);
    __m512i a0 = _mm512_xor_si512(_mm512_mask_permutexvar_epi64(_mm512_permutex2var_epi64(x0, ia0, x1), 0xC0, ib0, x2), init);
    __m512i a1 = _mm512_xor_si512(_mm512_mask_permutexvar_epi64(_mm512_permutex2var_epi64(x0, ia1, x1), 0xE0, ib1, x2), init);
    __m512i a2 = _mm512_xor_si512(_mm512_mask_permutexvar_epi64(_mm512_permutex2var_epi64(x0, ia2, x1), 0xE0, ib2, x2), init);
    for (size_t b = 1; b < nb; b++) {
        const uint8_t *q = p + 192 * b;
        if (pf < pf_end) {
            _mm_prefetch(pf, PF_HINT);
            _mm_prefetch(pf + 64, PF_HINT);
            _mm_prefetch(pf + 128, PF_HINT);
            pf += 192;
        }
        x0 = _mm512_loadu_si512((const void *)q);
        x1 = _mm512_loadu_si512((const void *)(q + 64));
        x2 = _mm512_loadu_si512((const void *)(q + 128));
        a0 = vec_fold(a0, k, _mm512_mask_permutexvar_epi64(_mm512_permutex2var_epi64(x0, ia0, x1), 0xC0, ib0, x2));
        a1 = vec_fold(a1, k, _mm512_mask_permutexvar_epi64(_mm512_permutex2var_epi64(x0, ia1, x1), 0xE0, ib1, x2));
        a2 = vec_fold(a2, k, _mm512_mask_permutexvar_epi64(_mm512_permutex2var_epi64(x0, ia2, x1), 0xE0, ib2, x2));
    }
    uint64_t c[3] = {vec_finish(a0, kfin), vec_finish(a1, kfin), vec_finish(a2, kfin)};
    lanes_hw_tail(p, n, 24 * nb, c, out);
}
#endif

static void lanes_sw(const uint8_t *p, size_t n, uint32_t out[3]) {
    uint32_t c[3] = {0xffffffffu, 0xffffffffu, 0xffffffffu};
    size_t nw = n / 8;
    for (size_t i = 0; i < nw; i++) c[i % 3] = sw_u64(c[i % 3], load64(p + 8 * i));
    for (size_t b = nw * 8; b < n; b++) c[0] = sw_u8(c[0], p[b]);
    for (int k = 0; k < 3; k++) out[k] = ~c[k];
}

static uint32_t crc32c(const uint8_t *p, size_t n) {
#if defined(__x86_64__)
    if (crc_impl != CRC_SW) return ~crc_hw(0xffffffffu, p, n);
#endif
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) c = sw_u8(c, p[i]);
    return ~c;
}

static void lanes(const uint8_t *p, size_t n, uint32_t out[3], const char *pf, const char *pf_end) {
#if defined(__x86_64__)
    if (crc_impl == CRC_VECTOR && n >= VEC_MIN_BYTES) {
        lanes_vec(p, n, out, pf, pf_end);
        return;
    }
    if (crc_impl != CRC_SW) {
        lanes_hw(p, n, out, pf, pf_end);
        return;
    }
#else
    (void)pf;
    (void)pf_end;
#endif
    lanes_sw(p, n, out);
}

/* The block checksum over `nseg` segments; lanes_buf has room for 12 * nseg bytes. */
static uint32_t block_checksum(const int64_t *segs, Py_ssize_t nseg, uint8_t *lanes_buf) {
    for (Py_ssize_t s = 0; s < nseg; s++) {
        uint32_t l[3];
        const char *pf = NULL, *pf_end = NULL; /* the next segment's first PF_SPAN bytes */
        if (s + 1 < nseg) {
            pf = (const char *)(uintptr_t)segs[2 * s + 2];
            pf_end = pf + ((size_t)segs[2 * s + 3] < PF_SPAN ? (size_t)segs[2 * s + 3] : PF_SPAN);
        }
        lanes((const uint8_t *)(uintptr_t)segs[2 * s], (size_t)segs[2 * s + 1], l, pf, pf_end);
        for (int k = 0; k < 3; k++) {
            uint8_t *d = lanes_buf + 12 * s + 4 * k;
            d[0] = (uint8_t)l[k];
            d[1] = (uint8_t)(l[k] >> 8);
            d[2] = (uint8_t)(l[k] >> 16);
            d[3] = (uint8_t)(l[k] >> 24);
        }
    }
    return crc32c(lanes_buf, (size_t)(12 * nseg));
}

/* set_crc_impl("vector" | "hw" | "sw") -> the previous one (tests compare them). */
static PyObject *set_crc_impl(PyObject *self, PyObject *args) {
    (void)self;
    static const char *const names[] = {"sw", "hw", "vector"};
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    for (int i = 0; i < 3; i++) {
        if (strcmp(name, names[i]) != 0) continue;
        if (i > crc_impl_best)
            return PyErr_Format(PyExc_RuntimeError, "set_crc_impl: %s needs CPU features this one lacks (best: %s)",
                                name, names[crc_impl_best]);
        const char *before = names[crc_impl];
        crc_impl = i;
        return PyUnicode_FromString(before);
    }
    return PyErr_Format(PyExc_ValueError, "set_crc_impl: 'vector', 'hw' or 'sw', got %s", name);
}
