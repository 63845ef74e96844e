// The CUDA path's index mapping and launch planning, written once for nvcc and the
// host compiler: the kernel and the launcher in fkv_cuda.cu use these functions,
// and tests/ops/mapping_harness.cc compiles them for the host and runs whole grids
// against a plain copy, so CI catches mapping bugs without a GPU.
//
// A launch covers one group of segments (a layer, or a slice of a long segment
// list) and `count` ids. Its work is a sequence of chunks of at most 16 KiB; CTA b
// takes chunks b, b + grid, ... (grid-stride). Every segment owns
// count * chunks_per_block[s] chunk numbers, so the numbering is linear in count
// and the descriptors can be staged once per layout:
//
//   g = count * chunk_prefix[s] + local          (local < count * chunks_per_block[s])
//
//   large block (> 8 KiB): local = i * chunks_per_block + c
//     -> bytes [c * 16 KiB, min((c + 1) * 16 KiB, block_bytes)) of id i's block
//   small block (<= 8 KiB, ids_per_chunk = 16 KiB / block_bytes >= 2):
//     -> local v < ceil(count / ids_per_chunk): whole blocks of ids
//        [v * ids_per_chunk, min((v + 1) * ids_per_chunk, count)), a gather
//     -> local v beyond that: empty; the CTA jumps past the segment's rest
//
//   segment:   K (16 KiB)        V (16 KiB)        K scales (32 B)  V scales (32 B)
//   chunks:  | id0 id1 ... idN | id0 id1 ... idN | g0 . . . . . . | g0 . . . . . . |
//                                                   ^ ids 0..N      ^ ids 0..N
//
// So a 4-byte fp8 scale block costs a 16 KiB gather's share of a round trip, not a
// round trip of its own, and 4 KiB blocks keep a CTA's 16 KiB of loads in flight.
#ifndef FASTKV_CUDA_PLAN_H_
#define FASTKV_CUDA_PLAN_H_

#include <stddef.h>
#include <stdint.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "fkv_internal.h"

#if defined(__CUDACC__)
#define FKV_HD __host__ __device__ __forceinline__
#else
#define FKV_HD inline
#endif

namespace fkv {

constexpr int kThreads = 256;
// Bytes each thread keeps in flight per unrolled step: its loads of a step are
// issued together and its steps are its dependent round trips over PCIe. The
// unroll is per vector width so that every width keeps the same bytes in flight:
// 4 x 16 B, 8 x 8 B, 16 x 4 B. With one unroll of 4 for every width, a layout
// only 4-byte aligned kept 16 CTAs x 256 threads x 4 x 4 B = 64 KiB in flight,
// below PCIe Gen5's bandwidth-delay product (~100-128 KiB at ~1-2 us, ~64 GB/s):
// about half rate. Now every width keeps 256 KiB in flight (16 CTAs), and one step
// of a CTA is kThreads x 64 B = 16 KiB, a chunk, whatever the width.
constexpr int kBytesInFlightPerThread = 64;
FKV_HD constexpr int unroll_for(int vec_bytes) { return kBytesInFlightPerThread / vec_bytes; }
// One CTA moves kThreads * kBytesInFlightPerThread = 16 KiB per iteration; blocks
// larger than a chunk are shared between CTAs.
constexpr int64_t kChunkBytes = int64_t{16} << 10;

// What the kernel knows of one segment (56 bytes, read from device memory).
struct DevSegment {
  char* device;              // device_base
  char* host;                // the kernel's address of host_base on this device
  int64_t block_bytes;
  int64_t host_stride;       // host block b at host + b * host_stride
  int64_t chunks_per_block;
  int64_t chunk_prefix;      // chunks per id of the earlier segments of the group
  int32_t vec_bytes;         // 16, 8 or 4
  int32_t ids_per_chunk;     // >= 2: whole blocks of this many ids per chunk (a gather)
};

// A 64-bit division is a call of a ~70-instruction routine on the GPU; a 32-bit
// unsigned one is a short inline sequence. Where both operands of a division fit
// in 32 bits (a gather's element index < 4096 and elements per block <= 2048,
// always; ids and chunk numbers of ordinary transfers, nearly always) the 32-bit
// one gives the same quotient, so it is taken after a check that costs one OR and
// a compare; anything larger (a copy-engine threshold of 2**63 - 1, offsets past
// 4 GiB) takes the 64-bit one.
FKV_HD bool fits_u32(int64_t a, int64_t b) {
  return ((static_cast<uint64_t>(a) | static_cast<uint64_t>(b)) >> 32) == 0;
}

// a / b for a >= 0, b > 0.
FKV_HD int64_t div_nonneg(int64_t a, int64_t b) {
  if (fits_u32(a, b)) return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
  return a / b;
}

FKV_HD int64_t chunks_per_block(int64_t block_bytes) {
  return (block_bytes + kChunkBytes - 1) / kChunkBytes;
}

// Blocks of at most half a chunk share chunks; larger ones have chunks of their own.
FKV_HD int32_t ids_per_chunk(int64_t block_bytes) {
  return block_bytes <= kChunkBytes / 2 ? static_cast<int32_t>(kChunkBytes / block_bytes) : 1;
}

// The widest access every block start of both regions is aligned to. The host
// tier's blocks are host_stride apart and its segments start at prefix sums of
// block sizes, so a segment behind a 4-byte fp8 scale block (or a stride that is
// not a multiple of 16) copies with narrower accesses.
FKV_HD int32_t vec_bytes_for(uintptr_t device, uintptr_t host_kernel, int64_t block_bytes,
                             int64_t host_stride) {
  const uintptr_t bits = device | host_kernel | static_cast<uintptr_t>(block_bytes) |
                         static_cast<uintptr_t>(host_stride);
  if (bits % 16 == 0) return 16;
  if (bits % 8 == 0) return 8;
  return 4;
}

// Runs of at least this many blocks of a segment go to cudaMemcpyAsync.
FKV_HD int64_t memcpy_min_run(int64_t memcpy_min_bytes, int64_t block_bytes) {
  if (memcpy_min_bytes <= 0) return 1;
  const int64_t q = div_nonneg(memcpy_min_bytes, block_bytes);
  return q + (memcpy_min_bytes - q * block_bytes != 0 ? 1 : 0);
}

// Chunks of one launch: count ids of every segment of the group.
FKV_HD int64_t launch_chunks(const DevSegment& last_segment, int64_t count) {
  return count * (last_segment.chunk_prefix + last_segment.chunks_per_block);
}

// One chunk's copy: a piece of one block (num_ids == 1: nbytes from src to dst), or
// whole blocks of ids first .. first + num_ids - 1 of `seg` (a gather; see
// chunk_element).
struct ChunkCopy {
  char* dst;
  const char* src;
  int64_t nbytes;
  int32_t vec_bytes;
  int32_t num_ids;
  int32_t per_block;  // gather: vec_bytes elements per block (<= 2048)
  int64_t first;
  const DevSegment* seg;
  int64_t min_run;  // gather: ids whose run reaches this are the copy engine's
  int64_t next;     // the first chunk number after this one that may hold work
  bool h2d;
};

// The chunk number a CTA of a grid-stride loop of `grid` CTAs takes after chunk g:
// the first of its own numbers (g + k * grid) at or after c.next.
FKV_HD int64_t next_chunk(int64_t g, int64_t grid, int64_t next) {
  return g + div_nonneg(next - g + grid - 1, grid) * grid;
}

// Locates chunk g (< launch_chunks) of a launch. Returns false when the chunk holds
// nothing to move: the rest of a small-block segment's numbers (c->next then skips
// them), or a block of a run the copy engine moves (run_len non-NULL and the id's
// run reaches the segment's memcpy_min_run).
FKV_HD bool locate_chunk(const DevSegment* segs, int32_t num_segs, int64_t count, int64_t g,
                         const int64_t* device_ids, const int64_t* host_ids,
                         const int32_t* run_len, int64_t memcpy_min_bytes, bool h2d,
                         ChunkCopy* out) {
  // Last segment whose first chunk is <= g (every segment has chunks).
  int32_t lo = 0;
  int32_t hi = num_segs - 1;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo + 1) / 2;
    if (segs[mid].chunk_prefix * count <= g) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const DevSegment& seg = segs[lo];
  const int64_t local = g - seg.chunk_prefix * count;
  const int64_t min_run = memcpy_min_run(memcpy_min_bytes, seg.block_bytes);
  out->next = g + 1;
  out->vec_bytes = seg.vec_bytes;
  out->h2d = h2d;
  if (seg.ids_per_chunk > 1) {
    const int64_t first = local * seg.ids_per_chunk;
    if (first >= count) {
      out->next = (seg.chunk_prefix + seg.chunks_per_block) * count;
      return false;
    }
    const int64_t n = count - first < seg.ids_per_chunk ? count - first : seg.ids_per_chunk;
    if (n > 1) {
      out->num_ids = static_cast<int32_t>(n);
      out->first = first;
      out->per_block = static_cast<int32_t>(div_nonneg(seg.block_bytes, seg.vec_bytes));
      out->seg = &seg;
      out->min_run = run_len != nullptr ? min_run : INT64_MAX;
      out->nbytes = n * seg.block_bytes;
      return true;
    }
  }
  // One id: a piece of its block (the whole block when it is small).
  const int64_t i = seg.ids_per_chunk > 1 ? count - 1 : div_nonneg(local, seg.chunks_per_block);
  if (run_len != nullptr && run_len[i] >= min_run) {
    return false;
  }
  const int64_t off = seg.ids_per_chunk > 1 ? 0 : (local - i * seg.chunks_per_block) * kChunkBytes;
  const int64_t rest = seg.block_bytes - off;
  char* dev = seg.device + device_ids[i] * seg.block_bytes + off;
  char* host = seg.host + host_ids[i] * seg.host_stride + off;
  out->dst = h2d ? dev : host;
  out->src = h2d ? host : dev;
  out->nbytes = rest < kChunkBytes ? rest : kChunkBytes;
  out->num_ids = 1;
  return true;
}

// Element k (in vec_bytes units, k < c.nbytes / c.vec_bytes) of a gather chunk:
// offset (k mod elements per block) of id c.first + k / (elements per block).
// Returns false for an id whose run the copy engine moves.
FKV_HD bool chunk_element(const ChunkCopy& c, int64_t k, const int64_t* device_ids,
                          const int64_t* host_ids, const int32_t* run_len, char** dst,
                          const char** src) {
  const int64_t per_block = c.per_block;
  const int64_t j = div_nonneg(k, per_block);
  const int64_t i = c.first + j;
  if (run_len != nullptr && run_len[i] >= c.min_run) return false;
  const int64_t off = (k - j * per_block) * c.vec_bytes;
  char* dev = c.seg->device + device_ids[i] * c.seg->block_bytes + off;
  char* host = c.seg->host + host_ids[i] * c.seg->host_stride + off;
  *dst = c.h2d ? dev : host;
  *src = c.h2d ? host : dev;
  return true;
}

// Element k (in vec_bytes units) that thread `tid` moves in unrolled step u of the
// iteration starting at `base` (base = tid, tid + kThreads * unroll_for(vec), ...).
FKV_HD int64_t thread_element(int64_t base, int u) {
  return base + static_cast<int64_t>(u) * kThreads;
}

// ---- host-side planning (shared by the launcher and the host harness) ----

// ---- how long one eviction launch holds its SMs ----
//
// A CTA of the copy kernel stays resident until its grid-stride loop ends, and a
// low stream priority never preempts a resident CTA: priority only orders the CTAs
// still waiting for an SM. So while one launch runs, its max_ctas SMs (16 of an
// H100's 132, 12%) are the model's no more, however long the launch is. A
// one-launch eviction of a whole step (80 layers x K and V x hundreds of blocks)
// runs for milliseconds; the per-layer launches it replaced gave the SMs back
// between layers. An eviction is therefore cut into launches of at most
// evict_launch_bytes of kernel work (FASTKV_CUDA_EVICT_LAUNCH_BYTES, or
// fkv_cuda_set_evict_launch_bytes; 0: one launch). Between two launches the
// compute stream's waiting CTAs, of higher priority, take the freed SMs first, so
// a GEMM that starts while an eviction runs waits at most one launch for them.
//
// Default 2 MiB: at the ~50 GB/s a PCIe Gen5 x16 link moves device to host, one
// launch lasts ~40 us, so a GEMM of >= 100 us (a decode step's MLP on an 8B+
// model; prefill's are longer) loses at most ~12% x 40/100 ~ 5% of its SMs' time
// (the target is <= 5% GEMM slowdown) and only while an eviction overlaps it. Each
// launch costs ~2-4 us of launch gap and a partly idle tail (16 CTAs take 8 chunks
// each), ~10% of an eviction's rate: cheap, since evictions are not on a step's
// critical path. Loads are not cut: the step waits for them, so giving their SMs
// back would only delay the layer that needs them. tools/bench_transfer.py --gpu
// (gemm_slowdown_pct_evict, gemm_slowdown_pct_evict+load per bound) is where a GPU
// settles the default.
constexpr int64_t kDefaultEvictLaunchBytes = int64_t{2} << 20;

// Chunks with work one bounded launch may hold: launch_bytes in 16 KiB chunks, at
// least one per CTA of the grid (a smaller launch would leave CTAs idle); 0 (no
// bound) for launch_bytes <= 0.
inline int64_t launch_max_work(int64_t launch_bytes, int32_t max_ctas) {
  if (launch_bytes <= 0) return 0;
  return std::max<int64_t>(launch_bytes / kChunkBytes, max_ctas);
}

// Chunk numbers of segment s that hold work in a launch of count ids: every one of
// a large block's; the first ceil(count / ids_per_chunk) of a gather segment's
// (the rest are empty numbers, skipped by locate_chunk).
inline int64_t busy_chunks(const DevSegment& seg, int64_t count) {
  if (seg.ids_per_chunk > 1) return (count + seg.ids_per_chunk - 1) / seg.ids_per_chunk;
  return count * seg.chunks_per_block;
}

// Cuts the chunk numbers [0, launch_chunks) of one launch into consecutive ranges
// of at most max_work chunks with work each (max_work <= 0: one range); the empty
// numbers of a gather segment ride with the range before them. `ends` gets each
// range's end (the next one's start); the last is launch_chunks. Every chunk
// number lies in exactly one range, and the kernel's grid-stride loop covers a
// range [begin, end) as it covers [0, launch_chunks), so the ranges' launches
// move exactly the bytes the single launch would.
inline void launch_ranges(const DevSegment* segs, int32_t num_segs, int64_t count,
                          int64_t max_work, std::vector<int64_t>* ends) {
  ends->clear();
  const int64_t total = launch_chunks(segs[num_segs - 1], count);
  if (total == 0) return;
  if (max_work > 0) {
    int64_t work = 0;  // chunks with work in the open range
    for (int32_t s = 0; s < num_segs; ++s) {
      const int64_t start = count * segs[s].chunk_prefix;
      const int64_t busy = busy_chunks(segs[s], count);
      int64_t pos = 0;
      while (busy - pos > max_work - work) {
        pos += max_work - work;
        ends->push_back(start + pos);
        work = 0;
      }
      work += busy - pos;
    }
  }
  if (ends->empty() || ends->back() != total) ends->push_back(total);
}

// Whether a layout transfer goes out as one launch per staged slot over the whole
// segment table (chunk prefixes running across every layer) instead of launches
// per layer: every layer, and no layer event to record between them (what an
// eviction of whole blocks is).
inline bool takes_one_launch(bool has_layer_events, int32_t first_layer, int32_t num_layers,
                             int32_t layout_layers) {
  return !has_layer_events && first_layer == 0 && num_layers == layout_layers &&
         num_layers > 1;
}

// A segment as the launcher sees it: the host address for cudaMemcpyAsync and the
// kernel's address of the same memory.
struct PlanSegment {
  char* device;
  char* host;
  char* host_kernel;
  int64_t block_bytes;
  int64_t host_stride;
};

inline DevSegment make_dev_segment(const PlanSegment& s) {
  DevSegment d{};
  d.device = s.device;
  d.host = s.host_kernel;
  d.block_bytes = s.block_bytes;
  d.host_stride = s.host_stride;
  d.chunks_per_block = chunks_per_block(s.block_bytes);
  d.chunk_prefix = 0;
  d.vec_bytes = vec_bytes_for(reinterpret_cast<uintptr_t>(s.device),
                              reinterpret_cast<uintptr_t>(s.host_kernel), s.block_bytes,
                              s.host_stride);
  d.ids_per_chunk = ids_per_chunk(s.block_bytes);
  return d;
}

// Numbers the chunks of a launch group from its first segment.
inline void set_chunk_prefixes(DevSegment* segs, int32_t num_segs) {
  int64_t prefix = 0;
  for (int32_t s = 0; s < num_segs; ++s) {
    segs[s].chunk_prefix = prefix;
    prefix += segs[s].chunks_per_block;
  }
}

// The shortest and longest run of a call, found once so that each segment's
// copy-engine/kernel split is O(1) instead of a walk over the runs. The runs cover
// every id exactly once, each with at least one block, and memcpy_min_run is at
// least 1; so for a segment's min_run the copy engine moves some of its blocks iff
// the longest run reaches min_run, and the kernel some iff the shortest does not.
// No runs (no ids): neither.
struct RunExtent {
  int64_t shortest;
  int64_t longest;
  bool engine_moves_some(int64_t min_run) const { return longest >= min_run; }
  bool kernel_moves_some(int64_t min_run) const { return shortest < min_run; }
};

inline RunExtent run_extent(const std::vector<BlockRun>& runs) {
  RunExtent e{INT64_MAX, 0};
  for (const BlockRun& r : runs) {
    e.shortest = std::min(e.shortest, r.num_blocks);
    e.longest = std::max(e.longest, r.num_blocks);
  }
  return e;
}

// Per id, the length of its run (clamped to INT32_MAX): lets the kernel skip the
// ids a segment's copy-engine runs already move.
inline void fill_run_len(const std::vector<BlockRun>& runs, int32_t* out) {
  int64_t i = 0;
  for (const BlockRun& run : runs) {
    const int32_t n = static_cast<int32_t>(std::min<int64_t>(run.num_blocks, INT32_MAX));
    for (int64_t k = 0; k < run.num_blocks; ++k) out[i++] = n;
  }
}

inline size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// Where the pieces of one staged launch sit in a slot: descriptors (may be 0
// bytes), device ids, host ids, run lengths (optional); each 16-byte aligned.
struct SlotLayout {
  size_t descs;
  size_t device_ids;
  size_t host_ids;
  size_t run_len;
  size_t total;
};

inline SlotLayout slot_layout(size_t desc_bytes, int64_t count, bool with_run_len) {
  SlotLayout l{};
  l.descs = 0;
  l.device_ids = align16(desc_bytes);
  l.host_ids = l.device_ids + align16(static_cast<size_t>(count) * sizeof(int64_t));
  l.run_len = l.host_ids + align16(static_cast<size_t>(count) * sizeof(int64_t));
  l.total = l.run_len + (with_run_len ? align16(static_cast<size_t>(count) * sizeof(int32_t))
                                      : 0);
  return l;
}

// The most ids one slot holds next to desc_bytes of descriptors (>= 1 whenever
// desc_bytes leaves room for one id).
inline int64_t ids_per_slot(size_t slot_bytes, size_t desc_bytes, bool with_run_len) {
  const size_t per_id = 2 * sizeof(int64_t) + (with_run_len ? sizeof(int32_t) : 0);
  const size_t used = align16(desc_bytes) + 3 * 16;  // alignment padding of three arrays
  if (used >= slot_bytes) return 0;
  return static_cast<int64_t>((slot_bytes - used) / per_id);
}

}  // namespace fkv

#endif  // FASTKV_CUDA_PLAN_H_
