// CUDA implementation of fkv_swap_cuda and the CUDA half of host allocation.
//
// Short runs (the usual case: scattered blocks) go through one gather/scatter
// kernel that reads or writes pinned host memory directly over UVA; runs long
// enough to keep a copy engine busy go through cudaMemcpyAsync, which costs no SM
// time at all. The kernel's grid is small and fixed (grid-stride loop): a swap is
// PCIe-bound, so a few CTAs with enough bytes in flight saturate the link and the
// rest of the SMs stay with the model.
//
// Block ids and segment descriptors reach the kernel through a per-device ring of
// staging slots allocated once (device memory + a pinned host mirror). Each slot
// carries an event recorded after the launch that read it; a slot is reused only
// after that event has completed, so a caller never overwrites ids a previous,
// still-queued launch is about to read.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cinttypes>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "fkv_internal.h"

namespace fkv {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
// One CTA moves kThreads * kUnroll * 16 B = 16 KiB per iteration with 16-byte
// accesses; a chunk is the unit of work one CTA takes from the grid-stride loop,
// so blocks larger than a chunk are shared between CTAs.
constexpr int64_t kChunkBytes = int64_t{16} << 10;
// A layer-by-layer load takes one slot per layer, and its launches queue behind
// the model's previous step (the input stream waits for it), so every layer of a
// load must find a free slot without waiting: 256 slots cover two loads of a
// 128-layer model. 64 KiB holds about 4,000 block ids; a larger call is split.
// All slots: 16 MiB of device memory and 16 MiB pinned, per device.
constexpr int kSlots = 256;
constexpr size_t kSlotBytes = size_t{64} << 10;
constexpr int kMaxDevices = 64;

struct DevSegment {
  char* device;              // segment's device_base
  char* host;                // kernel-side address of host_base
  int64_t block_bytes;
  int64_t chunks_per_block;
  int64_t chunk_begin;       // first chunk index of this segment in the launch
  int32_t memcpy_min_run;    // ids in runs at least this long (blocks) are skipped
  int32_t vec_bytes;         // 16, 8 or 4
};

std::atomic<int64_t> g_memcpy_min_bytes{-1};
std::atomic<int32_t> g_max_ctas{-1};

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return (end && *end == '\0' && n >= 0) ? n : fallback;
}

void load_tuning_defaults() {
  int64_t expect = -1;
  g_memcpy_min_bytes.compare_exchange_strong(
      expect, env_int("FASTKV_CUDA_MEMCPY_MIN_BYTES", int64_t{1} << 20));
  int32_t expect_ctas = -1;
  const int64_t ctas = env_int("FASTKV_CUDA_MAX_CTAS", 16);
  g_max_ctas.compare_exchange_strong(expect_ctas,
                                     static_cast<int32_t>(std::clamp<int64_t>(ctas, 1, 65535)));
}

int cuda_error(cudaError_t err, const char* what) {
  return set_error(FKV_ECUDA, "%s: %s (%s)", what, cudaGetErrorName(err),
                   cudaGetErrorString(err));
}

#define FKV_CUDA_TRY(call)                                       \
  do {                                                           \
    const cudaError_t fkv_err_ = (call);                         \
    if (fkv_err_ != cudaSuccess) return cuda_error(fkv_err_, #call); \
  } while (0)

template <typename V>
__device__ __forceinline__ void copy_chunk(char* dst, const char* src, int64_t nbytes) {
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  const int64_t n = nbytes / static_cast<int64_t>(sizeof(V));
  const int64_t stride = static_cast<int64_t>(blockDim.x) * kUnroll;
  for (int64_t base = threadIdx.x; base < n; base += stride) {
    // All loads first, then all stores: kUnroll independent PCIe reads in flight
    // per thread is what hides the ~1-2 us latency of host memory.
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = base + static_cast<int64_t>(u) * blockDim.x;
      if (k < n) r[u] = __ldcs(s + k);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = base + static_cast<int64_t>(u) * blockDim.x;
      // Streaming stores: the blocks are not read again by this kernel, so they
      // should not evict the model's working set from L2.
      if (k < n) __stcs(d + k, r[u]);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    swap_kernel(const DevSegment* __restrict__ segs, int32_t num_segs,
                const int64_t* __restrict__ device_ids, const int64_t* __restrict__ host_ids,
                const int32_t* __restrict__ run_len, int64_t num_chunks, int32_t h2d) {
  for (int64_t g = blockIdx.x; g < num_chunks; g += gridDim.x) {
    // Last segment whose first chunk is <= g (every staged segment has chunks).
    int32_t lo = 0;
    int32_t hi = num_segs - 1;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      if (segs[mid].chunk_begin <= g) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const DevSegment& seg = segs[lo];
    const int64_t local = g - seg.chunk_begin;
    const int64_t i = local / seg.chunks_per_block;
    if (run_len != nullptr && run_len[i] >= seg.memcpy_min_run) continue;
    const int64_t off = (local - i * seg.chunks_per_block) * kChunkBytes;
    const int64_t nbytes = min(kChunkBytes, seg.block_bytes - off);
    char* dev = seg.device + device_ids[i] * seg.block_bytes + off;
    char* host = seg.host + host_ids[i] * seg.block_bytes + off;
    char* dst = h2d ? dev : host;
    const char* src = h2d ? host : dev;
    if (seg.vec_bytes == 16) {
      copy_chunk<uint4>(dst, src, nbytes);
    } else if (seg.vec_bytes == 8) {
      copy_chunk<uint2>(dst, src, nbytes);
    } else {
      copy_chunk<unsigned int>(dst, src, nbytes);
    }
  }
}

struct Ring {
  std::mutex mu;
  std::condition_variable freed;
  bool ready = false;
  char* device_buf = nullptr;
  char* host_buf = nullptr;
  cudaEvent_t events[kSlots] = {};
  bool busy[kSlots] = {};
  int cursor = 0;
};

Ring g_rings[kMaxDevices];

int init_ring_locked(Ring& ring) {
  if (ring.ready) return FKV_OK;
  FKV_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&ring.device_buf), kSlots * kSlotBytes));
  const cudaError_t err = cudaHostAlloc(reinterpret_cast<void**>(&ring.host_buf),
                                        kSlots * kSlotBytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    cudaFree(ring.device_buf);
    ring.device_buf = nullptr;
    return cuda_error(err, "cudaHostAlloc(staging ring)");
  }
  for (int k = 0; k < kSlots; ++k) {
    const cudaError_t e = cudaEventCreateWithFlags(&ring.events[k], cudaEventDisableTiming);
    if (e != cudaSuccess) {
      for (int j = 0; j < k; ++j) cudaEventDestroy(ring.events[j]);
      cudaFreeHost(ring.host_buf);
      cudaFree(ring.device_buf);
      ring.host_buf = ring.device_buf = nullptr;
      return cuda_error(e, "cudaEventCreateWithFlags(staging ring)");
    }
  }
  ring.ready = true;
  return FKV_OK;
}

// Claims a slot and waits until the last launch that used it has finished
// reading it. Slots are claimed round-robin, so with kSlots slots the wait only
// blocks when that many launches are still queued on the GPU.
int acquire_slot(Ring& ring, int* slot) {
  {
    std::unique_lock<std::mutex> lock(ring.mu);
    int rc = init_ring_locked(ring);
    if (rc != FKV_OK) return rc;
    ring.freed.wait(lock, [&ring] {
      return std::find(std::begin(ring.busy), std::end(ring.busy), false) != std::end(ring.busy);
    });
    int k = ring.cursor;
    while (ring.busy[k]) k = (k + 1) % kSlots;
    ring.busy[k] = true;
    ring.cursor = (k + 1) % kSlots;
    *slot = k;
  }
  const cudaError_t err = cudaEventSynchronize(ring.events[*slot]);
  if (err != cudaSuccess) {
    std::lock_guard<std::mutex> lock(ring.mu);
    ring.busy[*slot] = false;
    ring.freed.notify_one();
    return cuda_error(err, "cudaEventSynchronize(staging slot)");
  }
  return FKV_OK;
}

void release_slot(Ring& ring, int slot) {
  std::lock_guard<std::mutex> lock(ring.mu);
  ring.busy[slot] = false;
  ring.freed.notify_one();
}

// Restores the caller's current device on every exit path.
class DeviceGuard {
 public:
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  int use(int device) {
    int current = -1;
    FKV_CUDA_TRY(cudaGetDevice(&current));
    if (current != device) {
      FKV_CUDA_TRY(cudaSetDevice(device));
      prev_ = current;
    }
    return FKV_OK;
  }

 private:
  int prev_ = -1;
};

struct ResolvedSegment {
  char* device;
  char* host;         // host address (for cudaMemcpyAsync)
  char* host_kernel;  // the same memory as the kernel addresses it
  int64_t block_bytes;
};

// Checks what validation on the CPU cannot: device_base is device memory of one
// device, host_base regions are pinned and mapped (a kernel touching pageable
// memory would fault and poison the whole CUDA context).
int resolve_segments(const fkv_segment* segments, int32_t num_segments,
                     int64_t num_host_blocks, std::vector<ResolvedSegment>* out, int* device) {
  out->resize(num_segments);
  *device = -1;
  for (int32_t s = 0; s < num_segments; ++s) {
    const fkv_segment& seg = segments[s];
    cudaPointerAttributes attr;
    cudaError_t err = cudaPointerGetAttributes(&attr, seg.device_base);
    if (err != cudaSuccess) return cuda_error(err, "cudaPointerGetAttributes(device_base)");
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
      return set_error(FKV_EINVAL, "segments[%d].device_base: %p is not CUDA device memory", s,
                       seg.device_base);
    }
    if (*device < 0) {
      *device = attr.device;
    } else if (attr.device != *device) {
      return set_error(FKV_EINVAL,
                       "segments[%d].device_base: on device %d, segments[0] is on device %d", s,
                       attr.device, *device);
    }
    const size_t host_bytes = static_cast<size_t>(num_host_blocks * seg.block_bytes);
    bool pinned = false;
    void* kernel_addr = nullptr;
    if (!registry_lookup(seg.host_base, host_bytes, &pinned, &kernel_addr)) {
      // Not ours (e.g. cupyx.empty_pinned): ask the driver about both ends.
      err = cudaPointerGetAttributes(&attr, seg.host_base);
      if (err != cudaSuccess) return cuda_error(err, "cudaPointerGetAttributes(host_base)");
      pinned = attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr;
      kernel_addr = attr.devicePointer;
      if (pinned && host_bytes > 1) {
        cudaPointerAttributes last;
        err = cudaPointerGetAttributes(&last, static_cast<char*>(seg.host_base) + host_bytes - 1);
        if (err != cudaSuccess) return cuda_error(err, "cudaPointerGetAttributes(host end)");
        pinned = last.type == cudaMemoryTypeHost;
      }
    }
    if (!pinned) {
      return set_error(FKV_EINVAL,
                       "segments[%d].host_base: %p region is not pinned, mapped host memory "
                       "(allocate it with fkv_host_alloc(..., pin_for_cuda=1) or cudaHostAlloc)",
                       s, seg.host_base);
    }
    (*out)[s] = {static_cast<char*>(seg.device_base), static_cast<char*>(seg.host_base),
                 static_cast<char*>(kernel_addr), seg.block_bytes};
  }
  return FKV_OK;
}

int vec_bytes_for(const ResolvedSegment& r) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(r.device) |
                         reinterpret_cast<uintptr_t>(r.host_kernel) |
                         static_cast<uintptr_t>(r.block_bytes);
  if (bits % 16 == 0) return 16;
  if (bits % 8 == 0) return 8;
  return 4;
}

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

thread_local std::vector<BlockRun> t_runs;
thread_local std::vector<ResolvedSegment> t_resolved;
thread_local std::vector<int32_t> t_run_len;
thread_local std::vector<DevSegment> t_descs;
thread_local std::vector<DevSegment> t_kernel_segs;

// Stages one launch's descriptors and id range through a ring slot and launches.
int launch_kernel(Ring& ring, const DevSegment* descs, int32_t num_descs, const int64_t* dev_ids,
                  const int64_t* host_ids, const int32_t* run_len, int64_t count, bool h2d,
                  cudaStream_t stream) {
  int64_t chunks = 0;
  std::vector<DevSegment>& staged = t_descs;
  staged.assign(descs, descs + num_descs);
  for (DevSegment& d : staged) {
    d.chunk_begin = chunks;
    chunks += count * d.chunks_per_block;
  }
  const size_t desc_bytes = align_up(num_descs * sizeof(DevSegment), 16);
  const size_t ids_bytes = align_up(count * sizeof(int64_t), 16);
  const size_t len_bytes = run_len ? align_up(count * sizeof(int32_t), 16) : 0;
  const size_t total = desc_bytes + 2 * ids_bytes + len_bytes;

  int slot = -1;
  int rc = acquire_slot(ring, &slot);
  if (rc != FKV_OK) return rc;
  char* host = ring.host_buf + slot * kSlotBytes;
  char* dev = ring.device_buf + slot * kSlotBytes;
  std::memcpy(host, staged.data(), num_descs * sizeof(DevSegment));
  std::memcpy(host + desc_bytes, dev_ids, count * sizeof(int64_t));
  std::memcpy(host + desc_bytes + ids_bytes, host_ids, count * sizeof(int64_t));
  if (run_len) std::memcpy(host + desc_bytes + 2 * ids_bytes, run_len, count * sizeof(int32_t));

  cudaError_t err = cudaMemcpyAsync(dev, host, total, cudaMemcpyHostToDevice, stream);
  if (err == cudaSuccess) {
    const int grid = static_cast<int>(std::min<int64_t>(g_max_ctas.load(), chunks));
    swap_kernel<<<grid, kThreads, 0, stream>>>(
        reinterpret_cast<const DevSegment*>(dev), num_descs,
        reinterpret_cast<const int64_t*>(dev + desc_bytes),
        reinterpret_cast<const int64_t*>(dev + desc_bytes + ids_bytes),
        run_len ? reinterpret_cast<const int32_t*>(dev + desc_bytes + 2 * ids_bytes) : nullptr,
        chunks, h2d ? 1 : 0);
    err = cudaGetLastError();
    rc = err == cudaSuccess ? FKV_OK : cuda_error(err, "swap_kernel launch");
  } else {
    rc = cuda_error(err, "cudaMemcpyAsync(staging slot)");
  }
  // Record even after a failed launch: the staging copy may be queued and still
  // reading the host slot.
  const cudaError_t rec = cudaEventRecord(ring.events[slot], stream);
  if (rec != cudaSuccess && rc == FKV_OK) rc = cuda_error(rec, "cudaEventRecord(staging slot)");
  release_slot(ring, slot);
  return rc;
}

}  // namespace

int cuda_host_register(void* p, size_t bytes, void** device_ptr) {
  FKV_CUDA_TRY(cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
  const cudaError_t err = cudaHostGetDevicePointer(device_ptr, p, 0);
  if (err != cudaSuccess) {
    cudaHostUnregister(p);
    return cuda_error(err, "cudaHostGetDevicePointer");
  }
  return FKV_OK;
}

int cuda_host_unregister(void* p) {
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

FKV_API int fkv_cuda_pci_bus_id(int device, char* buf, int buf_len) {
  using namespace fkv;
  if (buf == nullptr || buf_len < 16) {
    return set_error(FKV_EINVAL, "buf_len: %d is too small (need >= 16)", buf_len);
  }
  FKV_CUDA_TRY(cudaDeviceGetPCIBusId(buf, buf_len, device));
  for (char* c = buf; *c; ++c) *c = static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
  return FKV_OK;
}

FKV_API int fkv_cuda_set_tuning(int64_t memcpy_min_bytes, int32_t max_ctas) {
  using namespace fkv;
  load_tuning_defaults();
  if (max_ctas == 0) return set_error(FKV_EINVAL, "max_ctas: must be > 0 (or < 0 to keep)");
  if (memcpy_min_bytes >= 0) g_memcpy_min_bytes.store(memcpy_min_bytes);
  if (max_ctas > 0) g_max_ctas.store(std::min(max_ctas, 65535));
  return FKV_OK;
}

FKV_API void fkv_cuda_get_tuning(int64_t* memcpy_min_bytes, int32_t* max_ctas) {
  using namespace fkv;
  load_tuning_defaults();
  if (memcpy_min_bytes) *memcpy_min_bytes = g_memcpy_min_bytes.load();
  if (max_ctas) *max_ctas = g_max_ctas.load();
}

FKV_API int fkv_swap_cuda(const fkv_segment* segments, int32_t num_segments,
                          int64_t num_device_blocks, int64_t num_host_blocks,
                          const int64_t* device_ids, const int64_t* host_ids, int64_t num_ids,
                          int32_t direction, void* cuda_stream) {
  using namespace fkv;
  load_tuning_defaults();
  std::vector<BlockRun>& runs = t_runs;
  int rc = validate_swap(segments, num_segments, num_device_blocks, num_host_blocks, device_ids,
                         host_ids, num_ids, direction, &runs);
  if (rc != FKV_OK || runs.empty()) return rc;
  std::vector<ResolvedSegment>& resolved = t_resolved;
  int device = -1;
  rc = resolve_segments(segments, num_segments, num_host_blocks, &resolved, &device);
  if (rc != FKV_OK) return rc;
  if (device < 0 || device >= kMaxDevices) {
    return set_error(FKV_EINVAL, "segments[0].device_base: device %d out of range [0, %d)", device,
                     kMaxDevices);
  }
  DeviceGuard guard;
  rc = guard.use(device);
  if (rc != FKV_OK) return rc;

  const bool h2d = direction == FKV_H2D;
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  const int64_t memcpy_min = g_memcpy_min_bytes.load();

  // Long runs: one cudaMemcpyAsync per segment and run, on the copy engine.
  std::vector<DevSegment>& kernel_segs = t_kernel_segs;
  kernel_segs.clear();
  bool any_skipped = false;
  for (int32_t s = 0; s < num_segments; ++s) {
    const ResolvedSegment& r = resolved[s];
    const int64_t bb = r.block_bytes;
    const int64_t min_run64 =
        memcpy_min <= 0 ? 1 : memcpy_min / bb + (memcpy_min % bb != 0 ? 1 : 0);
    const int32_t min_run = static_cast<int32_t>(std::min<int64_t>(min_run64, INT32_MAX));
    int64_t memcpy_blocks = 0;
    for (const BlockRun& run : runs) {
      if (run.num_blocks < min_run) continue;
      char* dev = r.device + run.device_id * bb;
      char* host = r.host + run.host_id * bb;
      const size_t bytes = static_cast<size_t>(run.num_blocks * bb);
      const cudaError_t err =
          h2d ? cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream)
              : cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream);
      if (err != cudaSuccess) return cuda_error(err, "cudaMemcpyAsync(run)");
      memcpy_blocks += run.num_blocks;
    }
    if (memcpy_blocks == num_ids) continue;
    any_skipped = any_skipped || memcpy_blocks > 0;
    kernel_segs.push_back({r.device, r.host_kernel, bb, (bb + kChunkBytes - 1) / kChunkBytes, 0,
                           min_run, vec_bytes_for(r)});
  }
  if (kernel_segs.empty()) return FKV_OK;

  // Per id, the length of its run, so the kernel can skip ids the copy engine
  // already handles for a given segment.
  const int32_t* run_len = nullptr;
  if (any_skipped) {
    std::vector<int32_t>& lens = t_run_len;
    lens.resize(num_ids);
    int64_t i = 0;
    for (const BlockRun& run : runs) {
      const int32_t n = static_cast<int32_t>(std::min<int64_t>(run.num_blocks, INT32_MAX));
      for (int64_t k = 0; k < run.num_blocks; ++k) lens[i++] = n;
    }
    run_len = lens.data();
  }

  // Split into launches that fit one staging slot: segment groups of at most half
  // a slot of descriptors, then id ranges filling the rest.
  Ring& ring = g_rings[device];
  const int32_t nk = static_cast<int32_t>(kernel_segs.size());
  const int32_t max_group = static_cast<int32_t>(kSlotBytes / 2 / sizeof(DevSegment));
  const size_t per_id = 2 * sizeof(int64_t) + (run_len ? sizeof(int32_t) : 0);
  for (int32_t g0 = 0; g0 < nk; g0 += max_group) {
    const int32_t group = std::min(max_group, nk - g0);
    const size_t room = kSlotBytes - align_up(group * sizeof(DevSegment), 16) - 3 * 16;
    const int64_t max_ids = static_cast<int64_t>(room / per_id);
    for (int64_t i0 = 0; i0 < num_ids; i0 += max_ids) {
      const int64_t count = std::min(max_ids, num_ids - i0);
      rc = launch_kernel(ring, kernel_segs.data() + g0, group, device_ids + i0, host_ids + i0,
                         run_len ? run_len + i0 : nullptr, count, h2d, stream);
      if (rc != FKV_OK) return rc;
    }
  }
  return FKV_OK;
}

}  // extern "C"
