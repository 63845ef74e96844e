// The CUDA entry points of a library built without nvcc: present so callers link
// and load the same ABI everywhere, and failing with a message that says why.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <vector>

#include "fkv_cuda_plan.h"
#include "fkv_internal.h"

namespace fkv {
namespace {

constexpr const char* kNotBuilt =
    "fastkv was built without CUDA (nvcc was not found at build time); install the CUDA "
    "toolkit (nvcc on PATH or CUDA_HOME set) and rebuild with `make install`";

std::atomic<int64_t> g_memcpy_min_bytes{int64_t{1} << 20};
std::atomic<int32_t> g_max_ctas{16};
std::atomic<int64_t> g_evict_launch_bytes{kDefaultEvictLaunchBytes};

int not_built() { return set_error(FKV_ENOTBUILT, "%s", kNotBuilt); }

}  // namespace

struct CudaLayout {};

int cuda_host_register(void*, size_t, int) {
  return set_error(FKV_ENOTBUILT, "pin_for_cuda: %s", kNotBuilt);
}

int cuda_host_unregister(void*, int) { return set_error(FKV_ENOTBUILT, "pinned: %s", kNotBuilt); }

int cuda_layout_create(const fkv_segment*, int32_t, int32_t, int64_t, int, CudaLayout**) {
  return set_error(FKV_ENOTBUILT, "cuda_device: %s", kNotBuilt);
}

void cuda_layout_destroy(CudaLayout*) {}

int cuda_layout_swap(CudaLayout*, const std::vector<BlockRun>&, const int64_t*, const int64_t*,
                     int64_t, int32_t, int32_t, int32_t, void*, void* const*, void* const*,
                     int32_t, int32_t*) {
  return not_built();
}

}  // namespace fkv

extern "C" {

FKV_API int fkv_built_with_cuda(void) { return 0; }

FKV_API int fkv_cuda_device_count(void) { return 0; }

FKV_API int fkv_cuda_get_info(fkv_cuda_info* info) {
  if (info == nullptr) return fkv::set_error(FKV_EINVAL, "info: NULL");
  std::memset(info, 0, sizeof(*info));
  std::snprintf(info->archs, sizeof(info->archs), "none");
  std::snprintf(info->status, sizeof(info->status), "%s", fkv::kNotBuilt);
  return FKV_OK;
}

FKV_API int fkv_cuda_init(int) { return fkv::not_built(); }

FKV_API int fkv_cuda_staging_stats(int, int64_t*, int64_t*, int64_t*) {
  return fkv::not_built();
}

FKV_API int fkv_cuda_pci_bus_id(int, char*, int) { return fkv::not_built(); }

FKV_API int fkv_cuda_stream_create(int, int, void**) { return fkv::not_built(); }
FKV_API int fkv_cuda_stream_destroy(int, void*) { return fkv::not_built(); }
FKV_API int fkv_cuda_stream_priority(int, void*, int*) { return fkv::not_built(); }
FKV_API int fkv_cuda_stream_capturing(int, void*, int*) { return fkv::not_built(); }
FKV_API int fkv_cuda_event_create(int, void**) { return fkv::not_built(); }
FKV_API int fkv_cuda_event_destroy(int, void*) { return fkv::not_built(); }
FKV_API int fkv_cuda_event_record(int, void*, void*) { return fkv::not_built(); }
FKV_API int fkv_cuda_stream_wait_event(int, void*, void*) { return fkv::not_built(); }
FKV_API int fkv_cuda_event_query(int, void*) { return fkv::not_built(); }
FKV_API int fkv_cuda_event_wait(int, void*, int64_t) { return fkv::not_built(); }

FKV_API int fkv_cuda_set_tuning(int64_t memcpy_min_bytes, int32_t max_ctas) {
  if (max_ctas == 0) return fkv::set_error(FKV_EINVAL, "max_ctas: must be > 0 (or < 0 to keep)");
  if (memcpy_min_bytes >= 0) fkv::g_memcpy_min_bytes.store(memcpy_min_bytes);
  if (max_ctas > 0) fkv::g_max_ctas.store(std::min(max_ctas, 65535));
  return FKV_OK;
}

FKV_API void fkv_cuda_get_tuning(int64_t* memcpy_min_bytes, int32_t* max_ctas) {
  if (memcpy_min_bytes) *memcpy_min_bytes = fkv::g_memcpy_min_bytes.load();
  if (max_ctas) *max_ctas = fkv::g_max_ctas.load();
}

FKV_API int fkv_cuda_set_evict_launch_bytes(int64_t bytes) {
  if (bytes < 0) {
    return fkv::set_error(FKV_EINVAL, "evict_launch_bytes: %lld must be >= 0 (0: no bound)",
                          static_cast<long long>(bytes));
  }
  fkv::g_evict_launch_bytes.store(bytes);
  return FKV_OK;
}

FKV_API int64_t fkv_cuda_get_evict_launch_bytes(void) { return fkv::g_evict_launch_bytes.load(); }

// Validates like the real entry point, so a bad call is reported as such on every
// build, then refuses.
FKV_API int fkv_swap_cuda(const fkv_segment* segments, int32_t num_segments,
                          int64_t num_device_blocks, int64_t num_host_blocks,
                          const int64_t* device_ids, const int64_t* host_ids, int64_t num_ids,
                          int32_t direction, void*) {
  std::vector<fkv::BlockRun> runs;
  const int rc = fkv::validate_swap(segments, num_segments, num_device_blocks, num_host_blocks,
                                    device_ids, host_ids, num_ids, direction, &runs);
  if (rc != FKV_OK) return rc;
  return fkv::not_built();
}

}  // extern "C"

#include "fkv_crc_cuda.h"

extern "C" FKV_API int fkv_cuda_crc3way(int, const int64_t*, int64_t, void*, int64_t, uint32_t*) {
  return fkv::not_built();
}
