// Can the copy engines move the host tier's scattered pages at the PCIe bandwidth, and beside a
// kernel without slowing it? (The transfer kernel over unified addressing reaches ~95% of the
// pinned copy but takes multiprocessors: a decode beside a swap-in keeps 89-91% of its speed.)
//
//   nvcc -O2 -std=c++17 -arch=sm_90 tools/probes/host_dma_probe.cu -o /tmp/host_dma_probe && /tmp/host_dma_probe [KiB]
//
// The shape of `jaxkv.bench --swap`: 1024 pages scattered over a device pool of 4096, 32 layers,
// K and V, a page's layer 32 KiB (16 tokens x 8 heads x 128 x bf16), so 65536 runs of 32 KiB a
// direction (2 GiB); the host pool page-major, a page's 2 MiB contiguous. [KiB]: runs of that size
// instead (the same 2 MiB a page, fewer "layers": larger pages). Times with CUDA events:
//  - contiguous: one cudaMemcpyAsync of 2 GiB (the roofline);
//  - per run: one cudaMemcpyAsync per 32 KiB run (what a loop on the host would issue);
//  - batch: one cudaMemcpyBatchAsync of the 65536 runs (CUDA 12.8+), with and without
//    cudaMemcpyFlagPreferOverlapWithCompute;
//  - beside a memory-bound kernel on another stream: the kernel's time alone and with the batch.
// The host-side pointer arrays are what a design on the copy engines needs (the page ids on the
// host: a device-to-host read of the ids before the call).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e = (x);                                                           \
    if (e != cudaSuccess) {                                                        \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

constexpr size_t kPages = 1024, kPool = 4096;
constexpr size_t kPageBytes = size_t{2} << 20;  // K and V, every layer
size_t kRun = 32 << 10, kLayers = 32;

// A memory-bound stand-in for a decode: reads a buffer and writes a word per block.
__global__ void stream_kernel(const uint4* x, size_t n, unsigned* out) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const uint4 w = x[i];
    acc ^= w.x ^ w.y ^ w.z ^ w.w;
  }
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

int main(int argc, char** argv) {
  if (argc > 1) kRun = size_t(std::atoi(argv[1])) << 10;
  kLayers = kPageBytes / 2 / kRun;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d copy engines (asyncEngineCount)\n", prop.name, prop.asyncEngineCount);
  const size_t pool_layer = kPool * kRun;  // a layer of K (or V): [pool pages][run]
  char *k, *v, *host;
  CHECK(cudaMalloc(&k, kLayers * pool_layer));
  CHECK(cudaMalloc(&v, kLayers * pool_layer));
  CHECK(cudaMallocHost(&host, kPages * kPageBytes));
  const size_t big = size_t{4} << 30;  // the stand-in's buffer
  uint4* buf;
  unsigned* sink;
  CHECK(cudaMalloc(&buf, big));
  CHECK(cudaMalloc(&sink, 1 << 20));
  CHECK(cudaMemset(buf, 1, big));
  CHECK(cudaMemset(k, 2, kLayers * pool_layer));
  CHECK(cudaMemset(v, 3, kLayers * pool_layer));

  std::vector<int> perm(kPool);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(0));
  std::vector<void*> dev, hst;
  std::vector<size_t> sizes;
  for (size_t p = 0; p < kPages; ++p)
    for (size_t kv = 0; kv < 2; ++kv)
      for (size_t l = 0; l < kLayers; ++l) {
        dev.push_back((kv ? v : k) + l * pool_layer + perm[p] * kRun);
        hst.push_back(host + p * kPageBytes + (kv * kLayers + l) * kRun);
        sizes.push_back(kRun);
      }
  const size_t runs = dev.size(), bytes = runs * kRun;
  cudaStream_t s, c;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking));
  cudaEvent_t a, b, ka, kb;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventCreate(&ka));
  CHECK(cudaEventCreate(&kb));

  auto timed = [&](const char* name, auto issue) {
    float best = 1e9f;
    for (int r = 0; r < 4; ++r) {
      CHECK(cudaEventRecord(a, s));
      issue();
      CHECK(cudaEventRecord(b, s));
      CHECK(cudaEventSynchronize(b));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      if (r) best = std::min(best, ms);
    }
    std::printf("  %-44s %8.2f ms  %6.1f GB/s\n", name, best, bytes / best / 1e6);
    return best;
  };
  auto batch = [&](bool to_host, unsigned flags) {
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = flags;
    size_t idx = 0;
    void* const* dst = to_host ? hst.data() : dev.data();
    const void* const* src = to_host ? const_cast<const void* const*>(dev.data())
                                     : const_cast<const void* const*>(hst.data());
    CHECK(cudaMemcpyBatchAsync(dst, src, sizes.data(), runs, &attr, &idx, 1, s));
  };
  for (int to_host = 1; to_host >= 0; --to_host) {
    std::printf("%s, %zu runs of %zu KiB (%.2f GiB):\n", to_host ? "to the host" : "from the host", runs,
                kRun >> 10, bytes / double(1 << 30));
    timed("contiguous cudaMemcpyAsync", [&] {
      CHECK(to_host ? cudaMemcpyAsync(host, k, bytes, cudaMemcpyDeviceToHost, s)
                    : cudaMemcpyAsync(k, host, bytes, cudaMemcpyHostToDevice, s));
    });
    timed("cudaMemcpyAsync per run", [&] {
      for (size_t i = 0; i < runs; ++i)
        CHECK(to_host ? cudaMemcpyAsync(hst[i], dev[i], kRun, cudaMemcpyDeviceToHost, s)
                      : cudaMemcpyAsync(dev[i], hst[i], kRun, cudaMemcpyHostToDevice, s));
    });
    timed("cudaMemcpyBatchAsync", [&] { batch(to_host, cudaMemcpyFlagDefault); });
    timed("cudaMemcpyBatchAsync, prefer overlap", [&] { batch(to_host, cudaMemcpyFlagPreferOverlapWithCompute); });
    // Beside the stand-in: its time alone, then with the batch issued just before it.
    const size_t words = big / 16;
    auto kernel = [&] { stream_kernel<<<prop.multiProcessorCount * 4, 512, 0, c>>>(buf, words, sink); };
    float alone = 1e9f, with = 1e9f, pair = 1e9f;
    for (int r = 0; r < 4; ++r) {
      float ms;
      CHECK(cudaEventRecord(ka, c));
      for (int i = 0; i < 20; ++i) kernel();
      CHECK(cudaEventRecord(kb, c));
      CHECK(cudaEventSynchronize(kb));
      CHECK(cudaEventElapsedTime(&ms, ka, kb));
      if (r) alone = std::min(alone, ms);
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaEventRecord(a, s));
      batch(to_host, cudaMemcpyFlagPreferOverlapWithCompute);
      CHECK(cudaEventRecord(b, s));
      CHECK(cudaEventRecord(ka, c));
      for (int i = 0; i < 20; ++i) kernel();
      CHECK(cudaEventRecord(kb, c));
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaEventElapsedTime(&ms, ka, kb));
      if (r) with = std::min(with, ms);
      CHECK(cudaEventElapsedTime(&ms, a, b));
      if (r) pair = std::min(pair, ms);
    }
    std::printf("  beside a stream kernel (20 x %.1f GiB read): kernel alone %.2f ms, with the batch "
                "%.2f ms (kept %.0f%%); the batch %.2f ms (%.1f GB/s)\n",
                big / double(1 << 30), alone, with, 100 * alone / with, pair, bytes / pair / 1e6);
  }
  // The bytes: every run of the last copy (from the host) holds what the host pool held.
  std::vector<char> one(kRun);
  CHECK(cudaMemcpy(one.data(), dev[runs - 1], kRun, cudaMemcpyDeviceToHost));
  std::printf("last run equal to its host copy: %s\n",
              std::equal(one.begin(), one.end(), static_cast<char*>(hst[runs - 1])) ? "yes" : "NO");
  return 0;
}
