/*
 * fastkv core: framework-free block copies between a device-side KV cache and a
 * host-side KV cache, with a C ABI so Paddle custom ops and ctypes share one
 * implementation (and one thread pool / one CUDA staging ring per process).
 *
 * Data model
 * ----------
 * A *segment* is one cache tensor: layer L's K, layer L's V, an fp8 scale tensor,
 * an extra speculative-decoding layer... Every segment holds blocks of its own
 * size `block_bytes`:
 *   device side: block b of segment s is at  segments[s].device_base + b * block_bytes
 *                for b in [0, num_device_blocks)
 *   host side:   block b of segment s is at  segments[s].host_base   + b * block_bytes
 *                for b in [0, num_host_blocks)
 * (a caller carves one pinned allocation per tier into one region per segment).
 * A swap copies, for every segment s and every i in [0, num_ids),
 *   direction FKV_H2D (0): host block host_ids[i]     -> device block device_ids[i]
 *   direction FKV_D2H (1): device block device_ids[i] -> host block host_ids[i]
 *
 * Validation (before any byte moves; a failing call leaves memory untouched)
 * -------------------------------------------------------------------------
 *   segments non-NULL, 0 < num_segments <= FKV_MAX_SEGMENTS;
 *   every device_base / host_base non-NULL and FKV_MIN_ACCESS_BYTES-aligned;
 *   every block_bytes > 0 and a multiple of FKV_MIN_ACCESS_BYTES (the narrowest
 *     access the CUDA kernel makes; the CPU path shares the rule so a layout that
 *     works on CPU works on GPU);
 *   num_device_blocks, num_host_blocks >= 0 and the regions fit the address space;
 *   no destination region overlaps another segment's region;
 *   num_ids >= 0, id arrays non-NULL when num_ids > 0;
 *   device_ids[i] in [0, num_device_blocks), host_ids[i] in [0, num_host_blocks);
 *   no duplicate destination id (device_ids for H2D, host_ids for D2H);
 *   direction is FKV_H2D or FKV_D2H; num_threads in [0, FKV_MAX_THREADS].
 * The error message names the argument, e.g. "host_ids[3]=900 out of range [0, 512)".
 *
 * Errors
 * ------
 * Functions returning int return FKV_OK (0) or one of the FKV_E* codes below;
 * fkv_last_error() then returns a message for the calling thread (valid until
 * that thread's next fastkv call).
 */
#ifndef FASTKV_CORE_H_
#define FASTKV_CORE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define FKV_API __attribute__((visibility("default")))
#else
#define FKV_API
#endif

/* Bumped whenever a signature or struct below changes; Python checks it at load. */
#define FKV_ABI_VERSION 1

#define FKV_H2D 0 /* host -> device: swap-in */
#define FKV_D2H 1 /* device -> host: evict / back up */

#define FKV_MIN_ACCESS_BYTES 4
#define FKV_MAX_SEGMENTS (1 << 20)
#define FKV_MAX_THREADS 256

enum {
  FKV_OK = 0,
  FKV_EINVAL = 1,      /* an argument failed validation; nothing was copied */
  FKV_ECUDA = 2,       /* a CUDA call failed (message has the CUDA error) */
  FKV_ENOMEM = 3,      /* an allocation failed */
  FKV_ENOTBUILT = 4,   /* this library was built without CUDA */
  FKV_ESYSTEM = 5      /* an OS call (mmap, mbind...) failed */
};

typedef struct fkv_segment {
  void* device_base;
  void* host_base;
  int64_t block_bytes;
} fkv_segment;

FKV_API int fkv_abi_version(void);

/* The calling thread's message for its last failed call ("" if none). */
FKV_API const char* fkv_last_error(void);

/* The code of that failure (FKV_OK if none); lets callers of fkv_host_alloc, which
 * returns NULL, tell a bad argument from an out-of-memory or OS failure. */
FKV_API int fkv_last_error_code(void);

/* Threads used when num_threads == 0: FASTKV_NUM_THREADS if set, else the number
 * of CPUs in this process's affinity mask, capped at 8 (copies saturate memory
 * bandwidth well before that on one NUMA node). */
FKV_API int fkv_default_num_threads(void);

/* CPU implementation: both tiers are ordinary (or pinned) host memory. Runs on a
 * persistent thread pool; the calling thread works too. Safe to call from several
 * threads at once: calls share the pool and never wait on each other's work. */
FKV_API int fkv_swap_cpu(const fkv_segment* segments, int32_t num_segments,
                         int64_t num_device_blocks, int64_t num_host_blocks,
                         const int64_t* device_ids, const int64_t* host_ids,
                         int64_t num_ids, int32_t direction, int32_t num_threads);

/* CUDA implementation: enqueues the copy on `cuda_stream` (a cudaStream_t; NULL
 * is the legacy default stream) and returns without synchronizing. device_base
 * pointers must be device memory of one device; host_base regions must be pinned
 * (page-locked and mapped) host memory, e.g. from fkv_host_alloc(..., 1).
 * The id arrays are read before this function returns; the caller may reuse them
 * at once. Safe to call from several threads at once (different streams). */
FKV_API int fkv_swap_cuda(const fkv_segment* segments, int32_t num_segments,
                          int64_t num_device_blocks, int64_t num_host_blocks,
                          const int64_t* device_ids, const int64_t* host_ids,
                          int64_t num_ids, int32_t direction, void* cuda_stream);

/* 1 if this library was compiled with nvcc, else 0. */
FKV_API int fkv_built_with_cuda(void);

/* Number of usable CUDA devices; 0 when built without CUDA, with no driver or no
 * device (never an error). */
FKV_API int fkv_cuda_device_count(void);

/* PCI bus id of CUDA device `device` ("0000:3b:00.0", lower case, as sysfs spells
 * it) into buf. Returns FKV_OK or an error code. */
FKV_API int fkv_cuda_pci_bus_id(int device, char* buf, int buf_len);

/* Tuning knobs of the CUDA path (process-wide). A consecutive run whose bytes in
 * one segment reach memcpy_min_bytes is copied with cudaMemcpyAsync (copy engine)
 * instead of the kernel; max_ctas bounds the kernel's grid so it leaves SMs to
 * compute. A negative argument leaves that knob unchanged. Defaults: 1 MiB and 16
 * (or FASTKV_CUDA_MEMCPY_MIN_BYTES / FASTKV_CUDA_MAX_CTAS). Returns FKV_EINVAL for
 * max_ctas == 0. */
FKV_API int fkv_cuda_set_tuning(int64_t memcpy_min_bytes, int32_t max_ctas);
FKV_API void fkv_cuda_get_tuning(int64_t* memcpy_min_bytes, int32_t* max_ctas);

/* Host memory for a cache tier: anonymous mmap, 2 MiB-aligned with MADV_HUGEPAGE
 * when large, bound to `numa_node` (preferred policy via mbind; -1 = no binding),
 * faulted in by the thread pool so start-up does not zero hundreds of GB on one
 * core, then (pin_for_cuda != 0) registered with CUDA as portable, mapped memory.
 * Returns NULL on failure (see fkv_last_error). bytes must be > 0. */
FKV_API void* fkv_host_alloc(size_t bytes, int numa_node, int pin_for_cuda);

/* Frees memory from fkv_host_alloc. `bytes` and `pinned` must match the
 * allocation (they are checked; a mismatch frees nothing and returns FKV_EINVAL). */
FKV_API int fkv_host_free(void* ptr, size_t bytes, int pinned);

/* NUMA node holding the page at addr (faulting it in if needed), or -1. */
FKV_API int fkv_numa_node_of(const void* addr);

#ifdef __cplusplus
}
#endif

#endif /* FASTKV_CORE_H_ */
