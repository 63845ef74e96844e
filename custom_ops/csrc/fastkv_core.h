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
 *   host side:   block b of segment s is at  segments[s].host_base   + b * host_stride
 *                for b in [0, num_host_blocks)
 * host_stride >= block_bytes. fastkv's host tier interleaves its segments: host block
 * b is one contiguous region of S = sum of every segment's block_bytes at
 * tier_base + b * S, segment s's part of it at prefix_s = sum of block_bytes of
 * segments [0, s) (no padding), so host_base = tier_base + prefix_s and
 * host_stride = S for every segment. host_stride == block_bytes is a region of
 * its own per segment. A segment's host region spans
 *   [host_base, host_base + (num_host_blocks - 1) * host_stride + block_bytes).
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
 *     works on CPU works on GPU); every host_stride >= block_bytes and a multiple
 *     of FKV_MIN_ACCESS_BYTES;
 *   num_device_blocks, num_host_blocks >= 0 and the regions fit the address space;
 *   no destination region overlaps another segment's region (host regions that
 *     interleave, as the host tier's do, must share one stride, start within one
 *     stride of each other and fit their blocks side by side in it; the region
 *     check against a fkv_host_alloc allocation uses the span above);
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
#define FKV_ABI_VERSION 4

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
  FKV_ESYSTEM = 5,     /* an OS call (mmap, mbind...) failed */
  FKV_ETIMEDOUT = 6,   /* a bounded wait ran out (event wait, staging ring) */
  FKV_ECAPTURE = 7,    /* the stream is capturing a CUDA graph; nothing was enqueued */
  FKV_ENOTREADY = 8    /* fkv_cuda_event_query: the event has not completed yet */
};

typedef struct fkv_segment {
  void* device_base;
  void* host_base;
  int64_t block_bytes;
  int64_t host_stride; /* bytes from host block b to b + 1 of this segment */
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
 * at once. Safe to call from several threads at once (different streams).
 * Refuses (FKV_ECAPTURE, nothing enqueued) while the stream is capturing a CUDA
 * graph: ids are staged through host memory at launch time, which a graph replay
 * would not repeat. Resolves and validates the segments on every call: for
 * repeated transfers over one cache use a layout (fkv_layout_create). */
FKV_API int fkv_swap_cuda(const fkv_segment* segments, int32_t num_segments,
                          int64_t num_device_blocks, int64_t num_host_blocks,
                          const int64_t* device_ids, const int64_t* host_ids,
                          int64_t num_ids, int32_t direction, void* cuda_stream);

/* 1 if this library was compiled with nvcc, else 0. */
FKV_API int fkv_built_with_cuda(void);

/* Number of usable CUDA devices; 0 when built without CUDA, with no driver or no
 * device (never an error; fkv_cuda_get_info says why). */
FKV_API int fkv_cuda_device_count(void);

/* What the core was built with and what this machine offers, so "0 devices"
 * always comes with a reason. */
typedef struct fkv_cuda_info {
  int32_t built_with_cuda;
  int32_t runtime_version; /* CUDA runtime compiled in, 1000*major + 10*minor; 0 = none */
  int32_t driver_version;  /* newest CUDA the installed driver supports; 0 = no driver */
  int32_t device_count;    /* usable devices */
  char archs[256];         /* compiled targets, e.g. "sm_75 sm_80 sm_86 compute_75" */
  char status[512];        /* "ok", or why device_count is 0 and what to do */
} fkv_cuda_info;

FKV_API int fkv_cuda_get_info(fkv_cuda_info* info);

/* Initialises everything the CUDA path of `device` needs before the first
 * transfer, so an engine that then sizes its KV cache to fill the GPU cannot make
 * the first swap fail: the staging ring (device + pinned memory), the copy
 * kernel's module (loaded now, not at the first launch; a GPU the library has no
 * kernel image for fails here, naming its architecture). Idempotent. */
FKV_API int fkv_cuda_init(int device);

/* Staging ring of `device`: slots allocated, bytes per slot, times it grew. */
FKV_API int fkv_cuda_staging_stats(int device, int64_t* slots, int64_t* slot_bytes,
                                   int64_t* grows);

/* PCI bus id of CUDA device `device` ("0000:3b:00.0", lower case, as sysfs spells
 * it) into buf. Returns FKV_OK or an error code. */
FKV_API int fkv_cuda_pci_bus_id(int device, char* buf, int buf_len);

/* Streams and events, each on an explicit device: the calling thread's current
 * device and context are left exactly as they were (a thread with no CUDA context
 * keeps none; no context is ever created on another device).
 * priority: > 0 the highest priority the device offers, < 0 the lowest, 0 default.
 * Streams are non-blocking (no implicit sync with the legacy default stream);
 * events have timing disabled. */
FKV_API int fkv_cuda_stream_create(int device, int priority, void** stream);
FKV_API int fkv_cuda_stream_destroy(int device, void* stream);
/* *priority gets the stream's priority (numerically lower = higher priority). */
FKV_API int fkv_cuda_stream_priority(int device, void* stream, int* priority);
/* *capturing gets 1 while the stream is capturing a CUDA graph, else 0. */
FKV_API int fkv_cuda_stream_capturing(int device, void* stream, int* capturing);
FKV_API int fkv_cuda_event_create(int device, void** event);
FKV_API int fkv_cuda_event_destroy(int device, void* event);
FKV_API int fkv_cuda_event_record(int device, void* event, void* stream);
/* Work enqueued on `stream` afterwards waits (on the device) for `event`. */
FKV_API int fkv_cuda_stream_wait_event(int device, void* stream, void* event);
/* FKV_OK: completed (or never recorded); FKV_ENOTREADY: not yet; else the CUDA
 * error (a sticky error from an earlier fault is reported here, not raised). */
FKV_API int fkv_cuda_event_query(int device, void* event);
/* Waits at most timeout_ns for the event: polls, yielding for the first 100 us,
 * then sleeping 20 us between queries, so it returns within tens of microseconds
 * of completion. FKV_OK, FKV_ETIMEDOUT or the CUDA error. */
FKV_API int fkv_cuda_event_wait(int device, void* event, int64_t timeout_ns);

/* Tuning knobs of the CUDA path (process-wide). A consecutive run whose bytes in
 * one segment reach memcpy_min_bytes is copied with cudaMemcpyAsync (copy engine)
 * instead of the kernel; max_ctas bounds the kernel's grid so it leaves SMs to
 * compute. A negative argument leaves that knob unchanged. Defaults: 1 MiB and 16
 * (or FASTKV_CUDA_MEMCPY_MIN_BYTES / FASTKV_CUDA_MAX_CTAS, read once per process).
 * Returns FKV_EINVAL for max_ctas == 0. */
FKV_API int fkv_cuda_set_tuning(int64_t memcpy_min_bytes, int32_t max_ctas);
FKV_API void fkv_cuda_get_tuning(int64_t* memcpy_min_bytes, int32_t* max_ctas);
/* The most kernel work (bytes) one launch of a device -> host transfer carries: an
 * eviction goes out as several launches, so the SMs its CTAs hold go back to the
 * model between them (a resident CTA is never preempted). 0: one launch. Loads are
 * not cut. Default 2 MiB (~40 us on PCIe Gen5; reasoned in fkv_cuda_plan.h), or
 * FASTKV_CUDA_EVICT_LAUNCH_BYTES (read once per process). FKV_EINVAL for < 0. */
FKV_API int fkv_cuda_set_evict_launch_bytes(int64_t bytes);
FKV_API int64_t fkv_cuda_get_evict_launch_bytes(void);

/* ---- Layouts: validate and resolve a cache once, then transfer many times ----
 *
 * A layout is a fixed segment table (a KV cache and its host tier), grouped into
 * layers of `segments_per_layer` consecutive segments. Creating it checks every
 * region (as fkv_swap_* do) and, for a CUDA layout (cuda_device >= 0), that the
 * device bases are memory of that device and the host regions pinned and mapped,
 * resolves the address the kernel uses for each host region on that device, uploads
 * the segment descriptors once, and initialises the device (fkv_cuda_init).
 * A CPU layout (cuda_device == -1) copies with the CPU core. */
typedef struct fkv_layout fkv_layout;

FKV_API int fkv_layout_create(const fkv_segment* segments, int32_t num_segments,
                              int32_t segments_per_layer, int64_t num_device_blocks,
                              int64_t num_host_blocks, int32_t cuda_device,
                              fkv_layout** layout);
FKV_API int fkv_layout_destroy(fkv_layout* layout);

/* Copies the given blocks of layers [first_layer, first_layer + num_layers).
 * The ids are validated once per call (range, duplicate destinations). CUDA: the
 * ids are staged once (one staging slot for up to several thousand ids), then
 * every layer is launched from this call, in order, on `cuda_stream`, and
 * layer_events[k] (a cudaEvent_t of the layout's device, or NULL to skip) is
 * recorded right after layer first_layer + k; returns once all is enqueued.
 * CPU: copies synchronously with num_threads threads; events are ignored.
 * *failed_layer (may be NULL) gets -1 on success, else the first layer not
 * enqueued intact; on a CUDA failure after validation the remaining events are
 * still recorded so no waiter hangs. A validation failure enqueues nothing and
 * records no event (*failed_layer = first_layer). */
FKV_API int fkv_layout_swap(fkv_layout* layout, const int64_t* device_ids,
                            const int64_t* host_ids, int64_t num_ids, int32_t direction,
                            int32_t first_layer, int32_t num_layers, void* cuda_stream,
                            void* const* layer_events, int32_t num_threads,
                            int32_t* failed_layer);

/* As fkv_layout_swap, with each layer ordered after other copies' layers: before
 * layer first_layer + k is enqueued, cuda_stream waits (on the device) for
 * wait_events[k * waits_per_layer + j], j < waits_per_layer (cudaEvent_t of the
 * layout's device; NULL entries skipped). A load into blocks that in-flight
 * evictions still read then starts layer L once their layer L is copied, and the
 * step stays one call: one validation and one staging of the ids, whatever the
 * layer count. On a failure the waits of the layers not enqueued intact are still
 * enqueued before their events are recorded. wait_events and waits_per_layer
 * (in [0, FKV_MAX_WAITS_PER_LAYER]) are given together or not at all (NULL, 0:
 * fkv_layout_swap). A CPU layout copies synchronously and ignores both. */
#define FKV_MAX_WAITS_PER_LAYER 1024
FKV_API int fkv_layout_swap_ordered(fkv_layout* layout, const int64_t* device_ids,
                                    const int64_t* host_ids, int64_t num_ids, int32_t direction,
                                    int32_t first_layer, int32_t num_layers, void* cuda_stream,
                                    void* const* layer_events, void* const* wait_events,
                                    int32_t waits_per_layer, int32_t num_threads,
                                    int32_t* failed_layer);

/* Host memory for a cache tier: anonymous mmap, 2 MiB-aligned with MADV_HUGEPAGE
 * when large, bound to `numa_node` (preferred policy via mbind; -1 = no binding),
 * marked MADV_DONTFORK (a forked child neither copies nor shares the tier: it is
 * absent there), faulted in by the thread pool so start-up does not zero hundreds
 * of GB on one core, then (pin_for_cuda != 0) registered with CUDA as portable,
 * mapped memory (the kernel-side address is resolved per device by layouts).
 * pin_device: the device made current for the registration (>= 0; the caller's
 * context is restored afterwards, no context is created on another device), or -1
 * for the calling thread's current device.
 * Returns NULL on failure (see fkv_last_error). bytes must be > 0. */
FKV_API void* fkv_host_alloc(size_t bytes, int numa_node, int pin_for_cuda, int pin_device);

/* Frees memory from fkv_host_alloc. `bytes` and `pinned` must match the
 * allocation (they are checked; a mismatch frees nothing and returns FKV_EINVAL). */
FKV_API int fkv_host_free(void* ptr, size_t bytes, int pinned);

/* NUMA node holding the page at addr (faulting it in if needed), or -1. */
FKV_API int fkv_numa_node_of(const void* addr);

#ifdef __cplusplus
}
#endif

#endif /* FASTKV_CORE_H_ */
