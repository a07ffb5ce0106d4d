// Page transfers between the device pools and the host pool (pinned host memory, reached by the
// kernel through unified addressing): every page and layer of a call in one launch, with the page
// ids read on the device, so no host round trip and no per-page copy.
//
// With `overlap`, the transfer runs on a side stream of jaxkv's own, after the work queued
// before it, and the call returns at once: the compute stream goes on with the next kernels while
// the pages move, and "jaxkv_host_fence" later makes it wait for every transfer started. The
// caller must not touch the pages in flight (nor the host pool) before that fence: the paged
// cache holds them (docs/host-tier.md). The page ids are XLA temporaries that may be reused once
// the call returns, so they are first copied, on the compute stream, into a buffer of jaxkv's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "jaxkv/cuda_launch.h"
#include "jaxkv/host_pages.h"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 8;  // words a thread in flight (16 or 32 measured no faster a block)

// The units up to the last live pair: each block finds it (a read of the pair ids, 8 KiB a
// block for 1024 pairs), so that a call padded far past its live pairs costs no loop over them.
__device__ int64_t live_units(const HostTransfer& t) {
  __shared__ int last;
  if (threadIdx.x == 0) last = -1;
  __syncthreads();
  int mine = -1;
  for (int i = threadIdx.x; i < t.pairs; i += kThreads) {
    if (t.live(i)) mine = i;
  }
  for (int s = 16; s > 0; s /= 2) mine = max(mine, __shfl_xor_sync(0xffffffffu, mine, s));
  if (threadIdx.x % 32 == 0 && mine >= 0) atomicMax(&last, mine);
  __syncthreads();
  return t.units_of(last + 1);
}

template <int kBytes>
__global__ void __launch_bounds__(kThreads) host_transfer_kernel(const HostTransfer t) {
  using W = typename Word<kBytes>::type;
  const int64_t words = t.inner_bytes / kBytes;
  const int64_t units = live_units(t);
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    char *device, *host;
    if (!t.unit(u, &device, &host)) continue;
    const W* from = reinterpret_cast<const W*>(t.to_host ? device : host);
    W* to = reinterpret_cast<W*>(t.to_host ? host : device);
    for (int64_t w = threadIdx.x; w < words; w += int64_t{kThreads} * kUnroll) {
      W buf[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t i = w + j * kThreads;
        if (i < words) buf[j] = from[i];
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t i = w + j * kThreads;
        if (i < words) to[i] = buf[j];
      }
    }
  }
}

// Blocks of a launch: JAXKV_HOST_COPY_BLOCKS when set (to measure), else enough to keep PCIe
// busy alone (2 per multiprocessor), or as few as reach the bandwidth beside compute: a block
// moves ~25 GB/s to the host and ~12 GB/s from it, whatever its depth (Hopper's bulk copies,
// 64-192 KiB in flight a block, move the same: perf notes item 55), and slows a kernel beside
// it. H100, 2026-11-26, a 2 GiB swap beside a decode longer than it: to the host, 2 blocks
// kept 94% of the decode's speed at 51 GB/s (4: 81%); from it, 4 blocks kept 89-91% at 47-50
// GB/s (2: 25 GB/s; 8: 85%; 16: 82%; 64: 65%).
int transfer_blocks(const HostTransfer& t, bool overlap) {
  static const int forced = [] {
    const char* s = std::getenv("JAXKV_HOST_COPY_BLOCKS");
    return s ? std::atoi(s) : 0;
  }();
  const int beside = t.to_host ? 2 : 4;
  const int64_t want = forced > 0 ? forced : overlap ? beside : 2 * multiprocessor_count();
  return static_cast<int>(std::max<int64_t>(1, std::min(t.units(), want)));
}

cudaError_t launch(const HostTransfer& t, bool overlap, cudaStream_t stream) {
  const int blocks = transfer_blocks(t, overlap);
  switch (vector_width(t.inner_bytes)) {
    case 16: host_transfer_kernel<16><<<blocks, kThreads, 0, stream>>>(t); break;
    case 8: host_transfer_kernel<8><<<blocks, kThreads, 0, stream>>>(t); break;
    case 4: host_transfer_kernel<4><<<blocks, kThreads, 0, stream>>>(t); break;
    case 2: host_transfer_kernel<2><<<blocks, kThreads, 0, stream>>>(t); break;
    default: host_transfer_kernel<1><<<blocks, kThreads, 0, stream>>>(t); break;
  }
  return cudaGetLastError();
}

// One device's side stream: the transfers started with `overlap`, in order, and the page ids
// each reads (a ring of buffers, so that starting one waits at most for the transfer kSlots
// before it, not for the last).
struct SideStream {
  static constexpr int kSlots = 4;
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;  // the compute stream's work before a transfer
  cudaEvent_t done = nullptr;   // the last transfer started
  cudaEvent_t slot_done[kSlots] = {};
  int32_t* ids[kSlots] = {};
  int64_t capacity[kSlots] = {};
  int next = 0;
  std::mutex mutex;
};

SideStream& side_stream() {
  constexpr int kMaxDevices = 64;
  static SideStream streams[kMaxDevices];
  int device = 0;
  cudaGetDevice(&device);
  return streams[device % kMaxDevices];
}

// The stream and events, created together: published only when all exist.
cudaError_t create(SideStream& s) {
  cudaStream_t stream;
  cudaEvent_t events[2 + SideStream::kSlots];
  cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (err) return err;
  for (int i = 0; i < 2 + SideStream::kSlots; ++i) {
    if ((err = cudaEventCreateWithFlags(&events[i], cudaEventDisableTiming))) {
      while (i--) cudaEventDestroy(events[i]);
      cudaStreamDestroy(stream);
      return err;
    }
  }
  s.ready = events[0];
  s.done = events[1];
  for (int i = 0; i < SideStream::kSlots; ++i) s.slot_done[i] = events[2 + i];
  s.stream = stream;
  return cudaSuccess;
}

cudaError_t start_on_side(HostTransfer t, cudaStream_t compute) {
  SideStream& s = side_stream();
  std::lock_guard<std::mutex> lock(s.mutex);
  cudaError_t err = cudaSuccess;
  if (s.stream == nullptr && (err = create(s))) return err;
  const int slot = s.next;
  s.next = (s.next + 1) % SideStream::kSlots;
  // The transfer kSlots ago has read its ids before this one overwrites them.
  if ((err = cudaStreamWaitEvent(compute, s.slot_done[slot], 0))) return err;
  const int64_t need = std::max<int64_t>(1, 2 * int64_t{t.pairs});
  if (s.capacity[slot] < need) {  // stream-ordered: nothing blocks the host
    if (s.ids[slot] && (err = cudaFreeAsync(s.ids[slot], s.stream))) return err;
    s.ids[slot] = nullptr;
    s.capacity[slot] = 0;
    if ((err = cudaMallocAsync(&s.ids[slot], need * sizeof(int32_t), compute))) return err;
    s.capacity[slot] = need;
  }
  int32_t* src = s.ids[slot];
  int32_t* dst = src + t.pairs;
  const size_t bytes = t.pairs * sizeof(int32_t);
  if ((err = cudaMemcpyAsync(src, t.src, bytes, cudaMemcpyDeviceToDevice, compute))) return err;
  if ((err = cudaMemcpyAsync(dst, t.dst, bytes, cudaMemcpyDeviceToDevice, compute))) return err;
  t.src = src;
  t.dst = dst;
  if ((err = cudaEventRecord(s.ready, compute))) return err;
  if ((err = cudaStreamWaitEvent(s.stream, s.ready, 0))) return err;
  if ((err = launch(t, true, s.stream))) return err;
  if ((err = cudaEventRecord(s.slot_done[slot], s.stream))) return err;
  return cudaEventRecord(s.done, s.stream);
}

ffi::Error transfer(const char* op, const ffi::ErrorOr<HostTransfer>& t, bool overlap,
                    cudaStream_t stream) {
  if (t.has_error()) return t.error();
  if (t->units() == 0 || t->inner_bytes == 0) return ffi::Error::Success();
  if (t->units() > (int64_t{1} << 40)) return invalid(op, "too many pages for one launch");
  return cuda_status(op, overlap ? start_on_side(*t, stream) : launch(*t, false, stream));
}

ffi::Error pages_to_host_cuda(cudaStream_t stream, ffi::Buffer<ffi::S32> src,
                              ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> host, int64_t axis,
                              bool overlap) {
  constexpr const char* op = "pages_to_host";
  return transfer(op, make_host_transfer(op, src, dst, k, v, *host, axis, true), overlap, stream);
}

ffi::Error pages_from_host_cuda(cudaStream_t stream, ffi::Buffer<ffi::S32> src,
                                ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer host, ffi::AnyBuffer,
                                ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> k,
                                ffi::Result<ffi::AnyBuffer> v, int64_t axis, bool overlap) {
  constexpr const char* op = "pages_from_host";
  return transfer(op, make_host_transfer(op, src, dst, *k, *v, host, axis, false), overlap,
                  stream);
}

// The compute stream waits for every transfer started with `overlap` (its operands pass through,
// aliased, to order it among XLA's ops).
ffi::Error host_fence_cuda(cudaStream_t stream, ffi::RemainingArgs, ffi::RemainingRets) {
  SideStream& s = side_stream();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.done == nullptr) return ffi::Error::Success();
  return cuda_status("host_fence", cudaStreamWaitEvent(stream, s.done, 0));
}

}  // namespace

// Not marked command-buffer compatible: a CUDA graph would capture the side stream's work into
// the graph and serialize it with the compute.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxkv_pages_to_host_cuda, NoThrow<pages_to_host_cuda>::call,
    bind_pages_to_host(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxkv_pages_from_host_cuda, NoThrow<pages_from_host_cuda>::call,
    bind_pages_from_host(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_host_fence_cuda, NoThrow<host_fence_cuda>::call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets());
JAXKV_REGISTER_TARGET("jaxkv_pages_to_host", "CUDA", jaxkv_pages_to_host_cuda);
JAXKV_REGISTER_TARGET("jaxkv_pages_from_host", "CUDA", jaxkv_pages_from_host_cuda);
JAXKV_REGISTER_TARGET("jaxkv_host_fence", "CUDA", jaxkv_host_fence_cuda);

}  // namespace jaxkv
