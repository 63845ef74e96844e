// Layouts: a cache's segment table validated (and on CUDA, resolved and uploaded)
// once, so a transfer only has its ids to check.
#include <cinttypes>
#include <vector>

#include "fkv_internal.h"

struct fkv_layout {
  std::vector<fkv_segment> segments;
  int32_t segments_per_layer = 0;
  int32_t num_layers = 0;
  int64_t num_device_blocks = 0;
  int64_t num_host_blocks = 0;
  int32_t cuda_device = -1;
  fkv::CudaLayout* cuda = nullptr;
};

namespace fkv {
namespace {

thread_local std::vector<BlockRun> t_layout_runs;

}  // namespace
}  // namespace fkv

extern "C" {

FKV_API int fkv_layout_create(const fkv_segment* segments, int32_t num_segments,
                              int32_t segments_per_layer, int64_t num_device_blocks,
                              int64_t num_host_blocks, int32_t cuda_device,
                              fkv_layout** layout) {
  using namespace fkv;
  if (layout == nullptr) return set_error(FKV_EINVAL, "layout: NULL output pointer");
  *layout = nullptr;
  int rc = validate_segments(segments, num_segments, num_device_blocks, num_host_blocks, -1);
  if (rc != FKV_OK) return rc;
  if (segments_per_layer <= 0 || num_segments % segments_per_layer != 0) {
    return set_error(FKV_EINVAL,
                     "segments_per_layer: %d does not divide num_segments=%d into layers",
                     segments_per_layer, num_segments);
  }
  if (cuda_device < -1) {
    return set_error(FKV_EINVAL, "cuda_device: %d is neither -1 (CPU) nor a device ordinal",
                     cuda_device);
  }
  auto* out = new fkv_layout();
  out->segments.assign(segments, segments + num_segments);
  out->segments_per_layer = segments_per_layer;
  out->num_layers = num_segments / segments_per_layer;
  out->num_device_blocks = num_device_blocks;
  out->num_host_blocks = num_host_blocks;
  out->cuda_device = cuda_device;
  if (cuda_device >= 0) {
    rc = cuda_layout_create(segments, num_segments, segments_per_layer, num_host_blocks,
                            cuda_device, &out->cuda);
    if (rc != FKV_OK) {
      delete out;
      return rc;
    }
  }
  *layout = out;
  return FKV_OK;
}

FKV_API int fkv_layout_destroy(fkv_layout* layout) {
  if (layout == nullptr) return FKV_OK;
  if (layout->cuda != nullptr) fkv::cuda_layout_destroy(layout->cuda);
  delete layout;
  return FKV_OK;
}

FKV_API int fkv_layout_swap(fkv_layout* layout, const int64_t* device_ids,
                            const int64_t* host_ids, int64_t num_ids, int32_t direction,
                            int32_t first_layer, int32_t num_layers, void* cuda_stream,
                            void* const* layer_events, int32_t num_threads,
                            int32_t* failed_layer) {
  return fkv_layout_swap_ordered(layout, device_ids, host_ids, num_ids, direction, first_layer,
                                 num_layers, cuda_stream, layer_events, nullptr, 0, num_threads,
                                 failed_layer);
}

FKV_API int fkv_layout_swap_ordered(fkv_layout* layout, const int64_t* device_ids,
                                    const int64_t* host_ids, int64_t num_ids, int32_t direction,
                                    int32_t first_layer, int32_t num_layers, void* cuda_stream,
                                    void* const* layer_events, void* const* wait_events,
                                    int32_t waits_per_layer, int32_t num_threads,
                                    int32_t* failed_layer) {
  using namespace fkv;
  int32_t failed_scratch = 0;
  int32_t* failed = failed_layer != nullptr ? failed_layer : &failed_scratch;
  *failed = first_layer;
  if (layout == nullptr) return set_error(FKV_EINVAL, "layout: NULL");
  if (direction != FKV_H2D && direction != FKV_D2H) {
    return set_error(FKV_EINVAL,
                     "direction: %d is neither 0 (host->device) nor 1 (device->host)",
                     direction);
  }
  if (first_layer < 0 || first_layer >= layout->num_layers) {
    return set_error(FKV_EINVAL, "first_layer: %d out of range [0, %d)", first_layer,
                     layout->num_layers);
  }
  if (num_layers <= 0 || num_layers > layout->num_layers - first_layer) {
    return set_error(FKV_EINVAL, "num_layers: %d out of range [1, %d] from layer %d",
                     num_layers, layout->num_layers - first_layer, first_layer);
  }
  if (num_threads < 0 || num_threads > FKV_MAX_THREADS) {
    return set_error(FKV_EINVAL, "num_threads: %d out of range [0, %d]", num_threads,
                     FKV_MAX_THREADS);
  }
  if (waits_per_layer < 0 || waits_per_layer > FKV_MAX_WAITS_PER_LAYER) {
    return set_error(FKV_EINVAL, "waits_per_layer: %d out of range [0, %d]", waits_per_layer,
                     FKV_MAX_WAITS_PER_LAYER);
  }
  if ((wait_events == nullptr) != (waits_per_layer == 0)) {
    return set_error(FKV_EINVAL,
                     "wait_events: %s with waits_per_layer=%d (give both or neither)",
                     wait_events == nullptr ? "NULL" : "given", waits_per_layer);
  }
  std::vector<BlockRun>& runs = t_layout_runs;
  int rc = validate_ids(layout->num_device_blocks, layout->num_host_blocks, device_ids,
                        host_ids, num_ids, direction, &runs);
  if (rc != FKV_OK) return rc;
  if (layout->cuda != nullptr) {
    return cuda_layout_swap(layout->cuda, runs, device_ids, host_ids, num_ids, direction,
                            first_layer, num_layers, cuda_stream, layer_events, wait_events,
                            waits_per_layer, failed);
  }
  const int32_t spl = layout->segments_per_layer;
  copy_cpu(layout->segments.data() + static_cast<size_t>(first_layer) * spl, num_layers * spl,
           layout->num_device_blocks, layout->num_host_blocks, runs, direction, num_threads);
  *failed = -1;
  return FKV_OK;
}

}  // extern "C"
