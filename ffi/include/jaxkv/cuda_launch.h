// Launch helpers shared by the CUDA handlers.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "jaxkv/common.h"

namespace jaxkv {

// Error after a launch (or any runtime call), as an ffi::Error naming the op.
inline ffi::Error cuda_status(const char* op, cudaError_t err = cudaGetLastError()) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) + ": CUDA error: " + cudaGetErrorString(err));
}

// Multiprocessors of the current device, read once per device.
inline int multiprocessor_count() {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  int device = 0;
  cudaGetDevice(&device);
  int& sms = cached[device % kMaxDevices];
  if (sms == 0) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms;
}

// Blocks for a persistent grid: enough resident blocks to fill every multiprocessor once.
inline int persistent_blocks(const void* kernel, int threads, size_t smem) {
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
  return multiprocessor_count() * (per_sm > 0 ? per_sm : 1);
}

// Raw 16/8/4/2/1-byte words: the kernels move bytes, whatever the dtype.
template <int kBytes> struct Word;
template <> struct Word<16> { using type = uint4; };
template <> struct Word<8> { using type = uint2; };
template <> struct Word<4> { using type = uint32_t; };
template <> struct Word<2> { using type = uint16_t; };
template <> struct Word<1> { using type = uint8_t; };

// Loads through the read-only path and stores that stream past L2 (evict-first): every kernel here
// writes its destination once and never reads it back, while a source may be read again (one
// prompt instantiated into many slots), so only the stores are marked streaming. Measured on the
// H200 (tools/copy_variants.cu): +3-7% over plain accesses for span copies of 32 MiB to 1 GiB.
template <class W>
__device__ __forceinline__ W load_word(const W* p) { return __ldg(p); }
template <class W>
__device__ __forceinline__ void store_word(W* p, const W& v) { __stcs(p, v); }

}  // namespace jaxkv
