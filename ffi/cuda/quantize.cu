// CUDA handlers of the quantizing appends (dense and paged): one warp per (layer, row, K/V, head,
// token) vector. The lanes read the head_dim values, reduce max |x| with shuffles, lane 0 writes the
// scale, and each lane writes its bytes: one pass over the input, no temporary. For head_dim 32 to
// 256 (a multiple of 32) the kernel is compiled per input and cache format, each lane reading and
// writing head_dim / 32 contiguous values in one access; other sizes take the generic kernel.
#include <algorithm>

#include "jaxkv/cuda_launch.h"
#include "jaxkv/quantize.h"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

constexpr int kWarps = 8;
constexpr int kMaxValuesPerLane = 8;  // head_dim <= 256 (the Python side checks)

__global__ void __launch_bounds__(kWarps * 32) quantize_kernel(const QuantAppend p) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  for (int64_t i = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; i < p.vectors(); i += warps) {
    QuantTarget t;
    const VectorIndex at = vector_index(p, i);
    if (!quant_target(p, at, row_facts(p, at.b), &t)) continue;  // the same for every lane
    float x[kMaxValuesPerLane];
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxValuesPerLane; ++j) {
      const int d = lane + 32 * j;
      x[j] = d < p.head_dim ? load_float(t.src, d, p.input) : 0.f;
      amax = fmaxf(amax, fabsf(x[j]));
    }
    float s = t.given;
    if (t.scale) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      s = amax / format_max(p.format);
      if (lane == 0) *t.scale = s;
    }
#pragma unroll
    for (int j = 0; j < kMaxValuesPerLane; ++j) {
      const int d = lane + 32 * j;
      if (d < p.head_dim) t.dst[d] = static_cast<char>(quantize_value(x[j], s, p.format));
    }
  }
}

// The specialized kernel: kPer = head_dim / 32 contiguous values per lane, formats fixed.
template <Format kIn, Format kOut, int kPer>
__global__ void __launch_bounds__(kWarps * 32)
    quantize_kernel_fixed(const QuantAppend p, const VectorDivs divs) {
  constexpr int kInBytes = kIn == Format::kF32 ? 4 : 2;
  constexpr int kLaneBytes = kPer * kInBytes;  // up to 32: two 16-byte words
  constexpr int kWords = kLaneBytes > 16 ? kLaneBytes / 16 : 1;
  using In = typename Word<kLaneBytes / kWords>::type;
  using Out = typename Word<kPer>::type;
  const int lane = threadIdx.x % 32;
  const uint32_t vectors = static_cast<uint32_t>(p.vectors());
  const uint32_t warps = gridDim.x * kWarps;
  for (uint32_t i = blockIdx.x * kWarps + threadIdx.x / 32; i < vectors; i += warps) {
    // Every load that depends on nothing goes first: the values and the row's metadata, in
    // flight together; only the page-table entry waits (on the length).
    const VectorIndex at = vector_index(divs, i);
    const In* src = reinterpret_cast<const In*>(quant_source(p, at)) + lane * kWords;
    In words[kWords];
#pragma unroll
    for (int w = 0; w < kWords; ++w) words[w] = load_word(src + w);
    const RowFacts row{__ldg(p.layer), __ldg(p.lengths + at.b),
                       p.counts ? __ldg(p.counts + at.b) : p.tokens,
                       p.active ? __ldg(p.active) : p.batch};
    QuantTarget t;
    if (!quant_target(p, at, row, &t)) continue;
    float x[kPer];
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      x[j] = load_float(reinterpret_cast<const char*>(words), j, kIn);
      amax = fmaxf(amax, fabsf(x[j]));
    }
    float s = t.given;
    if (t.scale) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      s = amax / format_max(kOut);
      if (lane == 0) *t.scale = s;
    }
    Out out;
    uint8_t* bytes = reinterpret_cast<uint8_t*>(&out);
#pragma unroll
    for (int j = 0; j < kPer; ++j) bytes[j] = quantize_value(x[j], s, kOut);
    reinterpret_cast<Out*>(t.dst)[lane] = out;
  }
}

template <Format kIn, Format kOut>
bool launch_fixed(cudaStream_t stream, const QuantAppend& p, unsigned grid, const VectorDivs& d) {
  switch (p.head_dim) {
    case 32: quantize_kernel_fixed<kIn, kOut, 1><<<grid, kWarps * 32, 0, stream>>>(p, d); return true;
    case 64: quantize_kernel_fixed<kIn, kOut, 2><<<grid, kWarps * 32, 0, stream>>>(p, d); return true;
    case 128: quantize_kernel_fixed<kIn, kOut, 4><<<grid, kWarps * 32, 0, stream>>>(p, d); return true;
    case 256: quantize_kernel_fixed<kIn, kOut, 8><<<grid, kWarps * 32, 0, stream>>>(p, d); return true;
    default: return false;
  }
}

template <Format kIn>
bool launch_in(cudaStream_t stream, const QuantAppend& p, unsigned grid, const VectorDivs& d) {
  switch (p.format) {
    case Format::kE4M3: return launch_fixed<kIn, Format::kE4M3>(stream, p, grid, d);
    case Format::kE5M2: return launch_fixed<kIn, Format::kE5M2>(stream, p, grid, d);
    default: return launch_fixed<kIn, Format::kS8>(stream, p, grid, d);
  }
}

ffi::Error launch(cudaStream_t stream, const QuantAppend& p, const char* op) {
  if (p.head_dim > 32 * kMaxValuesPerLane) return invalid(op, "head_dim above 256");
  const int64_t blocks = (p.vectors() + kWarps - 1) / kWarps;
  if (blocks == 0) return ffi::Error::Success();
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(blocks, 1 << 20));
  if (p.vectors() < (int64_t{1} << 31)) {
    const VectorDivs d{FastDiv(static_cast<uint32_t>(p.tokens)), FastDiv(static_cast<uint32_t>(p.heads)),
                       FastDiv(static_cast<uint32_t>(p.batch))};
    bool done = false;
    switch (p.input) {
      case Format::kF32: done = launch_in<Format::kF32>(stream, p, grid, d); break;
      case Format::kBF16: done = launch_in<Format::kBF16>(stream, p, grid, d); break;
      default: done = launch_in<Format::kF16>(stream, p, grid, d); break;
    }
    if (done) return cuda_status(op);
  }
  quantize_kernel<<<grid, kWarps * 32, 0, stream>>>(p);
  return cuda_status(op);
}

ffi::Error append_quantized_cuda(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                 ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> counts,
                                 ffi::Buffer<ffi::S32> active, ffi::Buffer<ffi::S32> layer,
                                 ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                                 ffi::Result<ffi::AnyBuffer> cache,
                                 ffi::Result<ffi::AnyBuffer> k_scales,
                                 ffi::Result<ffi::AnyBuffer> v_scales, bool per_token) {
  auto p = make_quant_append("append_quantized", 0, k, v, nullptr, lengths, counts, &active, layer,
                             *cache, *cache, *k_scales, *v_scales, per_token);
  if (p.has_error()) return p.error();
  return launch(stream, *p, "append_quantized");
}

ffi::Error paged_append_quantized_cuda(
    cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> table,
    ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> layer,
    ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
    ffi::Result<ffi::AnyBuffer> k_pages, ffi::Result<ffi::AnyBuffer> v_pages,
    ffi::Result<ffi::AnyBuffer> k_scales, ffi::Result<ffi::AnyBuffer> v_scales, bool per_token,
    bool nhd) {
  auto p = make_quant_append("paged_append_quantized", nhd ? 2 : 1, k, v, &table, lengths, counts,
                             nullptr, layer, *k_pages, *v_pages, *k_scales, *v_scales, per_token);
  if (p.has_error()) return p.error();
  return launch(stream, *p, "paged_append_quantized");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxkv_append_quantized_cuda, append_quantized_cuda,
    bind_append_quantized(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    JAXKV_CUDA_TRAITS);
JAXKV_REGISTER_TARGET("jaxkv_append_quantized", "CUDA", jaxkv_append_quantized_cuda);
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxkv_paged_append_quantized_cuda, paged_append_quantized_cuda,
    bind_paged_append_quantized(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    JAXKV_CUDA_TRAITS);
JAXKV_REGISTER_TARGET("jaxkv_paged_append_quantized", "CUDA", jaxkv_paged_append_quantized_cuda);

}  // namespace jaxkv
