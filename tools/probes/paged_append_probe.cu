// Paged append under different block geometries (H200 probe, not part of the build): the cases of
// (decode: one token per row; prefill: 5000 ragged tokens), each geometry launched a few
// times. Time each launch with ncu, not with this program's clock:
//   inc=ffi/third_party
//   nvcc -std=c++17 -O3 -arch=sm_90 -I ffi/include -I $inc tools/probes/paged_append_probe.cu -o /tmp/probe
//   ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum /tmp/probe
// The program prints, per launch in order, the case and geometry, so ncu's rows can be matched.
#include <cstdio>
#include <vector>

#include "../../ffi/cuda/paged.cu"

namespace {

using jaxkv::MoveGeometry;
using jaxkv::TokenMove;

struct Case {
  const char* name;
  int batch, tokens, heads, page, total;  // total: tokens appended over all rows
  bool nhd;
};

template <class T>
T* device(const std::vector<T>& host) {
  T* p = nullptr;
  cudaMalloc(&p, host.size() * sizeof(T));
  cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return p;
}

void run(const Case& c, std::vector<MoveGeometry> geometries) {
  constexpr int kHeadDim = 128, kElem = 2, kLaunches = 5;
  const int token_bytes = kHeadDim * kElem;
  // Ragged counts that sum to `total`; lengths (the prefix already cached) vary too.
  std::vector<int32_t> counts(c.batch), lengths(c.batch);
  int left = c.total;
  for (int b = 0; b < c.batch; ++b) {
    counts[b] = c.tokens == 1 ? 1  // decode: one token per row
                : b + 1 == c.batch ? left : std::min(left, c.tokens / 2 + (b * 97) % (c.tokens / 2 + 1));
    counts[b] = std::min(counts[b], c.tokens);
    left -= counts[b];
    lengths[b] = (b * 37) % 512;
  }
  const int max_pages = (512 + c.tokens + c.page - 1) / c.page;
  const int pages = c.batch * max_pages;
  std::vector<int32_t> table(pages);
  for (int i = 0; i < pages; ++i) table[i] = (i * 7919) % pages;  // a permutation: scattered pages
  TokenMove m{};
  m.cache.num_layers = 1;
  m.cache.heads = c.heads;
  m.cache.num_pages = pages;
  m.cache.page_size = c.page;
  m.cache.batch = c.batch;
  m.cache.max_pages = max_pages;
  m.cache.token_bytes = token_bytes;
  m.cache.nhd = c.nhd;
  m.cache.page_div = jaxkv::FastDiv(c.page);
  const size_t pool = size_t{pages} * c.page * c.heads * token_bytes;
  const size_t dense = size_t{c.batch} * c.heads * c.tokens * token_bytes;
  cudaMalloc(&m.cache.k, pool);
  cudaMalloc(&m.cache.v, pool);
  cudaMalloc(&m.dense_k, dense);
  cudaMalloc(&m.dense_v, dense);
  m.cache.page_table = device(table);
  m.lengths = device(lengths);
  m.counts = device(counts);
  m.layer = device(std::vector<int32_t>{0});
  m.layers = 1;
  m.tokens = c.tokens;
  m.dense_head_stride = int64_t{c.tokens} * token_bytes;
  m.dense_row_stride = c.heads * m.dense_head_stride;
  m.dense_layer_stride = c.batch * m.dense_row_stride;
  m.gather = false;
  const int64_t wpt = token_bytes / 16;
  geometries.insert(geometries.begin(), jaxkv::move_geometry(m, wpt));
  for (int i = 0; i < kLaunches; ++i) {  // the default: append_word_kernel
    printf("%s total %d page %d: lanes 1 word kernel\n", c.name, c.total, c.page);
    (void)jaxkv::launch_move(0, m, "probe");
  }
  for (const MoveGeometry& g : geometries) {
    for (int i = 0; i < kLaunches; ++i) {
      printf("%s total %d page %d: lanes %d spans/block %d chunk %d tokens\n", c.name, c.total,
             c.page, g.lanes, g.spans_per_block, g.chunk_tokens);
      auto err = jaxkv::launch_move(0, m, "probe", &g);
      (void)err;
    }
  }
  cudaDeviceSynchronize();
  printf("%s: %s\n", c.name, cudaGetErrorString(cudaGetLastError()));
  cudaFree(m.cache.k), cudaFree(m.cache.v), cudaFree(m.dense_k), cudaFree(m.dense_v);
}

MoveGeometry geometry(int lanes, int spans, int chunk, int tokens) {
  return MoveGeometry{lanes, spans, chunk, (tokens + chunk - 1) / chunk};
}

__global__ void empty_kernel() {}

}  // namespace

int main() {
  // The floor: what ncu reports for a launch that does nothing, 256 blocks of 128 threads.
  for (int i = 0; i < 5; ++i) {
    printf("empty kernel: lanes 0\n");
    empty_kernel<<<256, 128>>>();
  }
  for (bool nhd : {true, false}) {
    for (int batch : {256, 1024}) {
      for (int page : {16, 128}) {
        Case c{nhd ? "decode NHD" : "decode HND", batch, 1, 8, page, batch, nhd};
        // The old cut (one span per block of 32 threads), then lanes x spans per block.
        run(c, {geometry(16, 8, 1, 1)});
      }
    }
    for (int page : {16, 128}) {
      Case c{nhd ? "prefill NHD" : "prefill HND", 8, 1024, 8, page, 5000, nhd};
      run(c, {geometry(128, 2, 64, 1024)});
    }
  }
  return 0;
}
