// Hopper's warpgroup MMA (wgmma, sm_90a only: compiled where __CUDA_ARCH_FEAT_SM90_ALL is defined)
// for the tensor-core prefill of attention_prefill_wgmma.cu: tiles of 16-bit values in shared
// memory in the 128-byte swizzle the instruction reads, their matrix descriptors, m64nNk16 (N 64,
// 128, 256) with A from shared memory or from registers, and the barriers of a pipeline
// (mbarriers, named barriers). Checked on an H100 against a host reference by
// tools/probes/wgmma_probe.cu at N 64, 128 and 256 (both operand majors, A from registers, the
// accumulators turned into A fragments).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace jaxkv {

// A tile of kRows rows of 16-bit values as wgmma reads it with the 128-byte swizzle: the columns
// in blocks of 64 (a row of a block is 128 bytes), block after block; 16-byte chunk c of row r of
// a block at ((c ^ r % 8) * 16). The tile's base is 1024-aligned (the swizzle is of the address).
template <int kRows>
struct SwizzledTile {
  static constexpr unsigned kBlock = kRows * 128u;  // bytes of one block of 64 columns
  // The shared address of 16-byte chunk c (8 values) of row r.
  __device__ static unsigned chunk(unsigned base, int r, int c) {
    return base + (c / 8) * kBlock + r * 128u + (((c % 8) ^ (r % 8)) << 4);
  }
};

// The matrix descriptor of an operand at shared address `addr`: leading and stride byte offsets
// (multiples of 16), 128-byte swizzle.
__device__ __forceinline__ uint64_t wgmma_desc(unsigned addr, unsigned lbo, unsigned sbo) {
  return uint64_t{(addr & 0x3FFFFu) >> 4} | (uint64_t{lbo >> 4} << 16) | (uint64_t{sbo >> 4} << 32) |
         (uint64_t{1} << 62);
}
// K-major (the reduction dimension along the rows: Q and K of S = Q K^T): k-step kk (16 values)
// of the 64 or 128 rows from `row0` (a multiple of 8) of a SwizzledTile<kRows>. The rows' 8-row
// groups are 1024 bytes apart (stride offset); the leading offset is unused with this swizzle.
template <int kRows>
__device__ __forceinline__ uint64_t desc_k_major(unsigned base, int row0, int kk) {
  return wgmma_desc(base + (kk / 4) * SwizzledTile<kRows>::kBlock + row0 * 128u + (kk % 4) * 32u, 16, 1024);
}
// MN-major (the reduction dimension across the rows: V of O = P V, read transposed): k-step kk
// (rows 16 kk to 16 kk + 15) of a SwizzledTile<kRows>, all its columns: the blocks of 64 columns
// are kBlock apart (leading offset), the 8-row groups 1024 bytes (stride offset).
template <int kRows>
__device__ __forceinline__ uint64_t desc_mn_major(unsigned base, int kk) {
  return wgmma_desc(base + kk * 16 * 128u, SwizzledTile<kRows>::kBlock, 1024);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Ordinary shared-memory writes (cp.async included) made visible to the tensor cores' reads.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// This warpgroup's registers a thread from here on (setmaxnreg: kInc takes from the block's pool,
// which another warpgroup's decrease fills).
template <bool kInc, int kRegs>
__device__ __forceinline__ void set_registers() {
  if constexpr (kInc) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs) : "memory");
  else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs) : "memory");
}

// mbarriers (shared address `bar`): a phase completes when `count` arrivals have come; a waiter
// names the parity of the phase it waits for (0 for the first, 1, 0, ...).
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {  // release: this thread's writes before it
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// An arrival once this thread's cp.async so far have landed (not counted in advance: noinc).
__device__ __forceinline__ void mbar_arrive_copies(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// Named barriers among `threads` threads (id 0 is __syncthreads'): sync waits, arrive does not.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// m64nNk16 (N 64, 128 or 256), f32 accumulators += T x T (T bf16 or f16), a warpgroup's 64 rows:
// d (N / 2 floats a thread, the mma.sync m16n8 layout per warp and 8 columns) += A B; A from
// shared memory (mma_ss, K-major) or registers (mma_rs: the m16n8k16 A fragment of the warp's 16
// rows), B from shared memory, K-major (kTransB 0) or MN-major (1). scale_d 0: d = A B.
template <class T, int N> struct Wgmma {};

// The N / 2 accumulators: their operands %0 to %(N / 2 - 1) in the instruction, and as outputs.
#define JAXKV_WGMMA_D_REGS_32                                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                            \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define JAXKV_WGMMA_D_REGS_64                                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                            \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                                   \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                                   \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define JAXKV_WGMMA_D_REGS_128                                                                                         \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                            \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                                   \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                                   \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                                   \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                                   \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                                   \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "                       \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
#define JAXKV_D8(i)                                                                                                    \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]),          \
      "+f"(d[i + 7])
#define JAXKV_WGMMA_D_OUT_32 JAXKV_D8(0), JAXKV_D8(8), JAXKV_D8(16), JAXKV_D8(24)
#define JAXKV_WGMMA_D_OUT_64 JAXKV_WGMMA_D_OUT_32, JAXKV_D8(32), JAXKV_D8(40), JAXKV_D8(48), JAXKV_D8(56)
#define JAXKV_WGMMA_D_OUT_128                                                                                          \
  JAXKV_WGMMA_D_OUT_64, JAXKV_D8(64), JAXKV_D8(72), JAXKV_D8(80), JAXKV_D8(88), JAXKV_D8(96), JAXKV_D8(104),           \
      JAXKV_D8(112), JAXKV_D8(120)

// Both operand forms for one 16-bit type T (DT its PTX name) and N (ACC = N / 2 accumulators);
// I0 to I6: the operands after the accumulators, "%ACC" to "%(ACC + 6)".
#define JAXKV_WGMMA_M64NK16(T, DT, N, ACC, I0, I1, I2, I3, I4, I5, I6)                                                 \
template <int kTransB>                                                                                                 \
__device__ __forceinline__ void mma_ss(Wgmma<T, N>, float (&d)[ACC], uint64_t a, uint64_t b, int scale_d) {            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " I2 ", 0;\n"                                                         \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." DT "." DT " " JAXKV_WGMMA_D_REGS_##ACC                \
               I0 ", " I1 ", p, 1, 1, 0, " I3 ";\n}\n"                                                                 \
               : JAXKV_WGMMA_D_OUT_##ACC                                                                               \
               : "l"(a), "l"(b), "r"(scale_d), "n"(kTransB));                                                          \
}                                                                                                                      \
template <int kTransB>                                                                                                 \
__device__ __forceinline__ void mma_rs(Wgmma<T, N>, float (&d)[ACC], const uint32_t (&a)[4], uint64_t b,               \
                                       int scale_d) {                                                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " I5 ", 0;\n"                                                         \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." DT "." DT " " JAXKV_WGMMA_D_REGS_##ACC                \
               "{" I0 ", " I1 ", " I2 ", " I3 "}, " I4 ", p, 1, 1, " I6 ";\n}\n"                                       \
               : JAXKV_WGMMA_D_OUT_##ACC                                                                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(kTransB));                      \
}
#define JAXKV_WGMMA_TYPE(T, DT)                                                                                        \
  JAXKV_WGMMA_M64NK16(T, DT, 64, 32, "%32", "%33", "%34", "%35", "%36", "%37", "%38")                                  \
  JAXKV_WGMMA_M64NK16(T, DT, 128, 64, "%64", "%65", "%66", "%67", "%68", "%69", "%70")                                 \
  JAXKV_WGMMA_M64NK16(T, DT, 256, 128, "%128", "%129", "%130", "%131", "%132", "%133", "%134")

JAXKV_WGMMA_TYPE(__nv_bfloat16, "bf16")
JAXKV_WGMMA_TYPE(__half, "f16")
#undef JAXKV_WGMMA_TYPE
#undef JAXKV_WGMMA_M64NK16

// m64n128k32, f32 accumulators += A B with A e4m3 and B e4m3 (kE5M2 false) or e5m2, both from
// shared memory and K-major (the only major 8-bit operands have: a row of 32 values is 32 bytes,
// as one of 16 16-bit values, so the descriptors are desc_k_major's). scale_d 0: d = A B.
template <bool kE5M2>
__device__ __forceinline__ void mma_ss_f8(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {
#define JAXKV_WGMMA_F8(BT)                                                                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                            \
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3." BT " " JAXKV_WGMMA_D_REGS_64                        \
               "%64, %65, p, 1, 1;\n}\n"                                                                               \
               : JAXKV_WGMMA_D_OUT_64                                                                                  \
               : "l"(a), "l"(b), "r"(scale_d))
  if constexpr (kE5M2) JAXKV_WGMMA_F8("e5m2");
  else JAXKV_WGMMA_F8("e4m3");
#undef JAXKV_WGMMA_F8
}
#undef JAXKV_WGMMA_D_OUT_128
#undef JAXKV_WGMMA_D_OUT_64
#undef JAXKV_WGMMA_D_OUT_32
#undef JAXKV_D8
#undef JAXKV_WGMMA_D_REGS_128
#undef JAXKV_WGMMA_D_REGS_64
#undef JAXKV_WGMMA_D_REGS_32

}  // namespace jaxkv
