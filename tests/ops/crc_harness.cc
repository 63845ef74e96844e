// Host harness of fkv_crc32c.h: the GPU kernel's chunk-then-fold algorithm run on
// the CPU, so the tests compare it with storage's crc32c-3way (no GPU needed).
#include <vector>

#include "fkv_crc32c.h"

extern "C" uint32_t crc_harness_checksum(const int64_t* segs, int64_t num_segments,
                                         uint64_t chunk_words, uint64_t threads) {
  static fkv::crc::Table table;
  static const bool filled = (fkv::crc::fill_table(table), true);
  (void)filled;
  std::vector<fkv::crc::Segment> s(num_segments);
  for (int64_t i = 0; i < num_segments; i++) {
    s[i].p = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(segs[2 * i]));
    s[i].n = static_cast<uint64_t>(segs[2 * i + 1]);
  }
  return fkv::crc::checksum_emulated(table, s.data(), num_segments, chunk_words, threads);
}

extern "C" uint32_t crc_harness_xpow8n(uint64_t n) { return fkv::crc::xpow8n(n); }

extern "C" uint32_t crc_harness_fold(uint32_t state, uint32_t raw, uint64_t nbytes) {
  return fkv::crc::fold(state, raw, nbytes);
}

// The chunks plan_segments counts for segments of `lengths` (no memory read).
extern "C" uint64_t crc_harness_plan_total(const int64_t* lengths, int64_t num_segments,
                                           uint64_t chunk_words) {
  std::vector<fkv::crc::Segment> s(num_segments);
  for (int64_t i = 0; i < num_segments; i++) s[i].n = static_cast<uint64_t>(lengths[i]);
  return fkv::crc::plan_segments(s.data(), num_segments, chunk_words);
}
