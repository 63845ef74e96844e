// The crc32c-3way checksum of device memory (fkv_crc_cuda.cuh; a stub without CUDA).
#ifndef FKV_CRC_CUDA_H_
#define FKV_CRC_CUDA_H_

#include <stdint.h>

#include "fastkv_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The crc32c-3way checksum (fkv_crc32c.h) of `num_segments` (pointer, length)
 * int64 pairs in `segments` (host memory), each pointer into memory of CUDA
 * device `device`: the value storage's block_checksum gives for the same bytes.
 * The work runs on `stream` (a cudaStream_t; the caller orders it after whatever
 * wrote the bytes); the calling thread waits at most `timeout_ns` for it
 * (FKV_ETIMEDOUT past it; the work then finishes and frees itself in the
 * background). FKV_EINVAL for a bad argument, FKV_ECUDA for a CUDA error,
 * FKV_ENOTBUILT without CUDA; the checksum goes to *out on FKV_OK only. */
FKV_API int fkv_cuda_crc3way(int device, const int64_t* segments, int64_t num_segments,
                             void* stream, int64_t timeout_ns, uint32_t* out);

#ifdef __cplusplus
}
#endif

#endif /* FKV_CRC_CUDA_H_ */
