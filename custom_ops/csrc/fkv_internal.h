// Internal interfaces shared by the core's translation units (not part of the ABI).
#ifndef FASTKV_INTERNAL_H_
#define FASTKV_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "fastkv_core.h"

namespace fkv {

// printf-style; stores the calling thread's message and returns `code`.
int set_error(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void clear_error();

// A maximal stretch i..i+n-1 of the id arrays where both device and host ids
// ascend by one, so every segment can copy it as one contiguous range.
struct BlockRun {
  int64_t device_id;
  int64_t host_id;
  int64_t num_blocks;
};

// Checks every argument of a swap (see fastkv_core.h) and, on success, fills
// `runs` with the coalesced runs of the id arrays in call order. Touches no cache
// memory. Returns FKV_OK or FKV_EINVAL with the message set.
int validate_swap(const fkv_segment* segments, int32_t num_segments, int64_t num_device_blocks,
                  int64_t num_host_blocks, const int64_t* device_ids, const int64_t* host_ids,
                  int64_t num_ids, int32_t direction, std::vector<BlockRun>* runs);

// The segment half of validate_swap: counts, bases, block sizes, region bounds and
// overlaps. direction -1 checks for both directions (no region may overlap any
// other), which is what a layout used both ways needs.
int validate_segments(const fkv_segment* segments, int32_t num_segments,
                      int64_t num_device_blocks, int64_t num_host_blocks, int32_t direction);

// The id half of validate_swap (direction must be valid): ranges and duplicate
// destinations; fills `runs`.
int validate_ids(int64_t num_device_blocks, int64_t num_host_blocks, const int64_t* device_ids,
                 const int64_t* host_ids, int64_t num_ids, int32_t direction,
                 std::vector<BlockRun>* runs);

// The CPU copy of already validated arguments (may reorder `runs`).
void copy_cpu(const fkv_segment* segments, int32_t num_segments, int64_t num_device_blocks,
              int64_t num_host_blocks, std::vector<BlockRun>& runs, int32_t direction,
              int num_threads);

// Reads a non-negative integer environment variable once per process and name
// (callers cache the result): `fallback` when unset, empty or malformed.
int64_t env_int64(const char* name, int64_t fallback);

// ---- thread pool (fkv_pool.cc) ----

// Runs fn(ctx, part) for part in [0, num_parts) on up to num_parts threads (the
// caller plus pool workers) and returns when all parts are done. The caller runs
// any part no worker has picked up, so concurrent calls cannot deadlock even when
// every worker is busy with another caller's parts.
void parallel_for(int num_parts, void (*fn)(void* ctx, int part), void* ctx);

int default_num_threads();

// Faults in [p, p + bytes) page by page on the pool.
void parallel_first_touch(char* p, size_t bytes, int num_threads);

// ---- CUDA side (fkv_cuda.cu or fkv_cuda_stub.cc) ----

// Page-locks and maps [p, p + bytes) for every CUDA context. The address a kernel
// uses for p may differ per device (cudaDevAttrCanUseHostPointerForRegisteredMem);
// layouts resolve it on their own device.
// device >= 0: with that device current (the caller's context restored after);
// -1: the calling thread's current device.
int cuda_host_register(void* p, size_t bytes, int device);
int cuda_host_unregister(void* p, int device);

// CUDA half of a layout (fkv_layout.cc owns the struct).
struct CudaLayout;
int cuda_layout_create(const fkv_segment* segments, int32_t num_segments,
                       int32_t segments_per_layer, int64_t num_host_blocks, int device,
                       CudaLayout** out);
void cuda_layout_destroy(CudaLayout* layout);
// wait_events: waits_per_layer per layer (validated by fkv_layout_swap_ordered).
int cuda_layout_swap(CudaLayout* layout, const std::vector<BlockRun>& runs,
                     const int64_t* device_ids, const int64_t* host_ids, int64_t num_ids,
                     int32_t direction, int32_t first_layer, int32_t num_layers,
                     void* cuda_stream, void* const* layer_events, void* const* wait_events,
                     int32_t waits_per_layer, int32_t* failed_layer);

// ---- host allocation registry (fkv_host_alloc.cc) ----

// If [p, p + bytes) lies inside one live fkv_host_alloc allocation, returns true and
// sets *pinned.
bool registry_lookup(const void* p, size_t bytes, bool* pinned);

// True when p lies inside a live fkv_host_alloc allocation but [p, p + bytes) runs
// past its end; *available gets the bytes from p to that end. Memory that is not
// ours (numpy, cupyx.empty_pinned) cannot be checked and is never reported.
bool registry_overrun(const void* p, size_t bytes, size_t* available);

}  // namespace fkv

#endif  // FASTKV_INTERNAL_H_
