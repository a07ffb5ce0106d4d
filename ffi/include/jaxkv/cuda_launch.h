// Launch helpers shared by the CUDA handlers.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "jaxkv/common.h"

// Traits of every CUDA handler. kCmdBufferCompatible lets XLA record the call into a CUDA graph
// (command buffer); -DJAXKV_CMD_BUFFER=0 leaves it out, to measure what that costs or saves.
#ifndef JAXKV_CMD_BUFFER
#define JAXKV_CMD_BUFFER 1
#endif
#if JAXKV_CMD_BUFFER
#define JAXKV_CUDA_TRAITS {ffi::Traits::kCmdBufferCompatible}
#else
#define JAXKV_CUDA_TRAITS {}
#endif

namespace jaxkv {

// Error after a launch (or any runtime call), as an ffi::Error naming the op.
inline ffi::Error cuda_status(const char* op, cudaError_t err = cudaGetLastError()) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) + ": CUDA error: " + cudaGetErrorString(err));
}

// Multiprocessors of the current device, read once per device (atomics: XLA may call handlers
// from several threads; two that both read the attribute store the same value).
inline int multiprocessor_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};
  int device = 0;
  cudaGetDevice(&device);
  std::atomic<int>& slot = cached[device % kMaxDevices];
  int sms = slot.load(std::memory_order_relaxed);
  if (sms == 0 && cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess)
    slot.store(sms, std::memory_order_relaxed);
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
// H200 (tools/probes/copy_variants.cu): +3-7% over plain accesses for span copies of 32 MiB to 1 GiB.
// Layer of a work unit when the units of layer l are [first_unit[l], first_unit[l + 1]): the
// last l with first_unit[l] <= unit (binary search; layers differ in size).
__device__ __forceinline__ int layer_of_unit(const int64_t* first_unit, int num_layers, int64_t unit) {
  int lo = 0, hi = num_layers - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_unit[mid] <= unit) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <class W>
__device__ __forceinline__ W load_word(const W* p) { return __ldg(p); }
template <class W>
__device__ __forceinline__ void store_word(W* p, const W& v) { __stcs(p, v); }

}  // namespace jaxkv
