// CUDA implementation: block copies, layouts, streams/events, device init, info.
//
// Short runs (the usual case: scattered blocks) go through one gather/scatter
// kernel that reads or writes pinned host memory directly over UVA; runs long
// enough to keep a copy engine busy go through cudaMemcpyAsync, which costs no SM
// time at all. The kernel's grid is small and fixed (grid-stride loop): a swap is
// PCIe-bound, so a few CTAs with enough bytes in flight saturate the link and the
// rest of the SMs stay with the model. The index mapping lives in fkv_cuda_plan.h,
// shared with a host harness that checks it in CI.
//
// Block ids (and, for fkv_swap_cuda, segment descriptors) reach the kernel through
// a per-device ring of staging slots (device memory + a pinned host mirror). Each
// slot carries an event recorded after the launches that read it; a slot is
// reused only once that event has completed. The ring never blocks without a
// bound: when every slot is still in use it grows, and when it cannot grow it
// polls until a deadline and then fails the transfer.
//
// Every entry point that takes a device makes it current only for the call and
// then restores the calling thread's exact CUDA context (none, if it had none), so
// no hidden context is created on device 0 or left current on a worker thread.
#include <cuda_runtime.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cinttypes>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "fkv_cuda_plan.h"
#include "fkv_internal.h"
#include "fkv_layout_launch.h"
#include "fkv_staging_ring.h"

#ifndef FKV_CUDA_ARCH_LIST
#define FKV_CUDA_ARCH_LIST "unknown (built without FKV_CUDA_ARCH_LIST)"
#endif

namespace fkv {
namespace {

constexpr int kMaxDevices = 64;

// ---------------------------------------------------------------- tuning, env

std::atomic<int64_t> g_memcpy_min_bytes{int64_t{1} << 20};
std::atomic<int32_t> g_max_ctas{16};
std::atomic<int64_t> g_evict_launch_bytes{kDefaultEvictLaunchBytes};  // see fkv_cuda_plan.h
int64_t g_staging_timeout_ms = 10000;
std::once_flag g_env_once;

// Environment variables are read once per process, not on every call.
void load_env_once() {
  std::call_once(g_env_once, [] {
    g_memcpy_min_bytes.store(env_int64("FASTKV_CUDA_MEMCPY_MIN_BYTES", int64_t{1} << 20));
    g_max_ctas.store(
        static_cast<int32_t>(std::clamp<int64_t>(env_int64("FASTKV_CUDA_MAX_CTAS", 16), 1, 65535)));
    g_evict_launch_bytes.store(std::max<int64_t>(
        env_int64("FASTKV_CUDA_EVICT_LAUNCH_BYTES", kDefaultEvictLaunchBytes), 0));
    g_staging_timeout_ms = env_int64("FASTKV_CUDA_STAGING_TIMEOUT_MS", 10000);
  });
}

int cuda_error(cudaError_t err, const char* what) {
  return set_error(FKV_ECUDA, "%s: %s (%s)", what, cudaGetErrorName(err),
                   cudaGetErrorString(err));
}

#define FKV_CUDA_TRY(call)                                           \
  do {                                                               \
    const cudaError_t fkv_err_ = (call);                             \
    if (fkv_err_ != cudaSuccess) return cuda_error(fkv_err_, #call); \
  } while (0)

// ------------------------------------------------------------- context guard

// cuCtxGetCurrent / cuCtxSetCurrent through the runtime's entry-point query, so
// the core needs no link against libcuda.
using CtxGetFn = int (*)(void**);
using CtxSetFn = int (*)(void*);

struct DriverCtx {
  CtxGetFn get = nullptr;
  CtxSetFn set = nullptr;
};

void* driver_symbol(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
#else
  const cudaError_t err = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return fn;
}

const DriverCtx& driver_ctx() {
  static const DriverCtx ctx = [] {
    DriverCtx d;
    d.get = reinterpret_cast<CtxGetFn>(driver_symbol("cuCtxGetCurrent"));
    d.set = reinterpret_cast<CtxSetFn>(driver_symbol("cuCtxSetCurrent"));
    if (d.get == nullptr || d.set == nullptr) d.get = nullptr, d.set = nullptr;
    return d;
  }();
  return ctx;
}

// Makes `device` current for its lifetime and then restores the thread's previous
// context exactly (NULL included). Without the driver entry points (no driver) it
// falls back to cudaGetDevice/cudaSetDevice.
//
// While it holds the device, the thread's stream-capture interaction mode is
// relaxed (cudaThreadExchangeStreamCaptureMode), then restored. Every core call
// goes through a guard, so the calls CUDA counts as unsafe during a capture
// (event query, synchronize, create and destroy; cudaMalloc, cudaFree,
// cudaHostAlloc, cudaHostRegister) neither fail nor invalidate a graph that this
// thread or another one is capturing, in global or thread-local mode. The core
// never records into or waits on a capturing stream: swaps refuse one
// (FKV_ECAPTURE), and the Python side checks before a device-side wait.
class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() { restore(); }

  int use(int device) {
    restore();
    const DriverCtx& d = driver_ctx();
    void* ctx = nullptr;
    if (d.get != nullptr && d.get(&ctx) == 0) {
      if (ctx != nullptr) {
        int current = -1;
        if (cudaGetDevice(&current) == cudaSuccess && current == device) return relax();
      }
      FKV_CUDA_TRY(cudaSetDevice(device));
      saved_ctx_ = ctx;
      mode_ = kDriver;
      return relax();
    }
    int current = -1;
    FKV_CUDA_TRY(cudaGetDevice(&current));
    if (current != device) {
      FKV_CUDA_TRY(cudaSetDevice(device));
      saved_device_ = current;
      mode_ = kRuntime;
    }
    return relax();
  }

 private:
  int relax() {
    capture_mode_ = cudaStreamCaptureModeRelaxed;
    if (cudaThreadExchangeStreamCaptureMode(&capture_mode_) == cudaSuccess) {
      relaxed_ = true;
    } else {
      cudaGetLastError();
    }
    return FKV_OK;
  }

  void restore() {
    if (relaxed_) {
      cudaThreadExchangeStreamCaptureMode(&capture_mode_);
      relaxed_ = false;
    }
    if (mode_ == kDriver) {
      driver_ctx().set(saved_ctx_);
    } else if (mode_ == kRuntime) {
      cudaSetDevice(saved_device_);
    }
    mode_ = kNone;
  }

  enum Mode { kNone, kDriver, kRuntime };
  Mode mode_ = kNone;
  void* saved_ctx_ = nullptr;
  int saved_device_ = -1;
  bool relaxed_ = false;
  cudaStreamCaptureMode capture_mode_ = cudaStreamCaptureModeRelaxed;
};

// Keeps the thread's context as it was across calls made before the device is
// known (pointer queries of fkv_swap_cuda).
class ContextKeeper {
 public:
  ContextKeeper() {
    const DriverCtx& d = driver_ctx();
    active_ = d.get != nullptr && d.get(&saved_) == 0;
  }
  ~ContextKeeper() {
    if (active_) driver_ctx().set(saved_);
  }

 private:
  bool active_ = false;
  void* saved_ = nullptr;
};

int check_device_ordinal(int device, const char* name) {
  if (device < 0 || device >= kMaxDevices) {
    return set_error(FKV_EINVAL, "%s: %d out of range [0, %d)", name, device, kMaxDevices);
  }
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    fkv_cuda_info info;
    fkv_cuda_get_info(&info);
    return set_error(FKV_ECUDA, "%s: %d: no usable CUDA device: %s", name, device, info.status);
  }
  if (device >= count) {
    return set_error(FKV_EINVAL, "%s: %d out of range [0, %d) (CUDA devices visible here)",
                     name, device, count);
  }
  return FKV_OK;
}

// -------------------------------------------------------------------- kernel

template <typename V>
__device__ __forceinline__ void copy_chunk(char* dst, const char* src, int64_t nbytes) {
  constexpr int kUnroll = unroll_for(sizeof(V));
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  const int64_t n = nbytes / static_cast<int64_t>(sizeof(V));
  for (int64_t base = threadIdx.x; base < n; base += int64_t{kThreads} * kUnroll) {
    // All loads first, then all stores: kUnroll independent PCIe reads in flight
    // per thread (64 bytes, whatever the width) is what hides the ~1-2 us latency
    // of host memory.
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = thread_element(base, u);
      if (k < n) r[u] = __ldcs(s + k);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = thread_element(base, u);
      // Streaming stores: the blocks are not read again by this kernel, so they
      // should not evict the model's working set from L2.
      if (k < n) __stcs(d + k, r[u]);
    }
  }
}

// A gather chunk: whole small blocks of several ids, every element's address found
// through the plan's chunk_element, loads first as in copy_chunk.
template <typename V>
__device__ __forceinline__ void copy_gather(const ChunkCopy& c, const int64_t* device_ids,
                                            const int64_t* host_ids, const int32_t* run_len) {
  constexpr int kUnroll = unroll_for(sizeof(V));
  const int64_t n = c.nbytes / static_cast<int64_t>(sizeof(V));
  for (int64_t base = threadIdx.x; base < n; base += int64_t{kThreads} * kUnroll) {
    V r[kUnroll];
    V* d[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = thread_element(base, u);
      char* dst = nullptr;
      const char* src = nullptr;
      d[u] = nullptr;
      if (k < n && chunk_element(c, k, device_ids, host_ids, run_len, &dst, &src)) {
        r[u] = __ldcs(reinterpret_cast<const V*>(src));
        d[u] = reinterpret_cast<V*>(dst);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (d[u] != nullptr) __stcs(d[u], r[u]);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    swap_kernel(const DevSegment* __restrict__ segs, int32_t num_segs,
                const int64_t* __restrict__ device_ids, const int64_t* __restrict__ host_ids,
                const int32_t* __restrict__ run_len, int64_t count, int64_t first_chunk,
                int64_t end_chunk, int64_t memcpy_min_bytes, int32_t h2d) {
  // Chunk numbers [first_chunk, end_chunk) of the launch's group (launch_ranges).
  ChunkCopy c;
  for (int64_t g = first_chunk + blockIdx.x; g < end_chunk;
       g = next_chunk(g, gridDim.x, c.next)) {
    if (!locate_chunk(segs, num_segs, count, g, device_ids, host_ids, run_len,
                      memcpy_min_bytes, h2d != 0, &c)) {
      continue;
    }
    if (c.num_ids > 1) {
      if (c.vec_bytes == 16) {
        copy_gather<uint4>(c, device_ids, host_ids, run_len);
      } else if (c.vec_bytes == 8) {
        copy_gather<uint2>(c, device_ids, host_ids, run_len);
      } else {
        copy_gather<unsigned int>(c, device_ids, host_ids, run_len);
      }
    } else if (c.vec_bytes == 16) {
      copy_chunk<uint4>(c.dst, c.src, c.nbytes);
    } else if (c.vec_bytes == 8) {
      copy_chunk<uint2>(c.dst, c.src, c.nbytes);
    } else {
      copy_chunk<unsigned int>(c.dst, c.src, c.nbytes);
    }
  }
}

// ---------------------------------------------------------- per-device state

using SlotRef = RingSlotRef<cudaEvent_t>;
using Chunk = RingChunk<cudaEvent_t>;

// The staging ring (fkv_staging_ring.h; its mutex also guards ready and kernel).
struct DeviceState {
  Ring<cudaEvent_t> ring;
  bool ready = false;
  cudaFuncAttributes kernel{};
};

DeviceState g_devices[kMaxDevices];

// Allocates a chunk (device current); touches no DeviceState, so the caller need
// not hold the ring's lock.
int alloc_chunk(Chunk* c) {
  const size_t bytes = kSlotsPerChunk * kSlotBytes;
  FKV_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&c->device), bytes));
  cudaError_t err = cudaHostAlloc(reinterpret_cast<void**>(&c->host), bytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    cudaFree(c->device);
    return cuda_error(err, "cudaHostAlloc(staging ring)");
  }
  for (int k = 0; k < kSlotsPerChunk; ++k) {
    err = cudaEventCreateWithFlags(&c->events[k], cudaEventDisableTiming);
    if (err != cudaSuccess) {
      for (int j = 0; j < k; ++j) cudaEventDestroy(c->events[j]);
      cudaFreeHost(c->host);
      cudaFree(c->device);
      return cuda_error(err, "cudaEventCreateWithFlags(staging ring)");
    }
  }
  return FKV_OK;
}

// Adds kSlotsPerChunk slots. Caller holds the ring's lock, with the device current
// (start-up).
int grow_locked(DeviceState& st) {
  Chunk c;
  const int rc = alloc_chunk(&c);
  if (rc == FKV_OK) st.ring.add_chunk_locked(c);
  return rc;
}

int device_name(int device, char* buf, size_t len) {
  int major = 0;
  int minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  cudaGetLastError();
  return snprintf(buf, len, "sm_%d%d", major, minor);
}

// Device current (caller's guard). Allocates the first ring chunk and loads the
// kernel's module, so neither happens at the first transfer.
int init_device_locked(DeviceState& st, int device) {
  if (st.ready) return FKV_OK;
  if (st.ring.slots.empty()) {
    const int rc = grow_locked(st);
    if (rc != FKV_OK) return rc;
    st.ring.grows = 0;  // the initial chunk is not growth
  }
  const cudaError_t err = cudaFuncGetAttributes(&st.kernel, swap_kernel);
  if (err != cudaSuccess) {
    cudaGetLastError();
    char arch[32];
    device_name(device, arch, sizeof(arch));
    return set_error(FKV_ECUDA,
                     "device %d (%s): the copy kernel cannot be loaded: %s (%s); this core "
                     "holds code for %s: rebuild with FASTKV_CUDA_ARCHS including this GPU",
                     device, arch, cudaGetErrorName(err), cudaGetErrorString(err),
                     FKV_CUDA_ARCH_LIST);
  }
  st.ready = true;
  return FKV_OK;
}

int init_device(int device) {
  DeviceState& st = g_devices[device];
  std::lock_guard<std::mutex> lock(st.ring.mu);
  return init_device_locked(st, device);
}

void sleep_us(int64_t us) {
  timespec ts{static_cast<time_t>(us / 1000000), static_cast<long>((us % 1000000) * 1000)};
  nanosleep(&ts, nullptr);
}

// The staging deadline of one transfer: every slot it claims shares it.
Deadline staging_deadline() {
  return std::chrono::steady_clock::now() + std::chrono::milliseconds(g_staging_timeout_ms);
}

// The ring's calls on CUDA, device current (the caller's guard).
struct CudaRingOps {
  int device;
  DeviceState& st;
  int ready_locked() { return init_device_locked(st, device); }
  int query(cudaEvent_t event, bool* done) {
    const cudaError_t q = cudaEventQuery(event);
    *done = q == cudaSuccess;
    if (q == cudaErrorNotReady) {
      cudaGetLastError();  // not an error; do not leave it for the caller
      return FKV_OK;
    }
    return q == cudaSuccess ? FKV_OK : cuda_error(q, "cudaEventQuery(staging slot)");
  }
  int alloc_chunk(Chunk* c) { return fkv::alloc_chunk(c); }
  Deadline now() { return std::chrono::steady_clock::now(); }
  void pause() { sleep_us(50); }
};

int acquire_slot(int device, SlotRef* out, Deadline deadline) {
  CudaRingOps ops{device, g_devices[device]};
  return g_devices[device].ring.acquire(ops, deadline, device, g_staging_timeout_ms, out);
}

// Records the slot's event on `stream` (after the launches that read it) and
// frees the claim (see Ring::release).
void release_slot(int device, const SlotRef& ref, cudaStream_t stream) {
  const cudaError_t err = cudaEventRecord(ref.event, stream);
  if (err != cudaSuccess) cudaGetLastError();
  g_devices[device].ring.release(ref, err == cudaSuccess);
}

// Fills a claimed slot's host mirror with one launch's staging data at the places
// `sl` gives (descriptors: desc_bytes, may be 0; ids; run lengths when run_len is
// non-NULL) and queues its upload on `stream`. The caller releases the slot after
// the launches that read it, also when the upload failed: it may be queued.
int upload_slot(const SlotRef& ref, const SlotLayout& sl, const void* descs, size_t desc_bytes,
                const int64_t* device_ids, const int64_t* host_ids, const int32_t* run_len,
                int64_t count, cudaStream_t stream) {
  if (desc_bytes > 0) std::memcpy(ref.host + sl.descs, descs, desc_bytes);
  std::memcpy(ref.host + sl.device_ids, device_ids, count * sizeof(int64_t));
  std::memcpy(ref.host + sl.host_ids, host_ids, count * sizeof(int64_t));
  if (run_len != nullptr) std::memcpy(ref.host + sl.run_len, run_len, count * sizeof(int32_t));
  const cudaError_t err =
      cudaMemcpyAsync(ref.device, ref.host, sl.total, cudaMemcpyHostToDevice, stream);
  return err == cudaSuccess ? FKV_OK : cuda_error(err, "cudaMemcpyAsync(staging slot)");
}

int check_not_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FKV_CUDA_TRY(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) {
    return set_error(FKV_ECAPTURE,
                     "cuda_stream: %p is capturing a CUDA graph; fastkv transfers stage block "
                     "ids from host memory at launch time, which a replay would not repeat. "
                     "Launch transfers outside the captured region and make the graph's "
                     "stream wait for their events (see docs/gpu.md, 'CUDA graphs')",
                     static_cast<void*>(stream));
  }
  return FKV_OK;
}

// ----------------------------------------------------------- segment checks

// Resolves and checks segments for `device` (device current): device bases are
// memory of that device, host regions pinned and mapped; the kernel's address of
// every host region is asked of the driver on this device, never assumed equal to
// the host address.
int resolve_segments(const fkv_segment* segments, int32_t num_segments, int64_t num_host_blocks,
                     int device, std::vector<PlanSegment>* out) {
  out->resize(num_segments);
  for (int32_t s = 0; s < num_segments; ++s) {
    const fkv_segment& seg = segments[s];
    cudaPointerAttributes attr;
    cudaError_t err = cudaPointerGetAttributes(&attr, seg.device_base);
    if (err != cudaSuccess) return cuda_error(err, "cudaPointerGetAttributes(device_base)");
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
      return set_error(FKV_EINVAL, "segments[%d].device_base: %p is not CUDA device memory", s,
                       seg.device_base);
    }
    if (attr.device != device) {
      return set_error(FKV_EINVAL, "segments[%d].device_base: %p is on device %d, not %d", s,
                       seg.device_base, attr.device, device);
    }
    // The region's span (validated not to overflow): its blocks are host_stride apart.
    const size_t host_bytes =
        num_host_blocks > 0
            ? static_cast<size_t>((num_host_blocks - 1) * seg.host_stride + seg.block_bytes)
            : 0;
    bool pinned = false;
    void* attr_device_ptr = nullptr;
    if (!registry_lookup(seg.host_base, host_bytes, &pinned)) {
      // Not ours (e.g. cupyx.empty_pinned): ask the driver about both ends.
      err = cudaPointerGetAttributes(&attr, seg.host_base);
      if (err != cudaSuccess) return cuda_error(err, "cudaPointerGetAttributes(host_base)");
      pinned = attr.type == cudaMemoryTypeHost;
      attr_device_ptr = attr.devicePointer;
      if (pinned && host_bytes > 1) {
        cudaPointerAttributes last;
        err = cudaPointerGetAttributes(&last, static_cast<char*>(seg.host_base) + host_bytes - 1);
        if (err != cudaSuccess) return cuda_error(err, "cudaPointerGetAttributes(host end)");
        pinned = last.type == cudaMemoryTypeHost;
      }
    }
    void* kernel_addr = nullptr;
    if (pinned) {
      // The device's own mapping of this address: equal to the host address only
      // where cudaDevAttrCanUseHostPointerForRegisteredMem says so.
      err = cudaHostGetDevicePointer(&kernel_addr, seg.host_base, 0);
      if (err != cudaSuccess) {
        cudaGetLastError();
        kernel_addr = attr_device_ptr;  // what the pointer query reported on this device
      }
    }
    if (!pinned || kernel_addr == nullptr) {
      return set_error(FKV_EINVAL,
                       "segments[%d].host_base: %p region is not pinned, mapped host memory "
                       "(allocate it with fkv_host_alloc(..., pin_for_cuda=1) or cudaHostAlloc)",
                       s, seg.host_base);
    }
    (*out)[s] = {static_cast<char*>(seg.device_base), static_cast<char*>(seg.host_base),
                 static_cast<char*>(kernel_addr), seg.block_bytes, seg.host_stride};
  }
  return FKV_OK;
}

int64_t memcpy_min_bytes_now() { return g_memcpy_min_bytes.load(std::memory_order_relaxed); }

// One segment's copy-engine runs: one cudaMemcpyAsync per run where the host blocks
// lie back to back, else one cudaMemcpy2DAsync (rows of block_bytes, host rows
// host_stride apart: the host tier's blocks interleave their segments).
int enqueue_memcpy_runs(const PlanSegment& seg, const std::vector<BlockRun>& runs, int64_t min_run,
                        bool h2d, cudaStream_t stream) {
  const int64_t bb = seg.block_bytes;
  const size_t row = static_cast<size_t>(bb);
  const size_t pitch = static_cast<size_t>(seg.host_stride);
  for (const BlockRun& run : runs) {
    if (run.num_blocks < min_run) continue;
    char* dev = seg.device + run.device_id * bb;
    char* host = seg.host + run.host_id * seg.host_stride;
    const size_t n = static_cast<size_t>(run.num_blocks);
    cudaError_t err;
    if (pitch == row) {
      err = h2d ? cudaMemcpyAsync(dev, host, n * row, cudaMemcpyHostToDevice, stream)
                : cudaMemcpyAsync(host, dev, n * row, cudaMemcpyDeviceToHost, stream);
    } else {
      err = h2d ? cudaMemcpy2DAsync(dev, row, host, pitch, row, n, cudaMemcpyHostToDevice, stream)
                : cudaMemcpy2DAsync(host, pitch, dev, row, row, n, cudaMemcpyDeviceToHost,
                                    stream);
    }
    if (err != cudaSuccess) return cuda_error(err, "cudaMemcpyAsync(run)");
  }
  return FKV_OK;
}

// The kernel over descriptors [0, num_descs) (dev_descs on the device, host_descs
// the same table on the host) and `count` staged ids. An eviction (D2H) goes out
// as several launches of at most the evict-launch bound each (launch_ranges), so
// that it gives its SMs back between them; a load as one.
int launch_kernel(const DevSegment* dev_descs, const DevSegment* host_descs, int32_t num_descs,
                  const char* slot_device, const SlotLayout& layout, bool with_run_len,
                  int64_t count, int64_t memcpy_min, bool h2d, cudaStream_t stream) {
  thread_local std::vector<int64_t> ends;
  const int32_t max_ctas = g_max_ctas.load();
  const int64_t max_work = h2d ? 0 : launch_max_work(g_evict_launch_bytes.load(), max_ctas);
  launch_ranges(host_descs, num_descs, count, max_work, &ends);
  int64_t begin = 0;
  for (const int64_t end : ends) {
    const int grid = static_cast<int>(std::min<int64_t>(max_ctas, end - begin));
    swap_kernel<<<grid, kThreads, 0, stream>>>(
        dev_descs, num_descs, reinterpret_cast<const int64_t*>(slot_device + layout.device_ids),
        reinterpret_cast<const int64_t*>(slot_device + layout.host_ids),
        with_run_len ? reinterpret_cast<const int32_t*>(slot_device + layout.run_len) : nullptr,
        count, begin, end, memcpy_min, h2d ? 1 : 0);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return cuda_error(err, "swap_kernel launch");
    begin = end;
  }
  return FKV_OK;
}

thread_local std::vector<BlockRun> t_runs;
thread_local std::vector<PlanSegment> t_resolved;
thread_local std::vector<int32_t> t_run_len;
thread_local std::vector<DevSegment> t_descs;
thread_local std::vector<SlotRef> t_slots;

}  // namespace

// ------------------------------------------------------------------ layouts

struct CudaLayout {
  int device = -1;
  int32_t segments_per_layer = 0;
  int32_t num_layers = 0;
  std::vector<PlanSegment> segs;
  std::vector<DevSegment> descs;  // chunk prefixes restart at every layer
  DevSegment* device_descs = nullptr;
  // The same segments numbered as one group (prefixes over the whole table), for
  // a transfer of every layer that records no layer events: one kernel launch per
  // staged slot instead of one per layer. In the same allocation, after descs.
  std::vector<DevSegment> descs_all;
  DevSegment* device_descs_all = nullptr;
};

int cuda_layout_create(const fkv_segment* segments, int32_t num_segments,
                       int32_t segments_per_layer, int64_t num_host_blocks, int device,
                       CudaLayout** out) {
  load_env_once();
  int rc = check_device_ordinal(device, "cuda_device");
  if (rc != FKV_OK) return rc;
  DeviceGuard guard;
  rc = guard.use(device);
  if (rc != FKV_OK) return rc;
  rc = init_device(device);
  if (rc != FKV_OK) return rc;
  auto* layout = new CudaLayout();
  layout->device = device;
  layout->segments_per_layer = segments_per_layer;
  layout->num_layers = num_segments / segments_per_layer;
  rc = resolve_segments(segments, num_segments, num_host_blocks, device, &layout->segs);
  if (rc != FKV_OK) {
    delete layout;
    return rc;
  }
  layout->descs.resize(num_segments);
  for (int32_t s = 0; s < num_segments; ++s) layout->descs[s] = make_dev_segment(layout->segs[s]);
  for (int32_t l = 0; l < layout->num_layers; ++l) {
    set_chunk_prefixes(layout->descs.data() + static_cast<size_t>(l) * segments_per_layer,
                       segments_per_layer);
  }
  layout->descs_all = layout->descs;
  set_chunk_prefixes(layout->descs_all.data(), num_segments);
  const size_t bytes = layout->descs.size() * sizeof(DevSegment);
  cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&layout->device_descs), 2 * bytes);
  if (err == cudaSuccess) {
    layout->device_descs_all = layout->device_descs + num_segments;
    err = cudaMemcpy(layout->device_descs, layout->descs.data(), bytes, cudaMemcpyHostToDevice);
  }
  if (err == cudaSuccess) {
    err = cudaMemcpy(layout->device_descs_all, layout->descs_all.data(), bytes,
                     cudaMemcpyHostToDevice);
  }
  if (err != cudaSuccess) {
    rc = cuda_error(err, "layout descriptors (cudaMalloc/cudaMemcpy)");
    if (layout->device_descs) cudaFree(layout->device_descs);
    delete layout;
    return rc;
  }
  *out = layout;
  return FKV_OK;
}

void cuda_layout_destroy(CudaLayout* layout) {
  if (layout == nullptr) return;
  if (layout->device_descs != nullptr) {
    DeviceGuard guard;
    // The caller has finished every transfer of this layout (its contract); a
    // queued kernel reading the descriptors would otherwise fault.
    if (guard.use(layout->device) == FKV_OK) cudaFree(layout->device_descs);
  }
  delete layout;
}

namespace {

// A layout transfer's calls on CUDA (fkv_layout_launch.h), the layout's device
// current (the caller's guard).
struct CudaLayoutOps {
  using Slot = SlotRef;
  const CudaLayout& layout;
  const std::vector<BlockRun>& runs;
  const RunExtent& extent;
  const int64_t* device_ids;
  const int64_t* host_ids;
  const int32_t* run_len;  // NULL: no copy-engine runs to skip
  int64_t per_slot;
  int64_t num_ids;
  int64_t memcpy_min;
  bool h2d;
  cudaStream_t stream;
  Deadline deadline;

  int acquire(SlotRef* out) { return acquire_slot(layout.device, out, deadline); }
  int upload(const SlotRef& ref, int64_t i0, int64_t count) {
    return upload_slot(ref, slot_layout(0, count, run_len != nullptr), nullptr, 0,
                       device_ids + i0, host_ids + i0,
                       run_len != nullptr ? run_len + i0 : nullptr, count, stream);
  }
  int wait(void* event, bool quiet) {
    const cudaError_t err = cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(event), 0);
    if (err == cudaSuccess) return FKV_OK;
    if (!quiet) return cuda_error(err, "cudaStreamWaitEvent(wait event)");
    cudaGetLastError();  // the first failure stays the one reported
    return FKV_ECUDA;
  }
  int record(void* event, bool quiet) {
    const cudaError_t err = cudaEventRecord(static_cast<cudaEvent_t>(event), stream);
    if (err == cudaSuccess) return FKV_OK;
    if (!quiet) return cuda_error(err, "cudaEventRecord(layer event)");
    cudaGetLastError();  // the first failure stays the one reported
    return FKV_ECUDA;
  }
  // One layer: its copy-engine runs per segment, then one kernel per staged slot.
  int enqueue_layer(int32_t layer, const std::vector<SlotRef>& slots) {
    const int32_t spl = layout.segments_per_layer;
    const size_t s0 = static_cast<size_t>(layer) * spl;
    bool needs_kernel = false;
    for (int32_t k = 0; k < spl; ++k) {
      const PlanSegment& seg = layout.segs[s0 + k];
      const int64_t min_run = memcpy_min_run(memcpy_min, seg.block_bytes);
      if (extent.engine_moves_some(min_run)) {
        const int rc = enqueue_memcpy_runs(seg, runs, min_run, h2d, stream);
        if (rc != FKV_OK) return rc;
      }
      needs_kernel = needs_kernel || extent.kernel_moves_some(min_run);
    }
    for (size_t c = 0; c < slots.size() && needs_kernel; ++c) {
      const int64_t i0 = static_cast<int64_t>(c) * per_slot;
      const int64_t count = std::min(per_slot, num_ids - i0);
      const int rc = launch_kernel(layout.device_descs + s0, layout.descs.data() + s0, spl,
                                   slots[c].device, slot_layout(0, count, run_len != nullptr),
                                   run_len != nullptr, count, memcpy_min, h2d, stream);
      if (rc != FKV_OK) return rc;
    }
    return FKV_OK;
  }
  void release(const SlotRef& ref) { release_slot(layout.device, ref, stream); }
};

}  // namespace

int cuda_layout_swap(CudaLayout* layout, const std::vector<BlockRun>& runs,
                     const int64_t* device_ids, const int64_t* host_ids, int64_t num_ids,
                     int32_t direction, int32_t first_layer, int32_t num_layers,
                     void* cuda_stream, void* const* layer_events, void* const* wait_events,
                     int32_t waits_per_layer, int32_t* failed_layer) {
  load_env_once();
  *failed_layer = first_layer;
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  DeviceGuard guard;
  int rc = guard.use(layout->device);
  if (rc != FKV_OK) return rc;
  rc = check_not_capturing(stream);
  if (rc != FKV_OK) return rc;

  const bool h2d = direction == FKV_H2D;
  const int64_t memcpy_min = memcpy_min_bytes_now();
  const int32_t spl = layout->segments_per_layer;
  const size_t seg_begin = static_cast<size_t>(first_layer) * spl;
  const size_t seg_end = seg_begin + static_cast<size_t>(num_layers) * spl;

  // Whether any segment has copy-engine runs, and so whether the kernel needs run
  // lengths to skip those ids. The run extent is found once for every layer.
  const RunExtent extent = run_extent(runs);
  bool with_run_len = false;
  for (size_t s = seg_begin; s < seg_end && num_ids > 0; ++s) {
    if (extent.engine_moves_some(memcpy_min_run(memcpy_min, layout->segs[s].block_bytes))) {
      with_run_len = true;
      break;
    }
  }
  if (with_run_len) {
    t_run_len.resize(num_ids);
    fill_run_len(runs, t_run_len.data());
  }
  const int64_t per_slot = ids_per_slot(kSlotBytes, 0, with_run_len);
  const int32_t* run_len = with_run_len ? t_run_len.data() : nullptr;
  CudaLayoutOps ops{*layout, runs,    extent,     device_ids, host_ids, run_len,
                    per_slot, num_ids, memcpy_min, h2d,        stream,   staging_deadline()};
  const LayerOrder order{first_layer, num_layers, layer_events, wait_events, waits_per_layer};

  // Stage the ids once for every layer of this call.
  std::vector<SlotRef>& slots = t_slots;
  rc = stage_ids(ops, num_ids, per_slot, &slots);

  int32_t layer = first_layer;
  // Every layer, no layer events and no waits: the copy-engine runs per segment,
  // then one kernel per staged slot over the whole segment table.
  const bool one_launch = takes_one_launch(layer_events != nullptr || order.ordered(),
                                           first_layer, num_layers, layout->num_layers);
  if (rc == FKV_OK && one_launch) {
    bool needs_kernel = false;
    for (size_t s = seg_begin; s < seg_end && rc == FKV_OK; ++s) {
      const PlanSegment& seg = layout->segs[s];
      const int64_t min_run = memcpy_min_run(memcpy_min, seg.block_bytes);
      if (extent.engine_moves_some(min_run)) {
        rc = enqueue_memcpy_runs(seg, runs, min_run, h2d, stream);
      }
      needs_kernel = needs_kernel || extent.kernel_moves_some(min_run);
    }
    const int32_t nseg = static_cast<int32_t>(seg_end - seg_begin);
    for (size_t c = 0; c < slots.size() && rc == FKV_OK && needs_kernel; ++c) {
      const int64_t i0 = static_cast<int64_t>(c) * per_slot;
      const int64_t count = std::min(per_slot, num_ids - i0);
      rc = launch_kernel(layout->device_descs_all, layout->descs_all.data(), nseg,
                         slots[c].device, slot_layout(0, count, with_run_len), with_run_len,
                         count, memcpy_min, h2d, stream);
    }
    if (rc == FKV_OK) layer = first_layer + num_layers;
  }
  // Layer by layer, each after its waits and followed by its event.
  if (rc == FKV_OK && !one_launch) rc = enqueue_layers(ops, order, slots, &layer);
  return end_transfer(ops, rc, order, layer, slots, failed_layer);
}

// -------------------------------------------------------- host registration

// Registration and unregistration make a context current; with device >= 0 it is
// that device's (and the caller's context is restored), never a hidden device 0.
int cuda_host_register(void* p, size_t bytes, int device) {
  DeviceGuard guard;
  if (device >= 0) {
    const int rc = check_device_ordinal(device, "pin_device");
    if (rc != FKV_OK) return rc;
    const int used = guard.use(device);
    if (used != FKV_OK) return used;
  }
  FKV_CUDA_TRY(cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
  return FKV_OK;
}

int cuda_host_unregister(void* p, int device) {
  DeviceGuard guard;
  if (device >= 0) {
    const int used = guard.use(device);
    if (used != FKV_OK) return used;
  }
  FKV_CUDA_TRY(cudaHostUnregister(p));
  return FKV_OK;
}

}  // namespace fkv

extern "C" {

FKV_API int fkv_built_with_cuda(void) { return 1; }

FKV_API int fkv_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // not sticky, but do not leave it for the caller's next check
    return 0;
  }
  return n;
}

FKV_API int fkv_cuda_get_info(fkv_cuda_info* info) {
  using namespace fkv;
  if (info == nullptr) return set_error(FKV_EINVAL, "info: NULL");
  std::memset(info, 0, sizeof(*info));
  info->built_with_cuda = 1;
  info->runtime_version = CUDART_VERSION;
  snprintf(info->archs, sizeof(info->archs), "%s", FKV_CUDA_ARCH_LIST);
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  cudaGetLastError();
  info->driver_version = driver;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  cudaGetLastError();
  const int rt_major = CUDART_VERSION / 1000;
  const int rt_minor = CUDART_VERSION % 1000 / 10;
  if (err == cudaSuccess && count > 0) {
    info->device_count = count;
    snprintf(info->status, sizeof(info->status), "ok");
  } else if (driver == 0) {
    snprintf(info->status, sizeof(info->status),
             "no NVIDIA driver (libcuda.so.1 could not be loaded): install the NVIDIA driver");
  } else if (driver < CUDART_VERSION || err == cudaErrorInsufficientDriver) {
    snprintf(info->status, sizeof(info->status),
             "the driver supports CUDA %d.%d but the core was built with the CUDA %d.%d "
             "runtime: update the driver (CUDA 13 needs >= 580, CUDA 12 >= 525), or rebuild "
             "fastkv with a CUDA %d.x toolkit (CUDA_HOME=<toolkit> make install)",
             driver / 1000, driver % 1000 / 10, rt_major, rt_minor, driver / 1000);
  } else if (err == cudaErrorNoDevice || count == 0) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    snprintf(info->status, sizeof(info->status),
             "the driver (CUDA %d.%d) sees no CUDA device (CUDA_VISIBLE_DEVICES=%s)",
             driver / 1000, driver % 1000 / 10, visible ? visible : "<unset>");
  } else {
    snprintf(info->status, sizeof(info->status), "cudaGetDeviceCount: %s (%s)",
             cudaGetErrorName(err), cudaGetErrorString(err));
  }
  return FKV_OK;
}

FKV_API int fkv_cuda_init(int device) {
  using namespace fkv;
  load_env_once();
  int rc = check_device_ordinal(device, "device");
  if (rc != FKV_OK) return rc;
  DeviceGuard guard;
  rc = guard.use(device);
  if (rc != FKV_OK) return rc;
  return init_device(device);
}

FKV_API int fkv_cuda_staging_stats(int device, int64_t* slots, int64_t* slot_bytes,
                                   int64_t* grows) {
  using namespace fkv;
  if (device < 0 || device >= kMaxDevices) {
    return set_error(FKV_EINVAL, "device: %d out of range [0, %d)", device, kMaxDevices);
  }
  Ring<cudaEvent_t>& ring = g_devices[device].ring;
  std::lock_guard<std::mutex> lock(ring.mu);
  if (slots) *slots = static_cast<int64_t>(ring.slots.size());
  if (slot_bytes) *slot_bytes = static_cast<int64_t>(kSlotBytes);
  if (grows) *grows = ring.grows;
  return FKV_OK;
}

FKV_API int fkv_cuda_pci_bus_id(int device, char* buf, int buf_len) {
  using namespace fkv;
  if (buf == nullptr || buf_len < 16) {
    return set_error(FKV_EINVAL, "buf_len: %d is too small (need >= 16)", buf_len);
  }
  FKV_CUDA_TRY(cudaDeviceGetPCIBusId(buf, buf_len, device));
  for (char* c = buf; *c; ++c) *c = static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
  return FKV_OK;
}

FKV_API int fkv_cuda_stream_create(int device, int priority, void** stream) {
  using namespace fkv;
  if (stream == nullptr) return set_error(FKV_EINVAL, "stream: NULL output pointer");
  int rc = check_device_ordinal(device, "device");
  if (rc != FKV_OK) return rc;
  DeviceGuard guard;
  rc = guard.use(device);
  if (rc != FKV_OK) return rc;
  int least = 0;
  int greatest = 0;
  FKV_CUDA_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  const int prio = priority > 0 ? greatest : priority < 0 ? least : 0;
  cudaStream_t s = nullptr;
  FKV_CUDA_TRY(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, prio));
  *stream = s;
  return FKV_OK;
}

FKV_API int fkv_cuda_stream_destroy(int device, void* stream) {
  using namespace fkv;
  DeviceGuard guard;
  int rc = guard.use(device);
  if (rc != FKV_OK) return rc;
  FKV_CUDA_TRY(cudaStreamDestroy(static_cast<cudaStream_t>(stream)));
  return FKV_OK;
}

FKV_API int fkv_cuda_stream_priority(int device, void* stream, int* priority) {
  using namespace fkv;
  if (priority == nullptr) return set_error(FKV_EINVAL, "priority: NULL output pointer");
  DeviceGuard guard;
  int rc = guard.use(device);
  if (rc != FKV_OK) return rc;
  FKV_CUDA_TRY(cudaStreamGetPriority(static_cast<cudaStream_t>(stream), priority));
  return FKV_OK;
}

FKV_API int fkv_cuda_stream_capturing(int device, void* stream, int* capturing) {
  using namespace fkv;
  if (capturing == nullptr) return set_error(FKV_EINVAL, "capturing: NULL output pointer");
  DeviceGuard guard;
  int rc = guard.use(device);
  if (rc != FKV_OK) return rc;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FKV_CUDA_TRY(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  *capturing = status != cudaStreamCaptureStatusNone ? 1 : 0;
  return FKV_OK;
}

FKV_API int fkv_cuda_event_create(int device, void** event) {
  using namespace fkv;
  if (event == nullptr) return set_error(FKV_EINVAL, "event: NULL output pointer");
  int rc = check_device_ordinal(device, "device");
  if (rc != FKV_OK) return rc;
  DeviceGuard guard;
  rc = guard.use(device);
  if (rc != FKV_OK) return rc;
  cudaEvent_t e = nullptr;
  FKV_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  *event = e;
  return FKV_OK;
}

FKV_API int fkv_cuda_event_destroy(int device, void* event) {
  using namespace fkv;
  DeviceGuard guard;
  int rc = guard.use(device);
  if (rc != FKV_OK) return rc;
  FKV_CUDA_TRY(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
  return FKV_OK;
}

FKV_API int fkv_cuda_event_record(int device, void* event, void* stream) {
  using namespace fkv;
  DeviceGuard guard;
  int rc = guard.use(device);
  if (rc != FKV_OK) return rc;
  FKV_CUDA_TRY(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
  return FKV_OK;
}

FKV_API int fkv_cuda_stream_wait_event(int device, void* stream, void* event) {
  using namespace fkv;
  DeviceGuard guard;
  int rc = guard.use(device);
  if (rc != FKV_OK) return rc;
  FKV_CUDA_TRY(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                   static_cast<cudaEvent_t>(event), 0));
  return FKV_OK;
}

FKV_API int fkv_cuda_event_query(int device, void* event) {
  using namespace fkv;
  DeviceGuard guard;
  int rc = guard.use(device);
  if (rc != FKV_OK) return rc;
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaSuccess) return FKV_OK;
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return FKV_ENOTREADY;
  }
  return cuda_error(err, "cudaEventQuery");
}

FKV_API int fkv_cuda_event_wait(int device, void* event, int64_t timeout_ns) {
  using namespace fkv;
  DeviceGuard guard;
  int rc = guard.use(device);
  if (rc != FKV_OK) return rc;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::nanoseconds(std::max<int64_t>(timeout_ns, 0));
  for (;;) {
    const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (err == cudaSuccess) return FKV_OK;
    if (err != cudaErrorNotReady) return cuda_error(err, "cudaEventQuery");
    cudaGetLastError();
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      return set_error(FKV_ETIMEDOUT, "event: not complete after %.3f s",
                       std::chrono::duration<double>(now - start).count());
    }
    // Yield while the wait is young (a layer usually lands within microseconds of
    // the first query), then sleep briefly: precise without burning a core.
    if (now - start < std::chrono::microseconds(100)) {
      sched_yield();
    } else {
      sleep_us(20);
    }
  }
}

FKV_API int fkv_cuda_set_tuning(int64_t memcpy_min_bytes, int32_t max_ctas) {
  using namespace fkv;
  load_env_once();
  if (max_ctas == 0) return set_error(FKV_EINVAL, "max_ctas: must be > 0 (or < 0 to keep)");
  if (memcpy_min_bytes >= 0) g_memcpy_min_bytes.store(memcpy_min_bytes);
  if (max_ctas > 0) g_max_ctas.store(std::min(max_ctas, 65535));
  return FKV_OK;
}

FKV_API void fkv_cuda_get_tuning(int64_t* memcpy_min_bytes, int32_t* max_ctas) {
  using namespace fkv;
  load_env_once();
  if (memcpy_min_bytes) *memcpy_min_bytes = g_memcpy_min_bytes.load();
  if (max_ctas) *max_ctas = g_max_ctas.load();
}

FKV_API int fkv_cuda_set_evict_launch_bytes(int64_t bytes) {
  using namespace fkv;
  load_env_once();
  if (bytes < 0) {
    return set_error(FKV_EINVAL, "evict_launch_bytes: %" PRId64 " must be >= 0 (0: no bound)",
                     bytes);
  }
  g_evict_launch_bytes.store(bytes);
  return FKV_OK;
}

FKV_API int64_t fkv_cuda_get_evict_launch_bytes(void) {
  using namespace fkv;
  load_env_once();
  return g_evict_launch_bytes.load();
}

FKV_API int fkv_swap_cuda(const fkv_segment* segments, int32_t num_segments,
                          int64_t num_device_blocks, int64_t num_host_blocks,
                          const int64_t* device_ids, const int64_t* host_ids, int64_t num_ids,
                          int32_t direction, void* cuda_stream) {
  using namespace fkv;
  load_env_once();
  std::vector<BlockRun>& runs = t_runs;
  int rc = validate_swap(segments, num_segments, num_device_blocks, num_host_blocks, device_ids,
                         host_ids, num_ids, direction, &runs);
  if (rc != FKV_OK || runs.empty()) return rc;
  int device = -1;
  {
    ContextKeeper keep;
    cudaPointerAttributes attr;
    const cudaError_t err = cudaPointerGetAttributes(&attr, segments[0].device_base);
    if (err != cudaSuccess) return cuda_error(err, "cudaPointerGetAttributes(device_base)");
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
      return set_error(FKV_EINVAL, "segments[0].device_base: %p is not CUDA device memory",
                       segments[0].device_base);
    }
    device = attr.device;
  }
  if (device < 0 || device >= kMaxDevices) {
    return set_error(FKV_EINVAL, "segments[0].device_base: device %d out of range [0, %d)",
                     device, kMaxDevices);
  }
  DeviceGuard guard;
  rc = guard.use(device);
  if (rc != FKV_OK) return rc;
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  rc = check_not_capturing(stream);
  if (rc != FKV_OK) return rc;
  std::vector<PlanSegment>& resolved = t_resolved;
  rc = resolve_segments(segments, num_segments, num_host_blocks, device, &resolved);
  if (rc != FKV_OK) return rc;

  const bool h2d = direction == FKV_H2D;
  const int64_t memcpy_min = memcpy_min_bytes_now();

  // Long runs: cudaMemcpyAsync per segment and run, on the copy engine.
  std::vector<DevSegment>& descs = t_descs;
  descs.clear();
  const RunExtent extent = run_extent(runs);
  bool any_skipped = false;
  for (int32_t s = 0; s < num_segments; ++s) {
    const int64_t min_run = memcpy_min_run(memcpy_min, resolved[s].block_bytes);
    const bool by_engine = extent.engine_moves_some(min_run);
    if (by_engine) {
      rc = enqueue_memcpy_runs(resolved[s], runs, min_run, h2d, stream);
      if (rc != FKV_OK) return rc;
    }
    if (!extent.kernel_moves_some(min_run)) continue;
    any_skipped = any_skipped || by_engine;
    descs.push_back(make_dev_segment(resolved[s]));
  }
  if (descs.empty()) return FKV_OK;
  if (any_skipped) {
    t_run_len.resize(num_ids);
    fill_run_len(runs, t_run_len.data());
  }

  // Launches that fit one staging slot each: segment groups of at most half a
  // slot of descriptors, then id ranges filling the rest.
  const int32_t nk = static_cast<int32_t>(descs.size());
  const int32_t max_group = static_cast<int32_t>(kSlotBytes / 2 / sizeof(DevSegment));
  const Deadline deadline = staging_deadline();
  for (int32_t g0 = 0; g0 < nk; g0 += max_group) {
    const int32_t group = std::min(max_group, nk - g0);
    DevSegment* gdescs = descs.data() + g0;
    set_chunk_prefixes(gdescs, group);
    const size_t desc_bytes = group * sizeof(DevSegment);
    const int64_t max_ids = ids_per_slot(kSlotBytes, desc_bytes, any_skipped);
    for (int64_t i0 = 0; i0 < num_ids; i0 += max_ids) {
      const int64_t count = std::min(max_ids, num_ids - i0);
      const SlotLayout sl = slot_layout(desc_bytes, count, any_skipped);
      SlotRef ref{};
      rc = acquire_slot(device, &ref, deadline);
      if (rc != FKV_OK) return rc;
      rc = upload_slot(ref, sl, gdescs, desc_bytes, device_ids + i0, host_ids + i0,
                       any_skipped ? t_run_len.data() + i0 : nullptr, count, stream);
      if (rc == FKV_OK) {
        rc = launch_kernel(reinterpret_cast<const DevSegment*>(ref.device + sl.descs),
                           gdescs, group, ref.device, sl, any_skipped, count,
                           memcpy_min, h2d, stream);
      }
      // Record even after a failed launch: the staging copy may be queued and still
      // reading the host slot.
      release_slot(device, ref, stream);
      if (rc != FKV_OK) return rc;
    }
  }
  return FKV_OK;
}

}  // extern "C"

#include "fkv_crc_cuda.cuh"  // PD checksums of device memory
