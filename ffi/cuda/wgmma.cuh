// Hopper's warpgroup MMA (wgmma, sm_90a only: compiled where __CUDA_ARCH_FEAT_SM90_ALL is defined)
// for the tensor-core prefill of attention_prefill_wgmma.cu: tiles of 16-bit values in shared
// memory in the 128-byte swizzle the instruction reads, their matrix descriptors, m64n128k16
// with A from shared memory or from registers, and the barriers of a pipeline (mbarriers, named
// barriers). Checked on an H100 against a host
// reference by tools/probes/wgmma_probe.cu (both operand majors, A from registers, the accumulators
// turned into A fragments).
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

// m64nNk16, f32 accumulators += T x T (T bf16 or f16), a warpgroup's 64 rows: d (N / 2 floats a
// thread, the mma.sync m16n8 layout per warp and 8 columns) += A B; A from shared memory (mma_ss,
// K-major) or registers (mma_rs: the m16n8k16 A fragment of the warp's 16 rows), B from shared
// memory, K-major (kTransB 0) or MN-major (1). scale_d 0: d = A B.
template <class T, int N> struct Wgmma {};

// The 64 accumulators of m64n128: their operands %0-%63 in the instruction, and as outputs.
#define JAXKV_WGMMA_D_REGS                                                                                               \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                              \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                                     \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                                     \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define JAXKV_WGMMA_D_OUT                                                                                                \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                        \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),                  \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),                \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),                \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),                \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),                \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),                \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// Both operand forms for one 16-bit type T, DT its PTX name.
#define JAXKV_WGMMA_M64N128K16(T, DT)                                                                                    \
template <int kTransB>                                                                                                   \
__device__ __forceinline__ void mma_ss(Wgmma<T, 128>, float (&d)[64], uint64_t a, uint64_t b, int scale_d) {             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                              \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." DT "." DT " " JAXKV_WGMMA_D_REGS                           \
               "%64, %65, p, 1, 1, 0, %67;\n}\n"                                                                         \
               : JAXKV_WGMMA_D_OUT                                                                                       \
               : "l"(a), "l"(b), "r"(scale_d), "n"(kTransB));                                                            \
}                                                                                                                        \
template <int kTransB>                                                                                                   \
__device__ __forceinline__ void mma_rs(Wgmma<T, 128>, float (&d)[64], const uint32_t (&a)[4], uint64_t b, int scale_d) { \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                              \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." DT "." DT " " JAXKV_WGMMA_D_REGS                           \
               "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                                                           \
               : JAXKV_WGMMA_D_OUT                                                                                       \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(kTransB));                        \
}

JAXKV_WGMMA_M64N128K16(__nv_bfloat16, "bf16")
JAXKV_WGMMA_M64N128K16(__half, "f16")
#undef JAXKV_WGMMA_M64N128K16

// m64n128k32, f32 accumulators += A B with A e4m3 and B e4m3 (kE5M2 false) or e5m2, both from
// shared memory and K-major (the only major 8-bit operands have: a row of 32 values is 32 bytes,
// as one of 16 16-bit values, so the descriptors are desc_k_major's). scale_d 0: d = A B.
template <bool kE5M2>
__device__ __forceinline__ void mma_ss_f8(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {
#define JAXKV_WGMMA_F8(BT)                                                                                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                              \
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3." BT " " JAXKV_WGMMA_D_REGS "%64, %65, p, 1, 1;\n}\n"   \
               : JAXKV_WGMMA_D_OUT                                                                                       \
               : "l"(a), "l"(b), "r"(scale_d))
  if constexpr (kE5M2) JAXKV_WGMMA_F8("e5m2");
  else JAXKV_WGMMA_F8("e4m3");
#undef JAXKV_WGMMA_F8
}
#undef JAXKV_WGMMA_D_OUT
#undef JAXKV_WGMMA_D_REGS

}  // namespace jaxkv
