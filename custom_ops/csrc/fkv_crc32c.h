// CRC-32C and fastkv's crc32c-3way block checksum, for host and device code.
//
// The checksum (fastkv/storage/_crc32c.h defines it; PD notices carry it): per
// segment, three standard CRC-32C lanes (reflected polynomial 0x82F63B78, initial
// state ~0, final xor ~0) over the segment's 8-byte words, word i feeding lane
// i % 3, the trailing n % 8 bytes feeding lane 0 after its words; the block
// checksum is the standard CRC-32C of the lanes of every segment in order, each
// lane as 4 little-endian bytes (12 bytes per segment).
//
// Here a segment is cut into chunks of `chunk_words` words (a multiple of 3, so
// each chunk's word j feeds lane j % 3 as the segment's does; the last chunk also
// takes the trailing bytes). Each chunk's lanes are computed from state 0 ("raw"),
// independently (a GPU thread each), and then folded in order:
//
//   state(A || B) = state(A) * x^(8 |B|) mod P  xor  raw(B)
//
// (a CRC register is linear in its state and its data; feeding zero bytes
// multiplies the state by x^8 mod P). Folding is associative, so a thread may fold
// a run of chunks from state 0 into one partial and the partials are folded again:
// the kernel's two levels (fkv_crc_cuda.cuh). Each kernel thread's work is a
// function here (`chunk_thread`, `fold_thread`, `finish_segment`);
// `checksum_emulated` runs them thread by thread on the host, and the CPU tests
// compare it with storage's implementation on random data and odd sizes.
//
// Polynomials are in the reflected order of CRC-32C: bit 31 holds x^0, bit 0
// x^31 (so 0x80000000 is 1, and multiplying by x is a right shift with a
// conditional xor of the polynomial, exactly one step of the bitwise CRC).
#ifndef FKV_CRC32C_H_
#define FKV_CRC32C_H_

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#if defined(__CUDACC__)
#define FKV_CRC_HD __host__ __device__ __forceinline__
#else
#define FKV_CRC_HD inline
#endif

namespace fkv {
namespace crc {

constexpr uint32_t kPoly = 0x82F63B78u;
constexpr uint32_t kOne = 0x80000000u;  // the polynomial 1

// 8 slices of 256 entries: slicing-by-8 (in shared memory on a GPU).
using Table = uint32_t[8][256];

// Entry i of slice 0: one byte through the bitwise CRC.
FKV_CRC_HD uint32_t table0(uint32_t i) {
  uint32_t c = i;
  for (int k = 0; k < 8; k++) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
  return c;
}

// Slice s > 0 of entry i, given slice s - 1 of it and slice 0.
FKV_CRC_HD uint32_t table_next(const Table t, int s, uint32_t i) {
  const uint32_t prev = t[s - 1][i];
  return (prev >> 8) ^ t[0][prev & 0xffu];
}

inline void fill_table(Table t) {
  for (uint32_t i = 0; i < 256; i++) t[0][i] = table0(i);
  for (int s = 1; s < 8; s++)
    for (uint32_t i = 0; i < 256; i++) t[s][i] = table_next(t, s, i);
}

FKV_CRC_HD uint32_t update_byte(const Table t, uint32_t c, uint8_t b) {
  return (c >> 8) ^ t[0][(c ^ b) & 0xffu];
}

FKV_CRC_HD uint64_t load_word(const uint8_t* p) {
  uint64_t w;
  if ((reinterpret_cast<uintptr_t>(p) & 7u) == 0) {
    w = *reinterpret_cast<const uint64_t*>(p);
  } else {
    memcpy(&w, p, 8);
  }
  return w;  // little-endian host and device: the bytes in memory order
}

FKV_CRC_HD uint32_t update_word(const Table t, uint32_t c, uint64_t w) {
  w ^= c;
  return t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^
         t[4][(w >> 24) & 0xff] ^ t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^
         t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
}

// Standard CRC-32C register update over bytes (no initial or final xor here).
FKV_CRC_HD uint32_t update(const Table t, uint32_t c, const uint8_t* p, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) c = update_word(t, c, load_word(p + i));
  for (; i < n; i++) c = update_byte(t, c, p[i]);
  return c;
}

// a * b mod P.
FKV_CRC_HD uint32_t mulmod(uint32_t a, uint32_t b) {
  uint32_t prod = 0;
  for (int i = 0; i < 32; i++) {
    prod ^= b & (0u - (a >> 31));  // a's coefficient of x^i
    a <<= 1;
    b = (b >> 1) ^ (kPoly & (0u - (b & 1u)));  // b * x
  }
  return prod;
}

// x^(8 n) mod P: what feeding n zero bytes multiplies a state by.
FKV_CRC_HD uint32_t xpow8n(uint64_t n) {
  uint32_t result = kOne;
  uint32_t sq = kOne >> 8;  // x^8
  while (n != 0) {
    if (n & 1u) result = mulmod(result, sq);
    sq = mulmod(sq, sq);
    n >>= 1;
  }
  return result;
}

// The state after `state` then a part of `nbytes` whose raw state is `raw`.
FKV_CRC_HD uint32_t fold(uint32_t state, uint32_t raw, uint64_t nbytes) {
  return mulmod(state, xpow8n(nbytes)) ^ raw;
}

// Chunks of a segment of n bytes: at least one (it takes the trailing bytes).
FKV_CRC_HD uint64_t num_chunks(uint64_t n, uint64_t chunk_words) {
  const uint64_t nw = n / 8;
  return nw == 0 ? 1 : (nw + chunk_words - 1) / chunk_words;
}

// Bytes of lane k in chunk `chunk` of a segment of n bytes.
FKV_CRC_HD uint64_t lane_bytes(uint64_t n, uint64_t chunk_words, uint64_t chunk, int k) {
  const uint64_t nw = n / 8;
  const uint64_t w0 = chunk * chunk_words;
  const uint64_t cw = w0 >= nw ? 0 : (nw - w0 < chunk_words ? nw - w0 : chunk_words);
  uint64_t bytes = 8 * ((cw + 2 - static_cast<uint64_t>(k)) / 3);
  if (k == 0 && chunk + 1 == num_chunks(n, chunk_words)) bytes += n % 8;
  return bytes;
}

// The raw lanes (from state 0) of one chunk of the segment [p, p + n).
FKV_CRC_HD void chunk_lanes(const Table t, const uint8_t* p, uint64_t n, uint64_t chunk_words,
                            uint64_t chunk, uint32_t raw[3]) {
  const uint64_t nw = n / 8;
  const uint64_t w0 = chunk * chunk_words;
  const uint64_t w1 = w0 + chunk_words < nw ? w0 + chunk_words : nw;
  uint32_t c0 = 0, c1 = 0, c2 = 0;
  uint64_t w = w0;
  for (; w + 3 <= w1; w += 3) {
    const uint8_t* q = p + 8 * w;
    c0 = update_word(t, c0, load_word(q));
    c1 = update_word(t, c1, load_word(q + 8));
    c2 = update_word(t, c2, load_word(q + 16));
  }
  if (w < w1) c0 = update_word(t, c0, load_word(p + 8 * w++));
  if (w < w1) c1 = update_word(t, c1, load_word(p + 8 * w++));
  if (chunk + 1 == num_chunks(n, chunk_words)) {
    for (uint64_t b = 8 * nw; b < n; b++) c0 = update_byte(t, c0, p[b]);
  }
  raw[0] = c0;
  raw[1] = c1;
  raw[2] = c2;
}

// Folds `count` chunks' raw lanes (chunk-major, 3 per chunk) starting at chunk
// `first` into `state` (3 lanes); `len` (3 lanes) grows by their bytes.
FKV_CRC_HD void fold_chunks(const uint32_t* raw, uint64_t n, uint64_t chunk_words,
                            uint64_t first, uint64_t count, uint32_t state[3], uint64_t len[3]) {
  for (int k = 0; k < 3; k++) {
    const uint32_t full = xpow8n(lane_bytes(n, chunk_words, 0, k));  // a whole chunk's
    for (uint64_t c = first; c < first + count; c++) {
      const uint64_t bytes = lane_bytes(n, chunk_words, c, k);
      const bool whole = c + 1 < num_chunks(n, chunk_words);
      state[k] = (whole ? mulmod(state[k], full) : fold(state[k], 0, bytes)) ^ raw[3 * c + k];
      len[k] += bytes;
    }
  }
}

// Folds `count` partials (per partial: 3 lanes' raw state and bytes) in order
// into `state`. Partials of one segment mostly share one length: its power of x
// is computed once per run of equal lengths.
FKV_CRC_HD void fold_parts(const uint32_t (*part)[3], const uint64_t (*len)[3], uint64_t count,
                           uint32_t state[3]) {
  for (int k = 0; k < 3; k++) {
    uint64_t last = ~uint64_t{0};
    uint32_t shift = kOne;
    for (uint64_t i = 0; i < count; i++) {
      if (len[i][k] != last) {
        last = len[i][k];
        shift = xpow8n(last);
      }
      state[k] = mulmod(state[k], shift) ^ part[i][k];
    }
  }
}

// ---- the kernels' threads (fkv_crc_cuda.cuh), and their host emulation -------

// A segment of a call: `first_chunk` numbers its first chunk among all
// segments' chunks (one after another, in order).
struct Segment {
  const uint8_t* p;
  uint64_t n;
  uint64_t first_chunk;
};

// Sets every segment's first_chunk; returns the chunks of all of them, or
// UINT64_MAX once that count would pass 2^64 (it must not wrap to a small count
// a caller's bound accepts: the kernels would index past its buffer).
inline uint64_t plan_segments(Segment* segs, int64_t num_segs, uint64_t chunk_words) {
  uint64_t total = 0;
  for (int64_t i = 0; i < num_segs; i++) {
    segs[i].first_chunk = total;
    const uint64_t chunks = num_chunks(segs[i].n, chunk_words);
    if (chunks > UINT64_MAX - total) return UINT64_MAX;
    total += chunks;
  }
  return total;
}

// The segment of global chunk g: the last whose first chunk is <= g.
FKV_CRC_HD int64_t segment_of(const Segment* segs, int64_t num_segs, uint64_t g) {
  int64_t lo = 0, hi = num_segs - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (segs[mid].first_chunk <= g) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Kernel 1, thread g (< all chunks): its chunk's raw lanes into raw[3 g ..].
FKV_CRC_HD void chunk_thread(const Table t, const Segment* segs, int64_t num_segs,
                             uint64_t chunk_words, uint64_t g, uint32_t* raw) {
  const Segment s = segs[segment_of(segs, num_segs, g)];
  chunk_lanes(t, s.p, s.n, chunk_words, g - s.first_chunk, raw + 3 * g);
}

// Kernel 2, thread `th` of `threads` on segment s: the partial of its equal run
// of the segment's chunks (zero, of no bytes, past the last chunk).
FKV_CRC_HD void fold_thread(const Segment& s, const uint32_t* raw, uint64_t chunk_words,
                            uint64_t th, uint64_t threads, uint32_t part[3], uint64_t len[3]) {
  for (int k = 0; k < 3; k++) part[k] = 0, len[k] = 0;
  const uint64_t chunks = num_chunks(s.n, chunk_words);
  const uint64_t per = (chunks + threads - 1) / threads;
  const uint64_t first = th * per;
  if (first >= chunks) return;
  const uint64_t count = chunks - first < per ? chunks - first : per;
  fold_chunks(raw + 3 * s.first_chunk, s.n, chunk_words, first, count, part, len);
}

// Kernel 2, thread 0 after the others: the segment's finished lanes.
FKV_CRC_HD void finish_segment(const uint32_t (*part)[3], const uint64_t (*len)[3],
                               uint64_t threads, uint32_t lanes[3]) {
  uint32_t state[3] = {0xffffffffu, 0xffffffffu, 0xffffffffu};
  fold_parts(part, len, threads, state);
  for (int k = 0; k < 3; k++) lanes[k] = ~state[k];
}

// The block checksum from the finished lanes of `num_segments` segments (host).
inline uint32_t checksum_of_lanes(const Table t, const uint32_t* lanes, int64_t num_segments) {
  uint32_t c = 0xffffffffu;
  for (int64_t i = 0; i < 3 * num_segments; i++) {
    const uint32_t l = lanes[i];
    const uint8_t b[4] = {static_cast<uint8_t>(l), static_cast<uint8_t>(l >> 8),
                          static_cast<uint8_t>(l >> 16), static_cast<uint8_t>(l >> 24)};
    c = update(t, c, b, 4);
  }
  return ~c;
}

// Both kernels run thread by thread on the host (segs: p and n set), then the
// lanes' checksum: what fkv_cuda_crc3way computes, for the CPU tests.
inline uint32_t checksum_emulated(const Table t, Segment* segs, int64_t num_segs,
                                  uint64_t chunk_words, uint64_t threads) {
  const uint64_t total = plan_segments(segs, num_segs, chunk_words);
  std::vector<uint32_t> raw(3 * total), lanes(3 * num_segs);
  for (uint64_t g = 0; g < total; g++) chunk_thread(t, segs, num_segs, chunk_words, g, raw.data());
  std::vector<uint32_t> part(3 * threads);
  std::vector<uint64_t> len(3 * threads);
  for (int64_t b = 0; b < num_segs; b++) {
    for (uint64_t th = 0; th < threads; th++) {
      fold_thread(segs[b], raw.data(), chunk_words, th, threads, &part[3 * th], &len[3 * th]);
    }
    finish_segment(reinterpret_cast<const uint32_t(*)[3]>(part.data()),
                   reinterpret_cast<const uint64_t(*)[3]>(len.data()), threads, &lanes[3 * b]);
  }
  return checksum_of_lanes(t, lanes.data(), num_segs);
}

}  // namespace crc
}  // namespace fkv

#endif  // FKV_CRC32C_H_
