// fkv_cuda_crc3way: storage's crc32c-3way checksum of device memory (PD's layer
// checksums on GPU caches). Included at the end of fkv_cuda.cu, whose helpers it
// uses (DeviceGuard, check_device_ordinal, cuda_error, sleep_us). The math, and
// each kernel thread's work, is fkv_crc32c.h's (chunk_thread, fold_thread,
// finish_segment): the CPU tests run those functions thread by thread
// (checksum_emulated) against storage's implementation.
//
// 1. crc_chunks_kernel: one thread per chunk of kCrcChunkWords words of a segment
//    (segments' chunks numbered one after another), its three lanes from state 0.
// 2. crc_fold_kernel: one block per segment; each of its kCrcThreads threads
//    folds an equal run of the segment's chunks into a partial, thread 0 folds
//    the partials from ~0: the segment's finished lanes.
// The lanes (12 bytes per segment) come back to the host, which takes their
// CRC-32C: the block checksum.
#include <sched.h>

#include <chrono>
#include <mutex>
#include <vector>

#include "fkv_crc32c.h"
#include "fkv_crc_cuda.h"

namespace fkv {
namespace {

constexpr uint64_t kCrcChunkWords = 192;  // 1536 bytes a thread; a multiple of 3
constexpr int kCrcThreads = 128;

using CrcSeg = crc::Segment;

__device__ void crc_load_table(crc::Table t) {
  for (int i = threadIdx.x; i < 256; i += blockDim.x) t[0][i] = crc::table0(i);
  __syncthreads();
  for (int s = 1; s < 8; s++) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) t[s][i] = crc::table_next(t, s, i);
    __syncthreads();
  }
}

__global__ void crc_chunks_kernel(const CrcSeg* segs, int64_t num_segs, uint64_t total,
                                  uint32_t* raw) {
  __shared__ uint32_t table[8][256];
  crc_load_table(table);
  const uint64_t g = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g < total) crc::chunk_thread(table, segs, num_segs, kCrcChunkWords, g, raw);
}

__global__ void crc_fold_kernel(const CrcSeg* segs, const uint32_t* raw, uint32_t* lanes) {
  __shared__ uint32_t part[kCrcThreads][3];
  __shared__ uint64_t len[kCrcThreads][3];
  crc::fold_thread(segs[blockIdx.x], raw, kCrcChunkWords, threadIdx.x, kCrcThreads,
                   part[threadIdx.x], len[threadIdx.x]);
  __syncthreads();
  if (threadIdx.x == 0) crc::finish_segment(part, len, kCrcThreads, lanes + 3 * blockIdx.x);
}

const crc::Table& crc_host_table() {
  static crc::Table table;
  static std::once_flag once;
  std::call_once(once, [] { crc::fill_table(table); });
  return table;
}

// Waits for `ev` until `timeout_ns` passed (yield first, then short sleeps).
int crc_wait(cudaEvent_t ev, int64_t timeout_ns) {
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::nanoseconds(timeout_ns);
  for (;;) {
    const cudaError_t err = cudaEventQuery(ev);
    if (err == cudaSuccess) return FKV_OK;
    if (err != cudaErrorNotReady) return cuda_error(err, "crc3way: cudaEventQuery");
    cudaGetLastError();
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      return set_error(FKV_ETIMEDOUT, "crc3way: not complete after %.3f s",
                       std::chrono::duration<double>(now - start).count());
    }
    if (now - start < std::chrono::microseconds(100)) {
      sched_yield();
    } else {
      sleep_us(20);
    }
  }
}

int crc_check_args(const int64_t* segments, int64_t num_segments, int64_t timeout_ns,
                   const uint32_t* out, std::vector<CrcSeg>* descs, uint64_t* total) {
  if (segments == nullptr || out == nullptr) {
    return set_error(FKV_EINVAL, "crc3way: segments and out must not be NULL");
  }
  if (num_segments < 1 || num_segments > (int64_t{1} << 24)) {
    return set_error(FKV_EINVAL, "num_segments: %lld not in [1, 2^24]",
                     static_cast<long long>(num_segments));
  }
  if (timeout_ns <= 0) {
    return set_error(FKV_EINVAL, "timeout_ns: %lld must be > 0", static_cast<long long>(timeout_ns));
  }
  descs->resize(num_segments);
  for (int64_t i = 0; i < num_segments; i++) {
    const int64_t ptr = segments[2 * i], n = segments[2 * i + 1];
    if (n < 0 || (ptr == 0 && n > 0)) {
      return set_error(FKV_EINVAL, "segments[%lld]: pointer %#llx, length %lld",
                       static_cast<long long>(i), static_cast<unsigned long long>(ptr),
                       static_cast<long long>(n));
    }
    (*descs)[i] = CrcSeg{reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(ptr)),
                         static_cast<uint64_t>(n), 0};
  }
  *total = crc::plan_segments(descs->data(), num_segments, kCrcChunkWords);
  return FKV_OK;
}

// Enqueues both kernels and the event on `s` (buf: descriptors, raw lanes, lanes).
cudaError_t crc_enqueue(cudaStream_t s, const std::vector<CrcSeg>& descs, uint64_t total,
                        char* buf, size_t desc_bytes, cudaEvent_t ev) {
  const int64_t num_segments = static_cast<int64_t>(descs.size());
  auto* d_descs = reinterpret_cast<CrcSeg*>(buf);
  auto* d_raw = reinterpret_cast<uint32_t*>(buf + desc_bytes);
  uint32_t* d_lanes = d_raw + 3 * total;
  cudaError_t err = cudaMemcpyAsync(d_descs, descs.data(), descs.size() * sizeof(CrcSeg),
                                    cudaMemcpyHostToDevice, s);
  if (err != cudaSuccess) return err;
  const uint64_t blocks = (total + kCrcThreads - 1) / kCrcThreads;
  crc_chunks_kernel<<<static_cast<unsigned>(blocks), kCrcThreads, 0, s>>>(d_descs, num_segments,
                                                                          total, d_raw);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  crc_fold_kernel<<<static_cast<unsigned>(num_segments), kCrcThreads, 0, s>>>(d_descs, d_raw,
                                                                              d_lanes);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return cudaEventRecord(ev, s);
}

}  // namespace
}  // namespace fkv

extern "C" {

FKV_API int fkv_cuda_crc3way(int device, const int64_t* segments, int64_t num_segments,
                             void* stream, int64_t timeout_ns, uint32_t* out) {
  using namespace fkv;
  std::vector<CrcSeg> descs;
  uint64_t total = 0;
  int rc = crc_check_args(segments, num_segments, timeout_ns, out, &descs, &total);
  if (rc != FKV_OK) return rc;
  if (total > (uint64_t{1} << 36)) {
    return set_error(FKV_EINVAL, "crc3way: %llu chunks, more than one launch holds",
                     static_cast<unsigned long long>(total));
  }
  rc = check_device_ordinal(device, "device");
  if (rc != FKV_OK) return rc;
  DeviceGuard guard;
  rc = guard.use(device);
  if (rc != FKV_OK) return rc;
  const auto s = static_cast<cudaStream_t>(stream);
  const size_t desc_bytes = (descs.size() * sizeof(CrcSeg) + 255) / 256 * 256;
  const size_t lanes_bytes = 12 * descs.size();
  void* buf = nullptr;
  FKV_CUDA_TRY(cudaMallocAsync(&buf, desc_bytes + 12 * total + lanes_bytes, s));
  cudaEvent_t ev = nullptr;
  cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (err == cudaSuccess) err = crc_enqueue(s, descs, total, static_cast<char*>(buf), desc_bytes, ev);
  if (err != cudaSuccess) {
    cudaFreeAsync(buf, s);
    if (ev != nullptr) cudaEventDestroy(ev);
    return cuda_error(err, "crc3way: enqueue");
  }
  rc = crc_wait(ev, timeout_ns);
  std::vector<uint32_t> lanes(3 * descs.size());
  if (rc == FKV_OK) {  // the kernels are done: this copy does not wait for them
    const char* d_lanes = static_cast<const char*>(buf) + desc_bytes + 12 * total;
    err = cudaMemcpyAsync(lanes.data(), d_lanes, lanes_bytes, cudaMemcpyDeviceToHost, s);
    if (err == cudaSuccess) err = cudaStreamSynchronize(s);
    if (err != cudaSuccess) rc = cuda_error(err, "crc3way: copying the lanes back");
  }
  // Stream-ordered: after a timeout the kernels finish, then the buffer goes.
  cudaFreeAsync(buf, s);
  cudaEventDestroy(ev);
  if (rc != FKV_OK) return rc;
  *out = crc::checksum_of_lanes(crc_host_table(), lanes.data(), num_segments);
  return FKV_OK;
}

}  // extern "C"
