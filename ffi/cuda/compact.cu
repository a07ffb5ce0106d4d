// CUDA handler of the compaction family: every layer of every shape in one persistent launch.
//
// Each block builds the move schedule in shared memory (the mapping is small), then takes work
// units (layer, head span, chunk of the span) in a grid-stride loop. For its chunk a thread walks
// every chain and cycle of the schedule, carrying kUnroll 16-byte words per step, and touches only
// bytes that are live tokens of the row they come from.
#include <algorithm>

#include "jaxkv/compact.h"
#include "jaxkv/cuda_launch.h"
#include "jaxkv/move_schedule.h"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // independent words in flight per thread per step

struct CompactParams {
  LayerSpan layers[kMaxLayers];
  int64_t first_unit[kMaxLayers + 1];  // work units of layer l are [first_unit[l], first_unit[l+1])
  int32_t num_layers;
  const int32_t* mapping;  // [n_old]
  int32_t n_old;
  int32_t rows;
  const int32_t* lengths;  // [rows], or null: every byte is live
  int32_t* new_lengths;    // [rows], or null
};

__host__ __device__ inline int64_t units_per_head(const LayerSpan& l) {
  const int64_t words = l.head_stride / vector_width(l.token_bytes);
  return (words + kThreads * kUnroll - 1) / (kThreads * kUnroll);
}

template <int kBytes>
struct Carry {
  typename Word<kBytes>::type w[kUnroll];
};

// Moves one chunk of one head span of one layer along every chain and cycle.
template <int kBytes>
__device__ void move_chunk(const CompactParams& p, const MoveSchedule& s, const LayerSpan& l,
                           int64_t unit) {
  using W = typename Word<kBytes>::type;
  const int64_t per_head = units_per_head(l);
  const int64_t h = unit / per_head;
  const int64_t chunk = unit % per_head;
  const int64_t span_words = l.head_stride / kBytes;
  const int64_t first = chunk * kThreads * kUnroll + threadIdx.x;
  auto live_words = [&](int32_t row) -> int64_t {
    if (!p.lengths) return span_words;
    const int64_t len = min(max(__ldg(p.lengths + row), 0), l.capacity);
    return len * l.token_bytes / kBytes;
  };
  auto words = [&](int32_t row) {
    return reinterpret_cast<W*>(l.base + row * l.row_stride + h * l.head_stride);
  };
  const int32_t num_starts = *s.num_starts;
  for (int32_t k = 0; k < num_starts; ++k) {
    auto load = [&](int32_t row) {
      Carry<kBytes> c;
      const int64_t live = live_words(row);
      const W* src = words(row);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = first + u * kThreads;
        if (i < live) c.w[u] = src[i];
      }
      return c;
    };
    auto store = [&](int32_t row, const Carry<kBytes>& c, int32_t from) {
      const int64_t live = live_words(from);
      W* dst = words(row);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = first + u * kThreads;
        if (i < live) store_word(dst + i, c.w[u]);
      }
    };
    walk_moves<Carry<kBytes>>(s, s.starts[k], load, store);
  }
}

__global__ void __launch_bounds__(kThreads) compact_kernel(const __grid_constant__ CompactParams p) {
  extern __shared__ int32_t smem[];
  __shared__ int32_t num_starts;
  MoveSchedule s{p.mapping, p.n_old, p.rows, smem, smem + p.rows, smem + p.rows + p.n_old,
                 &num_starts};
  auto* visited = reinterpret_cast<uint8_t*>(smem + p.rows + 2 * p.n_old);
  build_schedule(
      s, visited, threadIdx.x, blockDim.x, [] { __syncthreads(); },
      [](int32_t* a, int32_t v) { atomicMin(a, v); },
      [&](int32_t r) { s.starts[atomicAdd(&num_starts, 1)] = r; });

  if (blockIdx.x == 0 && p.new_lengths) {
    for (int32_t r = threadIdx.x; r < p.rows; r += blockDim.x)
      p.new_lengths[r] = schedule_new_length(s, p.lengths, r);
  }
  if (num_starts == 0) return;

  const int64_t total = p.first_unit[p.num_layers];
  for (int64_t unit = blockIdx.x; unit < total; unit += gridDim.x) {
    const int layer = layer_of_unit(p.first_unit, p.num_layers, unit);
    const LayerSpan& l = p.layers[layer];
    const int64_t local = unit - p.first_unit[layer];
    switch (vector_width(l.token_bytes)) {
      case 16: move_chunk<16>(p, s, l, local); break;
      case 8: move_chunk<8>(p, s, l, local); break;
      case 4: move_chunk<4>(p, s, l, local); break;
      case 2: move_chunk<2>(p, s, l, local); break;
      default: move_chunk<1>(p, s, l, local); break;
    }
  }
}

ffi::Error compact_cuda(cudaStream_t stream, ffi::Buffer<ffi::S32> mapping,
                        ffi::Buffer<ffi::S32> lengths, ffi::RemainingArgs,
                        ffi::Result<ffi::Buffer<ffi::S32>> new_lengths, ffi::RemainingRets layers,
                        bool kv, int64_t rows) {
  CompactParams p;
  auto args = check_compact(mapping, lengths, new_lengths, layers, kv, rows, p.layers);
  if (args.has_error()) return args.error();
  p.num_layers = args->num_layers;
  p.mapping = mapping.typed_data();
  p.n_old = args->n_old;
  p.rows = args->rows;
  p.lengths = args->has_lengths ? lengths.typed_data() : nullptr;
  p.new_lengths = args->has_lengths ? new_lengths->typed_data() : nullptr;
  p.first_unit[0] = 0;
  for (int l = 0; l < p.num_layers; ++l)
    p.first_unit[l + 1] = p.first_unit[l] + p.layers[l].heads * units_per_head(p.layers[l]);

  const size_t smem = sizeof(int32_t) * (p.rows + 2 * p.n_old) + p.n_old;
  cudaFuncSetAttribute(compact_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       static_cast<int>(smem));
  const int64_t fill = persistent_blocks(reinterpret_cast<const void*>(compact_kernel), kThreads, smem);
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min(fill, p.first_unit[p.num_layers])));
  compact_kernel<<<blocks, kThreads, smem, stream>>>(p);
  return cuda_status("compact");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_compact_cuda, NoThrow<compact_cuda>::call,
                              bind_compact(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              JAXKV_CUDA_TRAITS);
JAXKV_REGISTER_TARGET("jaxkv_compact", "CUDA", jaxkv_compact_cuda);

}  // namespace jaxkv
