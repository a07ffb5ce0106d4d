// Device-side building blocks of jaxkv's attention kernels, shared by the split-KV kernels
// (attention_decode.cu) and the tensor-core prefill (attention_prefill.cu): block size, the 8-bit
// formats' tags and their exact conversion to f16, cp.async, mma.sync / ldmatrix / movmatrix,
// packing; and the two launchers the FFI handlers (attention.cu) choose between.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "jaxkv/attention.h"
#include "jaxkv/cuda_launch.h"

namespace jaxkv {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxHeads = 8;  // q heads per block at most (python: _MAX_HEADS_PER_BLOCK)
constexpr float kLog2e = 1.4426950408889634f;

// The 8-bit cache formats, as kernel template arguments.
struct E4M3 {};
struct E5M2 {};
struct S8 {};

template <class T>
struct Tag {
  using type = T;
};

// Calls f(Tag<Q>{}, Tag<KV>{}) with the element types of a (q dtype, cache dtype) pair that
// attention_dtypes_ok accepts (the one list of pairs): Q float, __nv_bfloat16 or __half; KV Q,
// or E4M3 / E5M2 / S8 under a 16-bit Q. False, calling nothing, for any other pair.
template <class F>
bool with_attention_types(ffi::DataType q, ffi::DataType kv, F&& f) {
  using D = ffi::DataType;
  if (!attention_dtypes_ok(q, kv)) return false;
  auto over_cache = [&](auto qt) {
    using Q = typename decltype(qt)::type;
    if (kv == q) return f(qt, qt), true;
    if constexpr (!std::is_same_v<Q, float>) {
      if (kv == D::F8E4M3FN) return f(qt, Tag<E4M3>{}), true;
      if (kv == D::F8E5M2) return f(qt, Tag<E5M2>{}), true;
      if (kv == D::S8) return f(qt, Tag<S8>{}), true;
    }
    return false;
  };
  if (q == D::F32) return over_cache(Tag<float>{});
  if (q == D::BF16) return over_cache(Tag<__nv_bfloat16>{});
  if (q == D::F16) return over_cache(Tag<__half>{});
  return false;
}

// cp.async of 16 bytes to a shared address; a dead word (live false) is filled with zeros.
// kL2 256: L2 fetches the 256 bytes around the address from DRAM at once (0: its own sectors).
template <int kL2 = 0>
__device__ __forceinline__ void copy16(unsigned dst, const char* src, bool live) {
  static_assert(kL2 == 0 || kL2 == 256, "L2 prefetch size");
  if constexpr (kL2 == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(live ? 16 : 0));
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(live ? 16 : 0));
}
// 16 bytes into shared memory (shared address `dst`).
__device__ __forceinline__ void store16(unsigned dst, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
// 16 bytes from shared address `a`.
__device__ __forceinline__ uint4 load16(unsigned a) {
  uint4 w;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : "r"(a));
  return w;
}
// The 8 16-bit floats at shared address `a` negated in place (their sign bits: exact).
__device__ __forceinline__ void negate16(unsigned a) {
  const uint4 w = load16(a);
  store16(a, w.x ^ 0x80008000u, w.y ^ 0x80008000u, w.z ^ 0x80008000u, w.w ^ 0x80008000u);
}
// The same for one word W at a generic pointer into shared memory (kL2 for 16-byte words only).
template <int kL2 = 0, class W>
__device__ __forceinline__ void copy_async(W* dst, const char* src, bool live) {
  static_assert(kL2 == 0 || sizeof(W) == 16, "an L2 fetch size is given for 16-byte copies only");
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (sizeof(W) == 16)
    copy16<kL2>(d, src, live);
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(d), "l"(src), "n"(sizeof(W)),
                 "r"(live ? static_cast<int>(sizeof(W)) : 0));
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory"); }

template <class T>
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], unsigned s) {  // a shared address
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* p) {
  ldmatrix_x4<kTrans>(r, static_cast<unsigned>(__cvta_generic_to_shared(p)));
}
// The 8x8 matrix of 16-bit values whose row lane / 4 holds elements 2 (lane % 4), + 1 (an MMA
// accumulator's layout, packed), transposed across the warp.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: 2^-inf = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh on the multi-function unit (tanh.approx.f32, about 2^-11 relative error): one
// instruction, as cheap as the softmax's exp2.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A score's soft cap in whatever units the kernel keeps scores (c is the cap in those units, and
// inv_c its reciprocal): c * tanh(s / c). Soft-capping commutes with any positive factor applied
// to both score and cap, so a kernel whose scores are pre-scaled by scale * log2 e caps them at
// soft_cap * log2 e. kExact takes tanhf (the float32 kernels), else the one-instruction tanh.
template <bool kExact = false>
__device__ __forceinline__ float soft_capped(float s, float c, float inv_c) {
  return c * (kExact ? tanhf(s * inv_c) : tanh_approx(s * inv_c));
}

// The factor that turns a query head's unnormalized output into its attention output, given the
// running maximum m and sum of its weights (base 2: weights 2^(s - m)) and the head's sink logit
// in the same units (-inf: no sink). The sink enters the denominator only:
// out = acc 2^(m - top) / (sum 2^(m - top) + 2^(sink - top)), top = max(m, sink), so that no
// term overflows whatever the sink; a head that saw no key (sum 0) gives zeros.
__device__ __forceinline__ float sink_norm(float m, float sum, float sink) {
  if (!(sum > 0.f)) return 0.f;
  if (!(sink > -INFINITY)) return 1.f / sum;
  const float top = fmaxf(m, sink), a = exp2f(m - top);
  return a / (sum * a + exp2f(sink - top));
}
// A head's sink logit in base 2 (times log2 e), the units of scores scaled by scale * log2 e;
// -inf where the call has no sinks.
__device__ __forceinline__ float sink_log2(const AttentionProblem& p, int head) {
  return p.sinks != nullptr ? p.sinks[head] * kLog2e : -INFINITY;
}

// A pair of T in one register (the first in the low half) as two floats, and back.
template <class T>
__device__ __forceinline__ float2 unpack2(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  else
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {  // one cvt for the pair
  uint32_t w;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&w, &h, 4);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&w, &h, 4);
  }
  return w;
}

// Four 8-bit values of a word as two f16 pairs: lo = bytes 0, 1, hi = bytes 2, 3 (the first of a
// pair in the low half, the fragments' order).
template <class KT> struct Tc8;
template <> struct Tc8<E4M3> {
  __device__ static void to_h2(uint32_t w, uint32_t& lo, uint32_t& hi) {
    const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
    const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
    lo = uint32_t{a.x} | (uint32_t{a.y} << 16);
    hi = uint32_t{b.x} | (uint32_t{b.y} << 16);
  }
};
template <> struct Tc8<E5M2> {
  __device__ static void to_h2(uint32_t w, uint32_t& lo, uint32_t& hi) {
    lo = __byte_perm(w, 0u, 0x1404);  // bytes {0, w0, 0, w1}
    hi = __byte_perm(w, 0u, 0x3424);
  }
};
template <> struct Tc8<S8> {
  __device__ static void to_h2(uint32_t w, uint32_t& lo, uint32_t& hi) {
    // f16 0x64XX is 1024 + XX: XX = byte + 128 (the sign bit flipped), then 1152 off. Exact.
    const uint32_t u = w ^ 0x80808080u;
    const uint32_t a = __byte_perm(u, 0x64646464u, 0x4140), b = __byte_perm(u, 0x64646464u, 0x4342);
    const __half2 off = __float2half2_rn(1152.f);
    __half2 x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    x = __hsub2(x, off), y = __hsub2(y, off);
    memcpy(&lo, &x, 4);
    memcpy(&hi, &y, 4);
  }
};

// The power of two that puts a largest |value| `amax` into [2^14, 2^15), f16's top octave, so
// that bf16 or f16 values times it keep every bit in f16 (but for those below 2^-28 of amax);
// between 2^-120 and 2^120, and 1 for 0 or a non-finite amax.
__device__ __forceinline__ float f16_headroom(float amax) {
  const int ex = amax > 0.f && isfinite(amax) ? max(-120, min(120, 14 - ilogbf(amax))) : 0;
  return __int_as_float((ex + 127) << 23);  // 2^ex, exactly
}

// A power of two above x (finite, >= 0, below 2^127) and its reciprocal, both exact: the
// reference that the 8-bit kernels keep above every V scale read.
struct Pow2 {
  float value, inverse;
};
__device__ __forceinline__ Pow2 pow2_above(float x) {
  const uint32_t bits = (__float_as_uint(x) & 0x7f800000u) + 0x00800000u;  // 2^(exponent + 1)
  return {__uint_as_float(bits), __uint_as_float(0x7f000000u - bits)};
}

// A pair of f16 (exact values of an 8-bit format) as the same pair in bf16 (exact too: at most 8
// significant bits, |x| <= 57344).
__device__ __forceinline__ uint32_t half2_to_bf16x2(uint32_t h) {
  const float2 f = unpack2<__half>(h);
  return pack2<__nv_bfloat16>(f.x, f.y);
}

// The query tile of a prefill block (both tensor-core prefills): grid (token tiles, KV heads,
// rows b), the longest tiles first; kRows query rows, each a new token and one of the group's q
// heads (row r: token t0 + r / group, head kvh * group + r % group). The keys of its last live
// query bound its K/V tiles (keys grow with t); below those of its first, no causal mask.
struct PrefillTile {
  int group, per_tile, live_rows, b, kvh, t0;
  bool layer_ok;
  int32_t n_max, n_min;
  // Token tile `tile` (tokens tile * rows / group on) of KV head `head` of row `row`.
  __device__ PrefillTile(const AttentionProblem& p, int rows, int tile, int head, int row)
      : group(p.group), per_tile(rows / p.group), live_rows(per_tile * p.group), b(row), kvh(head),
        t0(tile * per_tile), layer_ok(p.layer_ok()) {
    const int t_last = min(t0 + per_tile, min(p.tokens, p.counts[b])) - 1;
    const bool any = layer_ok && t_last >= t0;
    n_max = any ? p.keys(b, t_last) : 0;
    n_min = any ? p.keys(b, t0) : 0;
  }
  // A block's tile of grid(p, rows): the last token tile first (the longest, causal).
  __device__ PrefillTile(const AttentionProblem& p, int rows)
      : PrefillTile(p, rows, gridDim.x - 1 - blockIdx.x, blockIdx.y, blockIdx.z) {}
  // Row r's token and q head; live: a query of the call (not past the tile's rows or T).
  struct Row {
    int t, head;
    bool live;
  };
  __device__ Row row(const AttentionProblem& p, int r) const {
    const int t = t0 + r / group;
    return {t, kvh * group + r % group, r < live_rows && t < p.tokens};
  }
  __device__ int64_t q_index(const AttentionProblem& p, const Row& q) const { return p.q_index(b, q.t, q.head); }
  __device__ int32_t keys(const AttentionProblem& p, const Row& q) const {  // 0: a row without keys
    return layer_ok && q.live ? p.keys(b, q.t) : 0;
  }
  __device__ int tiles(int keys_a_tile) const { return (n_max + keys_a_tile - 1) / keys_a_tile; }
  static dim3 grid(const AttentionProblem& p, int rows) {
    const int per = rows / p.group;
    return dim3(static_cast<unsigned>((p.tokens + per - 1) / per), static_cast<unsigned>(p.kv.heads),
                static_cast<unsigned>(p.batch));
  }
};

// Shared memory of `kernel` past the 48 KiB default: the opt-in. Setting the attribute costs a
// driver call, so each (kernel, device) is configured once (kernels of one signature share a
// function type, so the record is keyed by the kernel's address). The record is atomic: XLA may
// call handlers from several threads, and a slot lost to another thread's kernel only means the
// attribute is set again next time.
template <class Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return;
  constexpr int kMaxDevices = 64, kSlots = 64;
  static std::atomic<const void*> configured[kMaxDevices][kSlots] = {};
  int device = 0;
  cudaGetDevice(&device);
  const void* key = reinterpret_cast<const void*>(kernel);
  for (std::atomic<const void*>& slot : configured[device % kMaxDevices]) {
    const void* seen = slot.load(std::memory_order_acquire);
    if (seen == key) return;
    if (seen == nullptr) {
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
      slot.compare_exchange_strong(seen, key, std::memory_order_release);
      return;
    }
  }
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

// The split-KV kernels (attention_decode.cu): every q and cache dtype, decode and the fallback of
// prefill (a query row per new token).
ffi::Error launch_split_kv(cudaStream_t stream, const AttentionProblem& p, int splits, float* work);
// The tensor-core prefill (attention_prefill.cu) where it applies; false: it does not.
bool launch_prefill_tc(cudaStream_t stream, const AttentionProblem& p, ffi::Error* status);
// Its wgmma form (attention_prefill_wgmma.cu): Hopper, a bf16 / f16 q over its dtype or an 8-bit
// cache at head_dim 128, over its dtype at head_dim 256.
bool launch_prefill_wgmma(cudaStream_t stream, const AttentionProblem& p, ffi::Error* status);

}  // namespace jaxkv
