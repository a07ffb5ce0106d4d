// CUDA handler of the linear-cache append: one warp per (row, K/V, head) span and chunk.
//
// grid.y covers spans kWarps at a time, grid.x chunks of a span (kUnroll words per lane in
// flight). Decode (T = 1) is a single chunk per span; prefill spreads each span over many blocks.
#include <algorithm>

#include "jaxkv/append.h"
#include "jaxkv/cuda_launch.h"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

constexpr int kWarps = 8;
constexpr int kUnroll = 4;
constexpr int kChunkWords = 32 * kUnroll;

template <int kBytes>
__device__ __forceinline__ void copy_chunk(const AppendSpan& s, int64_t chunk, int lane) {
  using W = typename Word<kBytes>::type;
  const int64_t words = s.bytes / kBytes;
  const W* src = reinterpret_cast<const W*>(s.src);
  W* dst = reinterpret_cast<W*>(s.dst);
  W buf[kUnroll];
  const int64_t first = chunk * kChunkWords + lane;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = first + u * 32;
    if (i < words) buf[u] = load_word(src + i);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = first + u * 32;
    if (i < words) store_word(dst + i, buf[u]);
  }
}

// Chunk `chunk` of span `span` (nothing past the spans or past the span's bytes).
__device__ __forceinline__ void append_at(const AppendParams& p, int width, int64_t span,
                                          int64_t chunk) {
  if (span >= p.spans()) return;
  const AppendSpan s = append_span(p, span);
  if (chunk * kChunkWords * width >= s.bytes) return;
  const int lane = threadIdx.x % 32;
  switch (width) {
    case 16: copy_chunk<16>(s, chunk, lane); break;
    case 8: copy_chunk<8>(s, chunk, lane); break;
    case 4: copy_chunk<4>(s, chunk, lane); break;
    case 2: copy_chunk<2>(s, chunk, lane); break;
    default: copy_chunk<1>(s, chunk, lane); break;
  }
}

// One block per (chunk, kWarps spans): the launch every batch that fits the grid takes.
__global__ void __launch_bounds__(kWarps * 32) append_kernel(const AppendParams p, int width) {
  append_at(p, width, int64_t{blockIdx.y} * kWarps + threadIdx.x / 32, blockIdx.x);
}

// Grid-stride over both axes, for a batch past the grid limits (grid.y is at most 65535: 8192
// rows with 32 heads need a second pass), so the handler never refuses a call after its cache was
// donated. A separate kernel: the loops would cost the common launch half as much again on a
// decode step (docs/perf-notes.md).
__global__ void __launch_bounds__(kWarps * 32)
    append_kernel_strided(const AppendParams p, int width, int64_t span_groups, int64_t chunks) {
  for (int64_t group = blockIdx.y; group < span_groups; group += gridDim.y)
    for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x)
      append_at(p, width, group * kWarps + threadIdx.x / 32, chunk);
}

ffi::Error append_cuda(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> new_lengths,
                       ffi::Buffer<ffi::S32> active, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer,
                       ffi::Result<ffi::AnyBuffer> cache, bool ring) {
  auto p = make_append_params(k, v, lengths, new_lengths, active, layer, cache, ring);
  if (p.has_error()) return p.error();
  const int width = vector_width(p->token_bytes);
  const int64_t span_words = int64_t{p->tokens} * p->token_bytes / width;
  const int64_t chunks = (span_words + kChunkWords - 1) / kChunkWords;
  const int64_t span_groups = (p->spans() + kWarps - 1) / kWarps;
  if (chunks == 0 || span_groups == 0) return ffi::Error::Success();
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(chunks, 0x7fffffff)),
                  static_cast<unsigned>(std::min<int64_t>(span_groups, 65535)));
  if (span_groups <= 65535 && chunks <= 0x7fffffff)
    append_kernel<<<grid, kWarps * 32, 0, stream>>>(*p, width);
  else
    append_kernel_strided<<<grid, kWarps * 32, 0, stream>>>(*p, width, span_groups, chunks);
  return cuda_status("append");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_append_cuda, NoThrow<append_cuda>::call,
                              bind_append(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              JAXKV_CUDA_TRAITS);
JAXKV_REGISTER_TARGET("jaxkv_append", "CUDA", jaxkv_append_cuda);

}  // namespace jaxkv
