// Paddle custom ops over the fastkv core: swap all layers, swap one layer, host
// alloc/free. The ops validate what only Paddle knows (dtype, place, shape,
// contiguity of each tensor), turn the tensors into core segments and dispatch on
// place: CPU tensors -> fkv_swap_cpu, GPU tensors -> fkv_swap_cuda on the stream
// passed as an int64 attribute (the worker's CuPy stream pointer). The core then
// validates ids and layout before touching memory.
//
// Errors are raised with a "fastkv[EINVAL]" (bad argument, nothing copied) or
// "fastkv[E<code>]" prefix so fastkv.ops.paddle_ops can map them to ValueError or
// RuntimeError.
#include <cstdint>
#include <string>
#include <vector>

#include "fastkv_core.h"
#include "paddle/extension.h"

namespace {

std::string shape_str(const paddle::Tensor& t) {
  std::string s = "[";
  const auto& d = t.dims();
  for (int i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

#define FKV_INVALID(op, ...) PD_THROW("fastkv[EINVAL] ", op, ": ", __VA_ARGS__)

// The core numbers segments from 0 within one call; the op's caller knows them as
// caches[first + k], so name them that way ("segments[1].host_base" of layer 3's
// call becomes "caches[13].host_base", i.e. host_ptrs[13]).
std::string rename_segments(const std::string& msg, size_t first) {
  static const std::string kFrom = "segments[";
  std::string out;
  size_t pos = 0;
  for (;;) {
    const size_t at = msg.find(kFrom, pos);
    if (at == std::string::npos) break;
    const size_t close = msg.find(']', at);
    if (close == std::string::npos) break;
    out.append(msg, pos, at - pos);
    const std::string digits = msg.substr(at + kFrom.size(), close - at - kFrom.size());
    if (!digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos) {
      out += "caches[" + std::to_string(first + std::stoul(digits)) + "]";
    } else {
      out.append(msg, at, close + 1 - at);
    }
    pos = close + 1;
  }
  out.append(msg, pos, std::string::npos);
  return out;
}

void check_core(const char* op, int rc, size_t first_segment = 0) {
  if (rc == FKV_OK) return;
  const std::string msg = rename_segments(fkv_last_error(), first_segment);
  if (rc == FKV_EINVAL) FKV_INVALID(op, msg);
  PD_THROW("fastkv[E", rc, "] ", op, ": ", msg);
}

void check_host_tensor(const char* op, const char* name, const paddle::Tensor& t) {
  if (!t.initialized() || !t.is_dense_tensor()) {
    FKV_INVALID(op, name, ": must be an initialized dense tensor");
  }
  if (!t.is_cpu()) {
    FKV_INVALID(op, name, ": must be a CPU tensor (ids and pointers are read on the host), got ",
                t.place().DebugString());
  }
  if (t.dtype() != paddle::DataType::INT64) {
    FKV_INVALID(op, name, ": must be int64, got ", phi::DataTypeToString(t.dtype()));
  }
  if (t.dims().size() != 1) FKV_INVALID(op, name, ": must be 1-D, got shape ", shape_str(t));
  if (!t.is_contiguous()) FKV_INVALID(op, name, ": must be contiguous");
}

struct Call {
  std::vector<fkv_segment> segments;
  size_t first = 0;  // index in caches of segments[0]
  int64_t num_device_blocks = 0;
  bool gpu = false;
};

// Segments for caches[first, first + count) with host bases host_ptrs[first, ...),
// host blocks host_stride apart (0: each tensor's own block size, a region per tensor).
void build_segments(const char* op, const std::vector<paddle::Tensor>& caches, size_t first,
                    size_t count, const paddle::Tensor& host_ptrs, int64_t host_stride,
                    Call* call) {
  check_host_tensor(op, "host_ptrs", host_ptrs);
  if (host_stride < 0) FKV_INVALID(op, "host_stride: ", host_stride, " is negative");
  if (host_ptrs.numel() != static_cast<int64_t>(caches.size())) {
    FKV_INVALID(op, "host_ptrs: length ", host_ptrs.numel(), " != number of cache tensors ",
                caches.size());
  }
  const int64_t* ptrs = host_ptrs.data<int64_t>();
  call->segments.resize(count);
  const paddle::Tensor& ref = caches[first];
  for (size_t k = 0; k < count; ++k) {
    const size_t i = first + k;
    const paddle::Tensor& t = caches[i];
    const std::string name = "caches[" + std::to_string(i) + "]";
    if (!t.initialized() || !t.is_dense_tensor()) {
      FKV_INVALID(op, name, ": must be an initialized dense tensor");
    }
    if (!t.is_cpu() && !t.is_gpu()) {
      FKV_INVALID(op, name, ": must be on CPU or GPU, got ", t.place().DebugString());
    }
    if (!(t.place() == ref.place())) {
      FKV_INVALID(op, name, ": on ", t.place().DebugString(), " but caches[", first, "] is on ",
                  ref.place().DebugString());
    }
    // Eager mode already hands us a contiguous copy of a strided input (which is
    // why paddle_ops.py rejects those before the call); other callers may not.
    if (!t.is_contiguous()) FKV_INVALID(op, name, ": must be contiguous");
    if (t.dims().size() < 1 || t.numel() == 0) {
      FKV_INVALID(op, name, ": must be a non-empty [num_blocks, ...] tensor, got shape ",
                  shape_str(t));
    }
    if (t.dims()[0] != ref.dims()[0]) {
      FKV_INVALID(op, name, ": has ", t.dims()[0], " blocks (shape ", shape_str(t), ") but caches[",
                  first, "] has ", ref.dims()[0]);
    }
    const int64_t block_bytes =
        t.numel() / t.dims()[0] * static_cast<int64_t>(phi::SizeOf(t.dtype()));
    call->segments[k] = {const_cast<void*>(t.data()), reinterpret_cast<void*>(ptrs[i]),
                         block_bytes, host_stride == 0 ? block_bytes : host_stride};
  }
  call->first = first;
  call->num_device_blocks = ref.dims()[0];
  call->gpu = ref.is_gpu();
}

void run_swap(const char* op, const Call& call, const paddle::Tensor& device_ids,
              const paddle::Tensor& host_ids, int64_t num_host_blocks, int direction,
              int64_t stream, int num_threads) {
  check_host_tensor(op, "device_ids", device_ids);
  check_host_tensor(op, "host_ids", host_ids);
  if (device_ids.numel() != host_ids.numel()) {
    FKV_INVALID(op, "host_ids: length ", host_ids.numel(), " != device_ids length ",
                device_ids.numel());
  }
  const int32_t n = static_cast<int32_t>(call.segments.size());
  if (call.gpu) {
    check_core(op, fkv_swap_cuda(call.segments.data(), n, call.num_device_blocks, num_host_blocks,
                                 device_ids.data<int64_t>(), host_ids.data<int64_t>(),
                                 device_ids.numel(), direction,
                                 reinterpret_cast<void*>(static_cast<intptr_t>(stream))),
               call.first);
  } else {
    check_core(op, fkv_swap_cpu(call.segments.data(), n, call.num_device_blocks, num_host_blocks,
                                device_ids.data<int64_t>(), host_ids.data<int64_t>(),
                                device_ids.numel(), direction, num_threads),
               call.first);
  }
}

thread_local Call t_call;

void SwapAllLayers(std::vector<paddle::Tensor>& caches, const paddle::Tensor& device_ids,
                   const paddle::Tensor& host_ids, const paddle::Tensor& host_ptrs,
                   int64_t num_host_blocks, int64_t host_stride, int direction, int64_t stream,
                   int num_threads) {
  const char* op = "fastkv_swap_all_layers";
  if (caches.empty()) FKV_INVALID(op, "caches: empty list");
  build_segments(op, caches, 0, caches.size(), host_ptrs, host_stride, &t_call);
  run_swap(op, t_call, device_ids, host_ids, num_host_blocks, direction, stream, num_threads);
}

void SwapLayer(std::vector<paddle::Tensor>& caches, const paddle::Tensor& device_ids,
               const paddle::Tensor& host_ids, const paddle::Tensor& host_ptrs, int layer,
               int tensors_per_layer, int64_t num_host_blocks, int64_t host_stride,
               int direction, int64_t stream, int num_threads) {
  const char* op = "fastkv_swap_layer";
  if (tensors_per_layer <= 0) {
    FKV_INVALID(op, "tensors_per_layer: ", tensors_per_layer, " must be > 0");
  }
  if (caches.empty() || caches.size() % tensors_per_layer != 0) {
    FKV_INVALID(op, "caches: ", caches.size(), " tensors is not a positive multiple of ",
                "tensors_per_layer=", tensors_per_layer);
  }
  const int64_t num_layers = static_cast<int64_t>(caches.size()) / tensors_per_layer;
  if (layer < 0 || layer >= num_layers) {
    FKV_INVALID(op, "layer: ", layer, " out of range [0, ", num_layers, ")");
  }
  build_segments(op, caches, static_cast<size_t>(layer) * tensors_per_layer, tensors_per_layer,
                 host_ptrs, host_stride, &t_call);
  run_swap(op, t_call, device_ids, host_ids, num_host_blocks, direction, stream, num_threads);
}

std::vector<paddle::Tensor> HostAlloc(int64_t nbytes, int numa_node, bool pin, int pin_device) {
  const char* op = "fastkv_host_alloc";
  if (nbytes <= 0) FKV_INVALID(op, "nbytes: ", nbytes, " must be > 0");
  void* p = fkv_host_alloc(static_cast<size_t>(nbytes), numa_node, pin ? 1 : 0, pin_device);
  if (p == nullptr) check_core(op, fkv_last_error_code());
  paddle::Tensor out = paddle::empty({1}, paddle::DataType::INT64, paddle::CPUPlace());
  out.data<int64_t>()[0] = static_cast<int64_t>(reinterpret_cast<intptr_t>(p));
  return {out};
}

std::vector<paddle::Tensor> HostFree(int64_t ptr, int64_t nbytes, bool pinned) {
  const char* op = "fastkv_host_free";
  if (nbytes <= 0) FKV_INVALID(op, "nbytes: ", nbytes, " must be > 0");
  check_core(op, fkv_host_free(reinterpret_cast<void*>(static_cast<intptr_t>(ptr)),
                               static_cast<size_t>(nbytes), pinned ? 1 : 0));
  paddle::Tensor out = paddle::empty({1}, paddle::DataType::INT64, paddle::CPUPlace());
  out.data<int64_t>()[0] = 0;
  return {out};
}

std::vector<std::vector<int64_t>> ScalarShape() { return {{1}}; }
std::vector<paddle::DataType> Int64Dtype() { return {paddle::DataType::INT64}; }

}  // namespace

PD_BUILD_OP(fastkv_swap_all_layers)
    .Inputs({paddle::Vec("Caches"), "DeviceIds", "HostIds", "HostPtrs"})
    .Outputs({paddle::Vec("CachesOut")})
    .Attrs({"num_host_blocks: int64_t", "host_stride: int64_t", "direction: int",
            "stream: int64_t", "num_threads: int"})
    .SetInplaceMap({{paddle::Vec("Caches"), paddle::Vec("CachesOut")}})
    .SetKernelFn(PD_KERNEL(SwapAllLayers));

PD_BUILD_OP(fastkv_swap_layer)
    .Inputs({paddle::Vec("Caches"), "DeviceIds", "HostIds", "HostPtrs"})
    .Outputs({paddle::Vec("CachesOut")})
    .Attrs({"layer: int", "tensors_per_layer: int", "num_host_blocks: int64_t",
            "host_stride: int64_t", "direction: int", "stream: int64_t", "num_threads: int"})
    .SetInplaceMap({{paddle::Vec("Caches"), paddle::Vec("CachesOut")}})
    .SetKernelFn(PD_KERNEL(SwapLayer));

PD_BUILD_OP(fastkv_host_alloc)
    .Inputs({})
    .Outputs({"Ptr"})
    .Attrs({"nbytes: int64_t", "numa_node: int", "pin: bool", "pin_device: int"})
    .SetKernelFn(PD_KERNEL(HostAlloc))
    .SetInferShapeFn(PD_INFER_SHAPE(ScalarShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Int64Dtype));

PD_BUILD_OP(fastkv_host_free)
    .Inputs({})
    .Outputs({"Status"})
    .Attrs({"ptr: int64_t", "nbytes: int64_t", "pinned: bool"})
    .SetKernelFn(PD_KERNEL(HostFree))
    .SetInferShapeFn(PD_INFER_SHAPE(ScalarShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Int64Dtype));
