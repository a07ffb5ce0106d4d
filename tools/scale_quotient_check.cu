// Every float amax against scale_quotient (ffi/cuda/quotient.cuh): where the quantizing kernels
// take it (its result in [kQuotientMin, kQuotientMax], the range they test), it must equal the
// division amax / qmax bit for bit, for each format's qmax. Prints, per qmax, the floats checked
// and the mismatches in range (must be 0) and out of range (the kernels divide there). Not part
// of the build; tools/gpu_check.sh runs it:
//   nvcc -O3 -std=c++17 -arch=sm_90 -Iffi/cuda tools/scale_quotient_check.cu -o /tmp/sqc
//   /tmp/sqc
#include <cstdio>
#include <cuda_runtime.h>

#include "quotient.cuh"

template <int kQmax>
__global__ void check(unsigned long long* counts) {
  unsigned long long in_range = 0, outside = 0;
  const unsigned stride = gridDim.x * blockDim.x;
  for (unsigned bits = blockIdx.x * blockDim.x + threadIdx.x; bits < 0x7f800000u; bits += stride) {
    const float amax = __uint_as_float(bits);  // every non-negative finite float, subnormals too
    const float fast = jaxkv::scale_quotient<kQmax>(amax);
    const float exact = __fdiv_rn(amax, static_cast<float>(kQmax));
    if (__float_as_uint(fast) != __float_as_uint(exact)) {
      if (fast >= jaxkv::kQuotientMin && fast <= jaxkv::kQuotientMax) {
        ++in_range;
      } else {
        ++outside;
      }
    }
  }
  atomicAdd(&counts[0], in_range);
  atomicAdd(&counts[1], outside);
}

template <int kQmax>
bool run() {
  unsigned long long* counts;
  cudaMallocManaged(&counts, 2 * sizeof(unsigned long long));
  counts[0] = counts[1] = 0;
  check<kQmax><<<1024, 256>>>(counts);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("qmax %d: CUDA error\n", kQmax);
    return false;
  }
  std::printf("qmax %6d: %u floats, mismatches in range %llu, out of range %llu\n", kQmax,
              0x7f800000u, counts[0], counts[1]);
  const bool ok = counts[0] == 0;
  cudaFree(counts);
  return ok;
}

int main() {
  const bool ok = run<448>() & run<57344>() & run<127>();
  std::printf(ok ? "scale_quotient: equal to the division in range\n"
                  : "scale_quotient: MISMATCH\n");
  return ok ? 0 : 1;
}
