// The CUDA entry points of a library built without nvcc: present so callers link
// and load the same ABI everywhere, and failing with a message that says why.
#include <algorithm>
#include <atomic>
#include <vector>

#include "fkv_internal.h"

namespace fkv {
namespace {

constexpr const char* kNotBuilt =
    "fastkv was built without CUDA (nvcc was not found at build time); install the CUDA "
    "toolkit (nvcc on PATH or CUDA_HOME set) and rebuild with `make install`";

std::atomic<int64_t> g_memcpy_min_bytes{int64_t{1} << 20};
std::atomic<int32_t> g_max_ctas{16};

}  // namespace

int cuda_host_register(void*, size_t, void**) {
  return set_error(FKV_ENOTBUILT, "pin_for_cuda: %s", kNotBuilt);
}

int cuda_host_unregister(void*) { return set_error(FKV_ENOTBUILT, "pinned: %s", kNotBuilt); }

}  // namespace fkv

extern "C" {

FKV_API int fkv_built_with_cuda(void) { return 0; }

FKV_API int fkv_cuda_device_count(void) { return 0; }

FKV_API int fkv_cuda_pci_bus_id(int, char*, int) {
  return fkv::set_error(FKV_ENOTBUILT, "%s", fkv::kNotBuilt);
}

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
  return fkv::set_error(FKV_ENOTBUILT, "%s", fkv::kNotBuilt);
}

}  // extern "C"
