// Span-copy variants (the access pattern of save / instantiate / append / gather): which unroll,
// block size, grid and cache hints move bytes fastest on this GPU. Standalone, no JAX.
//   nvcc -O3 -arch=sm_90 -o /tmp/cv tools/probes/copy_variants.cu && /tmp/cv
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include <algorithm>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

struct Job { const char* src; char* dst; long span_bytes, src_stride, dst_stride, spans; };

template <int T, int U, bool kStream>
__global__ void __launch_bounds__(T) copy_persistent(Job j) {
  const long words = j.span_bytes / 16;
  const long chunks = (words + T * U - 1) / (T * U);
  const long total = chunks * j.spans;
  for (long unit = blockIdx.x; unit < total; unit += gridDim.x) {
    const long s = unit / chunks, c = unit % chunks;
    const uint4* src = reinterpret_cast<const uint4*>(j.src + s * j.src_stride);
    uint4* dst = reinterpret_cast<uint4*>(j.dst + s * j.dst_stride);
    uint4 buf[U];
    const long first = c * T * U + threadIdx.x;
#pragma unroll
    for (int u = 0; u < U; ++u) { long i = first + u * T; if (i < words) buf[u] = kStream ? __ldcs(src + i) : src[i]; }
#pragma unroll
    for (int u = 0; u < U; ++u) { long i = first + u * T; if (i < words) { if (kStream) __stcs(dst + i, buf[u]); else dst[i] = buf[u]; } }
  }
}

template <int T, int U, bool kStream>
float run(Job j, int blocks_per_sm, int sms, int reps) {
  const long words = j.span_bytes / 16;
  const long total = (words + T * U - 1) / (T * U) * j.spans;
  int occ = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, copy_persistent<T, U, kStream>, T, 0));
  long grid = blocks_per_sm > 0 ? std::min<long>(total, (long)sms * occ * blocks_per_sm) : total;
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  copy_persistent<T, U, kStream><<<grid, T>>>(j);
  CK(cudaGetLastError());
  cudaEventRecord(a);
  for (int r = 0; r < reps; ++r) copy_persistent<T, U, kStream><<<grid, T>>>(j);
  cudaEventRecord(b); CK(cudaEventSynchronize(b));
  float ms; cudaEventElapsedTime(&ms, a, b);
  return ms / reps;
}

int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const long S = 4096, TB = 256;  // capacity, token bytes (8 heads x ... per head span: D128 bf16)
  const long big = 32L * 16 * S * TB;  // 32 layers x 16 K/V head spans x S tokens: 512 MiB cache rows
  char *src, *dst; CK(cudaMalloc(&src, big)); CK(cudaMalloc(&dst, big));
  CK(cudaMemset(src, 1, big)); CK(cudaMemset(dst, 2, big));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  cudaEventRecord(a); for (int r = 0; r < 10; ++r) cudaMemcpyAsync(dst, src, big, cudaMemcpyDeviceToDevice); cudaEventRecord(b);
  cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b);
  const double memcpy_bw = 2.0 * big / (ms / 10 * 1e-3) / 1e9;  // GB/s, read + write
  printf("memcpy %.0f GB/s\n", memcpy_bw);
  for (long T_tok : {256L, 1024L, 4096L}) {
    Job j{src, dst, T_tok * TB, S * TB, T_tok * TB, 32L * 16};
    const double bytes = 2.0 * j.span_bytes * j.spans;
    auto show = [&](const char* name, float t) { printf("T=%5ld %-28s %7.1f us %6.0f GB/s %5.1f%%\n", T_tok, name, t * 1e3, bytes / t / 1e6, 100 * bytes / t / 1e6 / memcpy_bw); };
    show("256x4 persistent", run<256, 4, false>(j, 1, sms, 20));
    show("256x8 persistent", run<256, 8, false>(j, 1, sms, 20));
    show("256x4 persistent stream", run<256, 4, true>(j, 1, sms, 20));
    show("256x8 persistent stream", run<256, 8, true>(j, 1, sms, 20));
    show("256x4 one block per unit", run<256, 4, false>(j, 0, sms, 20));
    show("256x8 one block per unit", run<256, 8, false>(j, 0, sms, 20));
    show("512x4 persistent", run<512, 4, false>(j, 1, sms, 20));
    show("128x8 persistent", run<128, 8, false>(j, 1, sms, 20));
    show("256x16 persistent", run<256, 16, false>(j, 1, sms, 20));
    show("256x8 one block/unit stream", run<256, 8, true>(j, 0, sms, 20));
  }
  return 0;
}
