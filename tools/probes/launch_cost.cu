// Host cost per call of what a handler may do before its launch (H200 probe, not part of the build):
// cudaFuncSetAttribute, cudaOccupancyMaxActiveBlocksPerMultiprocessor, and launches with a small
// and a 12 KB parameter block.   nvcc -O2 -arch=sm_90 tools/probes/launch_cost.cu -o /tmp/lc && /tmp/lc
#include <chrono>
#include <cstdio>
#include <cuda_runtime.h>

struct Big { char bytes[12 * 1024]; int n; };
__global__ void big_kernel(const __grid_constant__ Big p) { if (threadIdx.x == 0 && p.n == 7) printf("x"); }
__global__ void small_kernel(int n) { if (threadIdx.x == 0 && n == 7) printf("x"); }

template <class F> double us_per_call(F f, int n = 2000) {
  for (int i = 0; i < 100; ++i) f();
  cudaDeviceSynchronize();
  auto t = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  cudaDeviceSynchronize();
  return s / n * 1e6;
}

int main() {
  cudaStream_t st; cudaStreamCreate(&st);
  Big b{}; b.n = 1;
  int per_sm = 0;
  printf("cudaFuncSetAttribute(smem 1 KB)     %.2f us\n", us_per_call([&] {
    cudaFuncSetAttribute(big_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 1024); }));
  printf("cudaOccupancyMaxActiveBlocksPerSM   %.2f us\n", us_per_call([&] {
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, big_kernel, 256, 1024); }));
  printf("launch, 4 B params                  %.2f us\n", us_per_call([&] { small_kernel<<<132, 256, 0, st>>>(1); }));
  printf("launch, 12 KB params                %.2f us\n", us_per_call([&] { big_kernel<<<132, 256, 0, st>>>(b); }));
  printf("launch, 12 KB params, 1 KB smem     %.2f us\n", us_per_call([&] { big_kernel<<<132, 256, 1024, st>>>(b); }));
  // Under stream capture, as XLA records a command-buffer-compatible handler.
  printf("capture+instantiate, 12 KB launch   %.2f us\n", us_per_call([&] {
    cudaGraph_t g; cudaGraphExec_t e;
    cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
    big_kernel<<<132, 256, 0, st>>>(b);
    cudaStreamEndCapture(st, &g);
    cudaGraphInstantiate(&e, g, 0);
    cudaGraphExecDestroy(e); cudaGraphDestroy(g); }, 300));
  printf("capture+instantiate, 4 B launch     %.2f us\n", us_per_call([&] {
    cudaGraph_t g; cudaGraphExec_t e;
    cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
    small_kernel<<<132, 256, 0, st>>>(1);
    cudaStreamEndCapture(st, &g);
    cudaGraphInstantiate(&e, g, 0);
    cudaGraphExecDestroy(e); cudaGraphDestroy(g); }, 300));
  printf("(%s)\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
