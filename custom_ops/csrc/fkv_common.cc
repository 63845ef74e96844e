// Error reporting and argument validation shared by the CPU and CUDA paths.
#include <algorithm>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fkv_internal.h"

namespace fkv {
namespace {

// Per thread, so two Python threads swapping at once each read their own error.
thread_local char g_error[1024];
thread_local int g_error_code = FKV_OK;

struct Region {
  uintptr_t begin;
  uintptr_t end;
  int32_t segment;
  bool is_host;
  bool is_destination;
  int64_t stride;       // host: host_stride; device: block_bytes
  int64_t block_bytes;
};

const char* side_name(bool is_host) { return is_host ? "host" : "device"; }

// Destination regions must not overlap anything: a wrong host_ptrs carve-up would
// otherwise make two layers silently write the same bytes. Sweep over regions
// sorted by start, remembering the furthest-reaching region and the
// furthest-reaching destination seen so far; every overlapping pair with a
// destination in it is caught by one of the two.
bool by_begin(const Region& a, const Region& b) { return a.begin < b.begin; }

// Host regions whose spans overlap (the host tier's segments interleave: block b of
// every segment lies in [tier + b * S, tier + (b + 1) * S)) are one cluster. A
// destination cluster is disjoint iff its regions share one stride, their block 0s
// (sorted by start) do not overlap and all end within one stride of the first's
// start: then block b of every region lies in its own slice of row b. The cluster
// then takes part in the sweep as one region spanning all of them.
int check_cluster(const Region* r, size_t n) {
  const Region& first = r[0];
  for (size_t k = 1; k < n; ++k) {
    const Region& prev = r[k - 1];
    const Region& cur = r[k];
    if (cur.begin < prev.begin + static_cast<uintptr_t>(prev.block_bytes)) {
      return set_error(FKV_EINVAL,
                       "segments[%d].host_base: host region overlaps the host region of "
                       "segments[%d] (its block 0 ends at %#" PRIxPTR ")",
                       cur.segment, prev.segment,
                       prev.begin + static_cast<uintptr_t>(prev.block_bytes));
    }
    if (cur.stride != first.stride) {
      return set_error(FKV_EINVAL,
                       "segments[%d].host_stride: %" PRId64 " differs from host_stride %" PRId64
                       " of segments[%d], whose host region it interleaves with",
                       cur.segment, cur.stride, first.stride, first.segment);
    }
  }
  const Region& last = r[n - 1];
  const uintptr_t row_end = first.begin + static_cast<uintptr_t>(first.stride);
  if (last.begin + static_cast<uintptr_t>(last.block_bytes) > row_end) {
    return set_error(FKV_EINVAL,
                     "segments[%d].host_base: host region overlaps the host region of "
                     "segments[%d] (its block 0 ends at %#" PRIxPTR
                     ", past one host_stride %" PRId64 " from segments[%d].host_base)",
                     last.segment, first.segment,
                     last.begin + static_cast<uintptr_t>(last.block_bytes), first.stride,
                     first.segment);
  }
  return FKV_OK;
}

// Replaces the host regions of `regions` by one region per cluster, each checked.
int merge_host_clusters(std::vector<Region>& regions) {
  std::vector<Region> host;
  std::vector<Region> out;
  for (const Region& r : regions) (r.is_host ? host : out).push_back(r);
  std::sort(host.begin(), host.end(), by_begin);
  for (size_t i = 0; i < host.size();) {
    size_t j = i + 1;
    uintptr_t end = host[i].end;
    while (j < host.size() && host[j].begin < end) end = std::max(end, host[j++].end);
    if (j - i > 1 && host[i].is_destination) {
      const int rc = check_cluster(&host[i], j - i);
      if (rc != FKV_OK) return rc;
    }
    Region merged = host[i];
    merged.end = end;
    out.push_back(merged);
    i = j;
  }
  regions.swap(out);
  return FKV_OK;
}

int check_overlaps(std::vector<Region>& regions) {
  const int rc = merge_host_clusters(regions);
  if (rc != FKV_OK) return rc;
  std::sort(regions.begin(), regions.end(), by_begin);
  const Region* reach_any = nullptr;
  const Region* reach_dst = nullptr;
  for (const Region& r : regions) {
    const Region* hit = nullptr;
    if (reach_dst && r.begin < reach_dst->end) {
      hit = reach_dst;
    } else if (r.is_destination && reach_any && r.begin < reach_any->end) {
      hit = reach_any;
    }
    if (hit) {
      return set_error(FKV_EINVAL,
                       "segments[%d].%s_base: %s region overlaps the %s region of "
                       "segments[%d] (a destination may not overlap any other region)",
                       r.segment, side_name(r.is_host), side_name(r.is_host),
                       side_name(hit->is_host), hit->segment);
    }
    if (!reach_any || r.end > reach_any->end) reach_any = &r;
    if (r.is_destination && (!reach_dst || r.end > reach_dst->end)) reach_dst = &r;
  }
  return FKV_OK;
}

// A region of num_blocks blocks of block_bytes, `stride` bytes apart: it spans
// (num_blocks - 1) * stride + block_bytes bytes (none for no blocks).
int check_region(const char* side, int32_t s, const void* base, int64_t num_blocks,
                 int64_t block_bytes, int64_t stride, uintptr_t* end) {
  if (base == nullptr) return set_error(FKV_EINVAL, "segments[%d].%s_base: NULL", s, side);
  if (reinterpret_cast<uintptr_t>(base) % FKV_MIN_ACCESS_BYTES != 0) {
    return set_error(FKV_EINVAL, "segments[%d].%s_base: %p is not %d-byte aligned", s, side,
                     base, FKV_MIN_ACCESS_BYTES);
  }
  int64_t bytes = 0;
  uintptr_t last = 0;
  if (num_blocks > 0 &&
      (__builtin_mul_overflow(num_blocks - 1, stride, &bytes) ||
       __builtin_add_overflow(bytes, block_bytes, &bytes))) {
    bytes = -1;
  }
  if (bytes < 0 ||
      __builtin_add_overflow(reinterpret_cast<uintptr_t>(base), static_cast<uintptr_t>(bytes),
                             &last)) {
    return set_error(FKV_EINVAL,
                     "segments[%d].%s_base: %" PRId64 " blocks of %" PRId64
                     " bytes overflow the address space",
                     s, side, num_blocks, block_bytes);
  }
  *end = last;
  return FKV_OK;
}

// Duplicate detection with a bitmap costs O(num_ids) per call (only the bits that
// were set get cleared again); past this many destination blocks the bitmap
// itself would be too big to keep per thread, so we sort a copy instead.
constexpr int64_t kMaxBitmapBlocks = int64_t{1} << 27;

thread_local std::vector<uint64_t> t_bitmap;
thread_local std::vector<int64_t> t_sorted;
thread_local std::vector<Region> t_regions;

int check_ids_sorted(const int64_t* dst, int64_t n, const char* name) {
  t_sorted.assign(dst, dst + n);
  std::sort(t_sorted.begin(), t_sorted.end());
  auto dup = std::adjacent_find(t_sorted.begin(), t_sorted.end());
  if (dup == t_sorted.end()) return FKV_OK;
  const int64_t value = *dup;
  int64_t seen = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (dst[i] == value && seen++ == 1) {
      return set_error(FKV_EINVAL, "%s[%" PRId64 "]: duplicate destination %" PRId64, name, i,
                       value);
    }
  }
  return set_error(FKV_EINVAL, "%s: duplicate destination %" PRId64, name, value);
}

// The argument checks both halves of validate_swap start with, and validate_swap
// itself before the segment walk.
int check_segment_array(const fkv_segment* segments, int32_t num_segments) {
  if (segments == nullptr) return set_error(FKV_EINVAL, "segments: NULL");
  if (num_segments <= 0 || num_segments > FKV_MAX_SEGMENTS) {
    return set_error(FKV_EINVAL, "num_segments: %d out of range [1, %d]", num_segments,
                     FKV_MAX_SEGMENTS);
  }
  return FKV_OK;
}

int check_block_counts(int64_t num_device_blocks, int64_t num_host_blocks) {
  if (num_device_blocks < 0) {
    return set_error(FKV_EINVAL, "num_device_blocks: %" PRId64 " is negative",
                     num_device_blocks);
  }
  if (num_host_blocks < 0) {
    return set_error(FKV_EINVAL, "num_host_blocks: %" PRId64 " is negative", num_host_blocks);
  }
  return FKV_OK;
}

int check_id_arrays(const int64_t* device_ids, const int64_t* host_ids, int64_t num_ids) {
  if (num_ids < 0) return set_error(FKV_EINVAL, "num_ids: %" PRId64 " is negative", num_ids);
  if (num_ids > 0 && device_ids == nullptr) {
    return set_error(FKV_EINVAL, "device_ids: NULL with num_ids=%" PRId64, num_ids);
  }
  if (num_ids > 0 && host_ids == nullptr) {
    return set_error(FKV_EINVAL, "host_ids: NULL with num_ids=%" PRId64, num_ids);
  }
  return FKV_OK;
}

}  // namespace

int set_error(int code, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_error, sizeof(g_error), fmt, args);
  va_end(args);
  g_error_code = code;
  return code;
}

void clear_error() {
  g_error[0] = '\0';
  g_error_code = FKV_OK;
}

int validate_segments(const fkv_segment* segments, int32_t num_segments,
                      int64_t num_device_blocks, int64_t num_host_blocks, int32_t direction) {
  int rc = check_segment_array(segments, num_segments);
  if (rc != FKV_OK) return rc;
  rc = check_block_counts(num_device_blocks, num_host_blocks);
  if (rc != FKV_OK) return rc;
  const bool device_dst = direction != FKV_D2H;  // H2D, or both (-1)
  const bool host_dst = direction != FKV_H2D;
  std::vector<Region>& regions = t_regions;
  regions.clear();
  for (int32_t s = 0; s < num_segments; ++s) {
    const fkv_segment& seg = segments[s];
    if (seg.block_bytes <= 0 || seg.block_bytes % FKV_MIN_ACCESS_BYTES != 0) {
      return set_error(FKV_EINVAL,
                       "segments[%d].block_bytes: %" PRId64
                       " is not a positive multiple of %d",
                       s, seg.block_bytes, FKV_MIN_ACCESS_BYTES);
    }
    if (seg.host_stride < seg.block_bytes || seg.host_stride % FKV_MIN_ACCESS_BYTES != 0) {
      return set_error(FKV_EINVAL,
                       "segments[%d].host_stride: %" PRId64
                       " is not a multiple of %d at least block_bytes %" PRId64,
                       s, seg.host_stride, FKV_MIN_ACCESS_BYTES, seg.block_bytes);
    }
    uintptr_t dev_end = 0;
    uintptr_t host_end = 0;
    rc = check_region("device", s, seg.device_base, num_device_blocks, seg.block_bytes,
                      seg.block_bytes, &dev_end);
    if (rc != FKV_OK) return rc;
    rc = check_region("host", s, seg.host_base, num_host_blocks, seg.block_bytes,
                      seg.host_stride, &host_end);
    if (rc != FKV_OK) return rc;
    const uintptr_t dev = reinterpret_cast<uintptr_t>(seg.device_base);
    const uintptr_t host = reinterpret_cast<uintptr_t>(seg.host_base);
    size_t available = 0;
    if (registry_overrun(seg.host_base, host_end - host, &available)) {
      return set_error(FKV_EINVAL,
                       "num_host_blocks: %" PRId64 " blocks of %" PRId64
                       " bytes, host_stride %" PRId64
                       " apart, at segments[%d].host_base run past the end of its "
                       "fkv_host_alloc allocation (%zu bytes needed, %zu left there)",
                       num_host_blocks, seg.block_bytes, seg.host_stride, s,
                       static_cast<size_t>(host_end - host), available);
    }
    if (dev_end > dev) {
      regions.push_back({dev, dev_end, s, false, device_dst, seg.block_bytes, seg.block_bytes});
    }
    if (host_end > host) {
      regions.push_back({host, host_end, s, true, host_dst, seg.host_stride, seg.block_bytes});
    }
  }
  return check_overlaps(regions);
}

int validate_ids(int64_t num_device_blocks, int64_t num_host_blocks, const int64_t* device_ids,
                 const int64_t* host_ids, int64_t num_ids, int32_t direction,
                 std::vector<BlockRun>* runs) {
  runs->clear();
  int rc = check_id_arrays(device_ids, host_ids, num_ids);
  if (rc != FKV_OK) return rc;
  if (num_ids == 0) return FKV_OK;

  const bool h2d = direction == FKV_H2D;
  const int64_t* dst = h2d ? device_ids : host_ids;
  const char* dst_name = h2d ? "device_ids" : "host_ids";
  const int64_t num_dst_blocks = h2d ? num_device_blocks : num_host_blocks;
  const bool use_bitmap = num_dst_blocks <= kMaxBitmapBlocks;
  if (use_bitmap && t_bitmap.size() < static_cast<size_t>(num_dst_blocks / 64 + 1)) {
    t_bitmap.resize(num_dst_blocks / 64 + 1, 0);
  }
  uint64_t* bits = t_bitmap.data();

  int64_t i = 0;
  for (; i < num_ids; ++i) {
    const int64_t d = device_ids[i];
    const int64_t h = host_ids[i];
    if (d < 0 || d >= num_device_blocks) {
      rc = set_error(FKV_EINVAL,
                     "device_ids[%" PRId64 "]=%" PRId64 " out of range [0, %" PRId64 ")", i, d,
                     num_device_blocks);
      break;
    }
    if (h < 0 || h >= num_host_blocks) {
      rc = set_error(FKV_EINVAL, "host_ids[%" PRId64 "]=%" PRId64 " out of range [0, %" PRId64 ")",
                     i, h, num_host_blocks);
      break;
    }
    if (use_bitmap) {
      const int64_t id = dst[i];
      const uint64_t mask = uint64_t{1} << (id & 63);
      if (bits[id >> 6] & mask) {
        rc = set_error(FKV_EINVAL, "%s[%" PRId64 "]: duplicate destination %" PRId64, dst_name,
                       i, id);
        break;
      }
      bits[id >> 6] |= mask;
    }
    if (!runs->empty()) {
      BlockRun& last = runs->back();
      if (d == last.device_id + last.num_blocks && h == last.host_id + last.num_blocks) {
        ++last.num_blocks;
        continue;
      }
    }
    runs->push_back({d, h, 1});
  }
  if (use_bitmap) {
    // Only ids that passed the range check were marked; clear exactly those so the
    // per-thread bitmap is all-zero for the next call.
    for (int64_t k = 0; k < i; ++k) bits[dst[k] >> 6] = 0;
  } else if (rc == FKV_OK) {
    rc = check_ids_sorted(dst, num_ids, dst_name);
  }
  if (rc != FKV_OK) runs->clear();
  return rc;
}

int validate_swap(const fkv_segment* segments, int32_t num_segments, int64_t num_device_blocks,
                  int64_t num_host_blocks, const int64_t* device_ids, const int64_t* host_ids,
                  int64_t num_ids, int32_t direction, std::vector<BlockRun>* runs) {
  runs->clear();
  int rc = check_segment_array(segments, num_segments);
  if (rc != FKV_OK) return rc;
  if (direction != FKV_H2D && direction != FKV_D2H) {
    return set_error(FKV_EINVAL,
                     "direction: %d is neither 0 (host->device) nor 1 (device->host)",
                     direction);
  }
  // The scalar id arguments are checked before the (longer) segment walk, as before
  // the split, so the first error named stays the same. The halves repeat these
  // checks (for their other callers); they pass again here.
  rc = check_block_counts(num_device_blocks, num_host_blocks);
  if (rc != FKV_OK) return rc;
  rc = check_id_arrays(device_ids, host_ids, num_ids);
  if (rc != FKV_OK) return rc;
  rc = validate_segments(segments, num_segments, num_device_blocks, num_host_blocks, direction);
  if (rc != FKV_OK) return rc;
  return validate_ids(num_device_blocks, num_host_blocks, device_ids, host_ids, num_ids,
                      direction, runs);
}

int64_t env_int64(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return (end && *end == '\0' && n >= 0) ? n : fallback;
}

}  // namespace fkv

extern "C" {

FKV_API int fkv_abi_version(void) { return FKV_ABI_VERSION; }

FKV_API const char* fkv_last_error(void) { return fkv::g_error; }

FKV_API int fkv_last_error_code(void) { return fkv::g_error_code; }

FKV_API int fkv_default_num_threads(void) { return fkv::default_num_threads(); }

}  // extern "C"
