// Host harness for the CUDA path's index mapping (custom_ops/csrc/fkv_cuda_plan.h).
//
// Plays both launchers of fkv_cuda.cu on host memory: the same validation and
// coalescing, the same copy-engine/kernel split, the same staging-slot chunking and
// descriptor groups, then every CTA of every launch walking its grid-stride chunks
// and every thread its unrolled elements, with the plan's own functions. The
// "device" and "host" regions are both host memory here, so the result can be
// compared byte for byte with a plain copy. Built by tests/ops/test_cuda_plan.py.
//
// Every write is also counted per destination byte (Coverage): a simulated call
// fails with kWrittenTwice or kMissedOrStray unless each byte of the destination
// blocks is written exactly once and nothing else is written. A byte written twice
// with the right value is invisible to a comparison of the results; this catches
// it. sim_set_mutant plants a known bug in the harness's copy of a launcher, so a
// test can check that the checks catch it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "fkv_cuda_plan.h"
#include "fkv_internal.h"

namespace {

using namespace fkv;

constexpr int kWrittenTwice = -5;  // a destination byte written more than once
constexpr int kMissedOrStray = -6;  // a destination byte not written, or a byte outside them

// Planted bugs (sim_set_mutant); 0: none.
enum Mutant {
  kNoMutant = 0,
  kOneLaunchFirstSlotIds = 1,      // one launch per slot, each reading the first slot's ids
  kOneLaunchWithoutRunLen = 2,     // one launch: the kernel also moves copy-engine ids
  kOneLaunchFirstLayerChunks = 3,  // one launch sized by the first layer's chunks only
  kRangesDropLast = 4,             // a bounded eviction leaves out its last launch
  kRangesOverlap = 5,              // each bounded launch after the first starts a chunk early
};
int g_mutant = kNoMutant;
// The evict-launch bound the simulated launcher uses (the core's default until a
// test sets another).
int64_t g_evict_launch_bytes = kDefaultEvictLaunchBytes;

// Per-byte write counts of the destination regions of one simulated call.
class Coverage {
 public:
  // A region writes may land in (a segment's destination side).
  void add_region(const char* base, int64_t bytes) {
    regions_.push_back({base, bytes, std::vector<uint8_t>(bytes), std::vector<uint8_t>(bytes)});
    std::sort(regions_.begin(), regions_.end(),
              [](const Region& a, const Region& b) { return a.base < b.base; });
  }
  // Bytes that must be written exactly once (inside a region).
  void expect(const char* dst, int64_t bytes) { mark(dst, bytes, true); }
  // False (and counted as stray) outside every region: the caller skips the write.
  bool write(const char* dst, int64_t bytes) { return mark(dst, bytes, false); }
  int verdict() const {
    if (stray_ > 0) return kMissedOrStray;
    for (const Region& r : regions_) {
      for (int64_t i = 0; i < r.bytes; ++i) {
        if (r.got[i] > 1) return kWrittenTwice;
      }
    }
    for (const Region& r : regions_) {
      if (r.got != r.want) return kMissedOrStray;
    }
    return 0;
  }

 private:
  struct Region {
    const char* base;
    int64_t bytes;
    std::vector<uint8_t> want;
    std::vector<uint8_t> got;
  };
  bool mark(const char* p, int64_t bytes, bool want) {
    auto it = std::upper_bound(regions_.begin(), regions_.end(), p,
                               [](const char* q, const Region& r) { return q < r.base; });
    if (it == regions_.begin() || p - (it - 1)->base + bytes > (it - 1)->bytes) {
      ++stray_;
      return false;
    }
    Region& r = *(it - 1);
    const int64_t off = p - r.base;
    std::vector<uint8_t>& v = want ? r.want : r.got;
    for (int64_t i = 0; i < bytes; ++i) v[off + i] = std::min(v[off + i] + 1, 2);
    return true;
  }
  std::vector<Region> regions_;
  int64_t stray_ = 0;
};

// The destination regions of a call and the blocks it must write: segments
// [s_begin, s_end) times every id.
void plan_coverage(const fkv_segment* segments, int32_t num_segments, int32_t s_begin,
                   int32_t s_end, int64_t num_device_blocks, int64_t num_host_blocks,
                   const int64_t* device_ids, const int64_t* host_ids, int64_t num_ids,
                   bool h2d, Coverage* cov) {
  // Each segment's destination span; the host tier's interleave, so overlapping
  // spans are merged into one region (writes are counted per byte).
  std::vector<std::pair<const char*, const char*>> spans;
  for (int32_t s = 0; s < num_segments; ++s) {
    const fkv_segment& f = segments[s];
    const char* base = static_cast<const char*>(h2d ? f.device_base : f.host_base);
    const int64_t n = h2d ? num_device_blocks : num_host_blocks;
    const int64_t stride = h2d ? f.block_bytes : f.host_stride;
    if (n > 0) spans.push_back({base, base + (n - 1) * stride + f.block_bytes});
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 0; i < spans.size();) {
    const char* end = spans[i].second;
    size_t j = i + 1;
    while (j < spans.size() && spans[j].first < end) end = std::max(end, spans[j++].second);
    cov->add_region(spans[i].first, end - spans[i].first);
    i = j;
  }
  for (int32_t s = s_begin; s < s_end; ++s) {
    const fkv_segment& f = segments[s];
    const char* base = static_cast<const char*>(h2d ? f.device_base : f.host_base);
    const int64_t stride = h2d ? f.block_bytes : f.host_stride;
    for (int64_t i = 0; i < num_ids; ++i) {
      cov->expect(base + (h2d ? device_ids[i] : host_ids[i]) * stride, f.block_bytes);
    }
  }
}

struct Totals {
  int64_t kernel_bytes = 0;
  int64_t memcpy_bytes = 0;
  int64_t launches = 0;
  int64_t misaligned = 0;  // accesses not aligned to the chosen vector width
  // The latency model: a CTA's loads of one unrolled step are in flight together,
  // so its steps are its dependent round trips over PCIe. Summed over launches, the
  // busiest CTA's steps and its chunk lookups (empty ones included).
  int64_t critical_steps = 0;
  int64_t critical_lookups = 0;
  int64_t most_launch_bytes = 0;  // the most kernel bytes one launch moved
  Coverage cov;
};

void move(char* dst, const char* src, int v, Totals* t) {
  if (reinterpret_cast<uintptr_t>(dst) % v || reinterpret_cast<uintptr_t>(src) % v) {
    ++t->misaligned;
  }
  if (t->cov.write(dst, v)) std::memcpy(dst, src, v);
  t->kernel_bytes += v;
}

void report(const Totals& t, int64_t* totals) {
  totals[0] = t.kernel_bytes;
  totals[1] = t.memcpy_bytes;
  totals[2] = t.launches;
  totals[3] = t.misaligned;
  totals[4] = t.critical_steps;
  totals[5] = t.critical_lookups;
  totals[6] = t.most_launch_bytes;
}

// One kernel launch over chunk numbers [first, end): CTA b takes chunks first + b,
// then next_chunk(...), ...; thread t of a chunk moves elements
// thread_element(base, u) for base = t, t + kThreads * unroll, ... (unroll_for the
// chunk's vector width) and u < unroll: whole pieces as
// copy_chunk, gathers as copy_gather.
void simulate_grid(const DevSegment* segs, int32_t num_segs, int64_t first, int64_t end,
                   const int64_t* dev_ids, const int64_t* host_ids, const int32_t* run_len,
                   int64_t count, int64_t memcpy_min, bool h2d, int32_t grid, Totals* t) {
  ++t->launches;
  const int64_t bytes_before = t->kernel_bytes;
  const int32_t g_size = static_cast<int32_t>(std::min<int64_t>(grid, end - first));
  int64_t most_steps = 0;
  int64_t most_lookups = 0;
  for (int32_t b = 0; b < g_size; ++b) {
    int64_t steps = 0;
    int64_t lookups = 0;
    ChunkCopy c;
    for (int64_t g = first + b; g < end; g = next_chunk(g, g_size, c.next)) {
      ++lookups;
      if (!locate_chunk(segs, num_segs, count, g, dev_ids, host_ids, run_len, memcpy_min, h2d,
                        &c)) {
        continue;
      }
      const int v = c.vec_bytes;
      if (c.nbytes % v) ++t->misaligned;
      const int64_t n = c.nbytes / v;
      const int unroll = unroll_for(v);
      const int64_t step = int64_t{kThreads} * unroll;
      steps += (n + step - 1) / step;
      for (int tid = 0; tid < kThreads; ++tid) {
        for (int64_t base = tid; base < n; base += step) {
          for (int u = 0; u < unroll; ++u) {
            const int64_t k = thread_element(base, u);
            if (k >= n) continue;
            if (c.num_ids == 1) {
              move(c.dst + k * v, c.src + k * v, v, t);
              continue;
            }
            char* dst = nullptr;
            const char* src = nullptr;
            if (chunk_element(c, k, dev_ids, host_ids, run_len, &dst, &src)) {
              move(dst, src, v, t);
            }
          }
        }
      }
    }
    most_steps = std::max(most_steps, steps);
    most_lookups = std::max(most_lookups, lookups);
  }
  t->critical_steps += most_steps;
  t->critical_lookups += most_lookups;
  t->most_launch_bytes = std::max(t->most_launch_bytes, t->kernel_bytes - bytes_before);
}

// One launch_kernel call: launch_ranges cuts the chunk numbers of descriptors
// [0, sized) (num_segs, but for a mutant) into ranges of at most max_work chunks
// with work (an eviction's bound; 0: one range), and each range is one grid.
void simulate_launch(const DevSegment* segs, int32_t num_segs, int32_t sized,
                     const int64_t* dev_ids, const int64_t* host_ids, const int32_t* run_len,
                     int64_t count, int64_t memcpy_min, bool h2d, int32_t grid, Totals* t) {
  const int64_t max_work = h2d ? 0 : launch_max_work(g_evict_launch_bytes, grid);
  std::vector<int64_t> ends;
  launch_ranges(segs, sized, count, max_work, &ends);
  if (g_mutant == kRangesDropLast && ends.size() > 1) ends.pop_back();
  int64_t begin = 0;
  for (const int64_t end : ends) {
    const int64_t first = g_mutant == kRangesOverlap && begin > 0 ? begin - 1 : begin;
    simulate_grid(segs, num_segs, first, end, dev_ids, host_ids, run_len, count, memcpy_min, h2d,
                  grid, t);
    begin = end;
  }
}


// Blocks of one segment that go to the copy engine, counted the long way: checks
// that the launchers' O(1) RunExtent split says the same.
int64_t memcpy_blocks(const std::vector<BlockRun>& runs, int64_t min_run) {
  int64_t n = 0;
  for (const BlockRun& r : runs) {
    if (r.num_blocks >= min_run) n += r.num_blocks;
  }
  return n;
}

bool extent_agrees(const RunExtent& e, const std::vector<BlockRun>& runs, int64_t num_ids,
                   int64_t min_run) {
  const int64_t by_engine = memcpy_blocks(runs, min_run);
  return e.engine_moves_some(min_run) == (by_engine > 0) &&
         e.kernel_moves_some(min_run) == (by_engine < num_ids);
}

int copy_runs(const PlanSegment& seg, const std::vector<BlockRun>& runs, int64_t min_run,
              bool h2d, Totals* t) {
  // As the launcher: one copy per run, rows of block_bytes host_stride apart on the
  // host (cudaMemcpy2DAsync where they are not back to back).
  for (const BlockRun& run : runs) {
    if (run.num_blocks < min_run) continue;
    for (int64_t k = 0; k < run.num_blocks; ++k) {
      char* dev = seg.device + (run.device_id + k) * seg.block_bytes;
      char* host = seg.host + (run.host_id + k) * seg.host_stride;
      const size_t bytes = static_cast<size_t>(seg.block_bytes);
      if (h2d) {
        std::memcpy(dev, host, bytes);
      } else {
        std::memcpy(host, dev, bytes);
      }
      t->cov.write(h2d ? dev : host, static_cast<int64_t>(bytes));
      t->memcpy_bytes += static_cast<int64_t>(bytes);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// fkv_swap_cuda's plan: descriptors and ids staged together, segment groups of at
// most max_group descriptors (<= 0: what a slot of slot_bytes allows).
int sim_swap_cuda(const fkv_segment* segments, int32_t num_segments, int64_t num_device_blocks,
                  int64_t num_host_blocks, const int64_t* device_ids, const int64_t* host_ids,
                  int64_t num_ids, int32_t direction, int64_t memcpy_min, int32_t grid,
                  int64_t slot_bytes, int32_t max_group, int64_t* totals) {
  std::vector<BlockRun> runs;
  int rc = validate_swap(segments, num_segments, num_device_blocks, num_host_blocks, device_ids,
                         host_ids, num_ids, direction, &runs);
  if (rc != FKV_OK || runs.empty()) return rc;
  const bool h2d = direction == FKV_H2D;
  Totals t;
  plan_coverage(segments, num_segments, 0, num_segments, num_device_blocks, num_host_blocks,
                device_ids, host_ids, num_ids, h2d, &t.cov);
  std::vector<DevSegment> descs;
  const RunExtent extent = run_extent(runs);
  bool any_skipped = false;
  for (int32_t s = 0; s < num_segments; ++s) {
    const fkv_segment& f = segments[s];
    PlanSegment seg{static_cast<char*>(f.device_base), static_cast<char*>(f.host_base),
                    static_cast<char*>(f.host_base), f.block_bytes, f.host_stride};
    const int64_t min_run = memcpy_min_run(memcpy_min, seg.block_bytes);
    if (!extent_agrees(extent, runs, num_ids, min_run)) return -4;  // split disagrees
    const bool by_engine = extent.engine_moves_some(min_run);
    if (by_engine) copy_runs(seg, runs, min_run, h2d, &t);
    if (!extent.kernel_moves_some(min_run)) continue;
    any_skipped = any_skipped || by_engine;
    descs.push_back(make_dev_segment(seg));
  }
  std::vector<int32_t> run_len;
  if (any_skipped) {
    run_len.resize(num_ids);
    fill_run_len(runs, run_len.data());
  }
  const int32_t nk = static_cast<int32_t>(descs.size());
  const int32_t limit =
      max_group > 0 ? max_group : static_cast<int32_t>(slot_bytes / 2 / sizeof(DevSegment));
  for (int32_t g0 = 0; g0 < nk; g0 += limit) {
    const int32_t group = std::min(limit, nk - g0);
    DevSegment* gdescs = descs.data() + g0;
    set_chunk_prefixes(gdescs, group);
    const int64_t max_ids = ids_per_slot(static_cast<size_t>(slot_bytes),
                                         group * sizeof(DevSegment), any_skipped);
    if (max_ids <= 0) return -2;  // a slot too small for its descriptors
    for (int64_t i0 = 0; i0 < num_ids; i0 += max_ids) {
      const int64_t count = std::min(max_ids, num_ids - i0);
      const SlotLayout sl = slot_layout(group * sizeof(DevSegment), count, any_skipped);
      if (sl.total > static_cast<size_t>(slot_bytes)) return -3;  // overflowed the slot
      // Stage through a buffer laid out exactly like a slot.
      std::vector<char> slot(sl.total);
      std::memcpy(slot.data() + sl.descs, gdescs, group * sizeof(DevSegment));
      std::memcpy(slot.data() + sl.device_ids, device_ids + i0, count * sizeof(int64_t));
      std::memcpy(slot.data() + sl.host_ids, host_ids + i0, count * sizeof(int64_t));
      if (any_skipped) {
        std::memcpy(slot.data() + sl.run_len, run_len.data() + i0, count * sizeof(int32_t));
      }
      const DevSegment* staged = reinterpret_cast<const DevSegment*>(slot.data() + sl.descs);
      simulate_launch(staged, group, group,
                      reinterpret_cast<const int64_t*>(slot.data() + sl.device_ids),
                      reinterpret_cast<const int64_t*>(slot.data() + sl.host_ids),
                      any_skipped ? reinterpret_cast<const int32_t*>(slot.data() + sl.run_len)
                                  : nullptr,
                      count, memcpy_min, h2d, grid, &t);
    }
  }
  report(t, totals);
  return t.cov.verdict();
}

// fkv_layout_swap's plan: descriptors uploaded once with chunk prefixes restarting
// at every layer (and once more numbered across the whole table), ids staged once
// in slots of slot_bytes. With layer events (has_events != 0), or for a part of
// the layers: per layer the copy-engine runs and one launch per staged chunk of
// ids. Without, for every layer (takes_one_launch): every segment's copy-engine
// runs, then one launch per staged chunk of ids over the whole table.
int sim_layout_swap(const fkv_segment* segments, int32_t num_segments, int32_t segments_per_layer,
                    int64_t num_device_blocks, int64_t num_host_blocks, const int64_t* device_ids,
                    const int64_t* host_ids, int64_t num_ids, int32_t direction,
                    int32_t first_layer, int32_t num_layers, int32_t has_events,
                    int64_t memcpy_min, int32_t grid, int64_t slot_bytes, int64_t* totals) {
  int rc = validate_segments(segments, num_segments, num_device_blocks, num_host_blocks, -1);
  if (rc != FKV_OK) return rc;
  std::vector<BlockRun> runs;
  rc = validate_ids(num_device_blocks, num_host_blocks, device_ids, host_ids, num_ids, direction,
                    &runs);
  if (rc != FKV_OK) return rc;
  const bool h2d = direction == FKV_H2D;
  const int32_t spl = segments_per_layer;
  const int32_t layout_layers = num_segments / spl;
  std::vector<PlanSegment> segs(num_segments);
  std::vector<DevSegment> descs(num_segments);
  for (int32_t s = 0; s < num_segments; ++s) {
    const fkv_segment& f = segments[s];
    segs[s] = {static_cast<char*>(f.device_base), static_cast<char*>(f.host_base),
               static_cast<char*>(f.host_base), f.block_bytes, f.host_stride};
    descs[s] = make_dev_segment(segs[s]);
  }
  for (int32_t l = 0; l < layout_layers; ++l) set_chunk_prefixes(&descs[l * spl], spl);
  std::vector<DevSegment> descs_all = descs;
  set_chunk_prefixes(descs_all.data(), num_segments);
  const int32_t seg_begin = first_layer * spl;
  const int32_t seg_end = (first_layer + num_layers) * spl;
  const RunExtent extent = run_extent(runs);
  bool with_run_len = false;
  for (int32_t s = seg_begin; s < seg_end && num_ids; ++s) {
    if (extent.engine_moves_some(memcpy_min_run(memcpy_min, segs[s].block_bytes))) {
      with_run_len = true;
    }
  }
  std::vector<int32_t> run_len;
  if (with_run_len) {
    run_len.resize(num_ids);
    fill_run_len(runs, run_len.data());
  }
  const int64_t per_slot = ids_per_slot(static_cast<size_t>(slot_bytes), 0, with_run_len);
  if (per_slot <= 0) return -2;
  Totals t;
  plan_coverage(segments, num_segments, seg_begin, seg_end, num_device_blocks, num_host_blocks,
                device_ids, host_ids, num_ids, h2d, &t.cov);
  // Copy-engine runs of segments [s0, s1); whether the kernel has work there.
  auto engine_runs = [&](int32_t s0, int32_t s1, bool* needs_kernel) {
    *needs_kernel = false;
    for (int32_t s = s0; s < s1; ++s) {
      const int64_t min_run = memcpy_min_run(memcpy_min, segs[s].block_bytes);
      if (!extent_agrees(extent, runs, num_ids, min_run)) return false;
      if (extent.engine_moves_some(min_run)) copy_runs(segs[s], runs, min_run, h2d, &t);
      *needs_kernel = *needs_kernel || extent.kernel_moves_some(min_run);
    }
    return true;
  };
  // One launch per staged chunk of ids over descriptors [0, nseg) of `table`.
  // `sized`: the descriptors the launch is sized by (nseg, but for a mutant).
  auto launches = [&](const DevSegment* table, int32_t nseg, int32_t sized, bool pass_run_len,
                      bool first_slot_ids) {
    for (int64_t i0 = 0; i0 < num_ids; i0 += per_slot) {
      const int64_t count = std::min(per_slot, num_ids - i0);
      const SlotLayout sl = slot_layout(0, count, with_run_len);
      if (sl.total > static_cast<size_t>(slot_bytes)) return false;
      const int64_t at = first_slot_ids ? 0 : i0;
      simulate_launch(table, nseg, sized, device_ids + at, host_ids + at,
                      pass_run_len ? run_len.data() + at : nullptr, count, memcpy_min, h2d,
                      grid, &t);
    }
    return true;
  };
  bool needs_kernel = false;
  if (takes_one_launch(has_events != 0, first_layer, num_layers, layout_layers)) {
    if (!engine_runs(seg_begin, seg_end, &needs_kernel)) return -4;  // split disagrees
    const int32_t nseg = seg_end - seg_begin;
    const int32_t sized = g_mutant == kOneLaunchFirstLayerChunks ? spl : nseg;
    const bool pass = with_run_len && g_mutant != kOneLaunchWithoutRunLen;
    if (needs_kernel && !launches(descs_all.data(), nseg, sized, pass,
                                  g_mutant == kOneLaunchFirstSlotIds)) {
      return -3;  // overflowed the slot
    }
  } else {
    for (int32_t layer = first_layer; layer < first_layer + num_layers; ++layer) {
      const int32_t s0 = layer * spl;
      if (!engine_runs(s0, s0 + spl, &needs_kernel)) return -4;  // split disagrees
      if (needs_kernel && !launches(&descs[s0], spl, spl, with_run_len, false)) {
        return -3;  // overflowed the slot
      }
    }
  }
  report(t, totals);
  return t.cov.verdict();
}

// The plan's division (div_nonneg) and whether it took the 32-bit path.
int64_t sim_div(int64_t a, int64_t b, int32_t* fast) {
  *fast = fits_u32(a, b) ? 1 : 0;
  return div_nonneg(a, b);
}

int64_t sim_memcpy_min_run(int64_t memcpy_min_bytes, int64_t block_bytes) {
  return memcpy_min_run(memcpy_min_bytes, block_bytes);
}

// Sets the evict-launch bound of the simulated launcher (fkv_cuda_set_evict_launch_bytes).
void sim_set_evict_launch_bytes(int64_t bytes) { g_evict_launch_bytes = bytes; }

// Plants bug `mutant` (see Mutant) in the harness's launchers; 0 removes it.
void sim_set_mutant(int32_t mutant) { g_mutant = mutant; }

// The addresses element k (in vector units) of chunk g of a launch would touch,
// without touching them: lets the test check 64-bit offsets (beyond 4 GiB) and
// vector widths on made-up base addresses. `quads` holds (device base, kernel
// host base, block bytes, host stride) per segment. out: dst, src, chunk bytes, vector width,
// ids in the chunk (0: an empty chunk, nothing else set).
int sim_locate(const int64_t* quads, int32_t num_segs, int64_t count, int64_t g, int64_t k,
               const int64_t* device_ids, const int64_t* host_ids, int32_t h2d,
               uint64_t* out) {
  std::vector<DevSegment> copy(num_segs);
  for (int32_t s = 0; s < num_segs; ++s) {
    char* dev = reinterpret_cast<char*>(static_cast<uintptr_t>(quads[4 * s]));
    char* host = reinterpret_cast<char*>(static_cast<uintptr_t>(quads[4 * s + 1]));
    copy[s] = make_dev_segment(PlanSegment{dev, host, host, quads[4 * s + 2], quads[4 * s + 3]});
  }
  set_chunk_prefixes(copy.data(), num_segs);
  if (g < 0 || g >= launch_chunks(copy[num_segs - 1], count)) return -1;
  ChunkCopy c;
  out[4] = 0;
  if (!locate_chunk(copy.data(), num_segs, count, g, device_ids, host_ids, nullptr, 0, h2d != 0,
                    &c)) {
    return 0;
  }
  if (k < 0 || k >= c.nbytes / c.vec_bytes) return -2;
  char* dst = nullptr;
  const char* src = nullptr;
  if (c.num_ids > 1) {
    chunk_element(c, k, device_ids, host_ids, nullptr, &dst, &src);
  } else {
    dst = c.dst + k * c.vec_bytes;
    src = c.src + k * c.vec_bytes;
  }
  out[0] = reinterpret_cast<uintptr_t>(dst);
  out[1] = reinterpret_cast<uintptr_t>(src);
  out[2] = static_cast<uint64_t>(c.nbytes);
  out[3] = static_cast<uint64_t>(c.vec_bytes);
  out[4] = static_cast<uint64_t>(c.num_ids);
  return 0;
}

}  // extern "C"
