// CUDA handlers of the quantizing appends (dense and paged) and of the quantizing instantiate:
// each (layer, row, K/V, head, token) vector is read once, its max |x| reduced by shuffles, its
// scale written by one lane and its bytes by every lane: one pass over the input, no temporary.
// For head_dim 32 to 256 (a power of two) the append kernel is compiled per input and cache format
// (quantize_kernel_fixed, several vectors a warp), and so is the instantiate's (quantize_prefix_fixed,
// where every layer has one input format and head_dim); other sizes, appends of 2^31 vectors or
// more and mixed prefixes take the generic one-warp-a-vector kernels (quantize_vector_warp).
#include <cuda_fp16.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "jaxkv/cuda_launch.h"
#include "jaxkv/quantize.h"
#include "jaxkv/quantize_prefix.h"
#include "jaxkv/registry.h"
#include "quotient.cuh"

namespace jaxkv {
namespace {

constexpr int kWarps = 8;
constexpr int kMaxValuesPerLane = 8;  // head_dim <= 256 (quantization.check_head_dim, at trace time)

// One vector by one warp, lane d holding values d, d + 32, ...: its scale (max |x| by shuffles,
// written by lane 0) and its bytes. The whole warp calls it (every lane takes part in the shuffles).
__device__ __forceinline__ void quantize_vector_warp(const QuantTarget& t, int head_dim, Format input,
                                                     Format format, int lane) {
  float x[kMaxValuesPerLane];
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxValuesPerLane; ++j) {
    const int d = lane + 32 * j;
    x[j] = d < head_dim ? load_float(t.src, d, input) : 0.f;
    amax = fmaxf(amax, fabsf(x[j]));
  }
  float s = t.given;
  if (t.scale) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    s = amax / format_max(format);
    if (lane == 0) *t.scale = s;
  }
#pragma unroll
  for (int j = 0; j < kMaxValuesPerLane; ++j) {
    const int d = lane + 32 * j;
    if (d < head_dim) t.dst[d] = static_cast<char>(quantize_value(x[j], s, format));
  }
}

__global__ void __launch_bounds__(kWarps * 32) quantize_kernel(const QuantAppend p) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  for (int64_t i = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; i < p.vectors(); i += warps) {
    QuantTarget t;
    const VectorIndex at = vector_index(p, i);
    if (!quant_target(p, at, row_facts(p, at.b), &t)) continue;  // the same for every lane
    quantize_vector_warp(t, p.head_dim, p.input, p.format, lane);
  }
}

// The quantizing instantiate (quantize_prefix.h), generic: a warp a vector, every layer and slot in
// one launch, for the prefixes quantize_prefix_fixed does not take (layers of several head dims or
// input formats, a head_dim outside 32-256's powers of two). It ran at 11% of copy bandwidth,
// 6.5x the bf16 instantiate's time, on a 32-layer prefix (H100, 2026-11-27).
__global__ void __launch_bounds__(kWarps * 32)
    quantize_prefix_kernel(const __grid_constant__ QuantPrefix p) {
  const int lane = threadIdx.x % 32;
  const int64_t total = p.first_vector[p.num_layers], warps = int64_t{gridDim.x} * kWarps;
  for (int64_t i = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; i < total; i += warps) {
    const int layer = layer_of_unit(p.first_vector, p.num_layers, i);
    const QuantPrefixLayer& l = p.layers[layer];
    QuantTarget t;
    if (!quant_prefix_target(p, layer, i - p.first_vector[layer], &t)) continue;  // whole warp
    quantize_vector_warp(t, l.cache.token_bytes, l.input, l.format, lane);
  }
}

// The specialized kernel, per input and cache format and head_dim: kGroup lanes a vector, each
// reading kPer contiguous values (kLaneBytes of input) in 16-byte loads (a 128-value bf16 vector
// at 32 bytes a lane: 8 lanes of 16 values, four vectors a warp; at 64: 4 lanes of 32, eight
// vectors a warp), so that a lane's share of the index arithmetic, the page lookup and the
// shuffles is spread over its values. kPair: a lane takes the K and the V vector of one (token,
// head): one index and page lookup for both, and two independent value chains. The fp8
// conversions go two values an instruction, and x / s is one multiply and two FMAs a value
// (quotient()). (One warp a vector, 4 values a lane, a division and a software conversion a value
// spent 3-7x the bf16 append's time issuing instructions: H200, docs/quantization.md.) The values
// and the row's metadata are loaded before the page lookup; with several tokens a row, only the
// tokens within the row's count are read.
template <Format kIn, int kD, int kLaneBytes>
struct Geometry {
  static constexpr int kInBytes = kIn == Format::kF32 ? 4 : 2;
  static constexpr int kPer = kLaneBytes / kInBytes < kD ? kLaneBytes / kInBytes : kD;
  static constexpr int kGroup = kD / kPer;                              // lanes a vector
  static constexpr int kWords = kPer * kInBytes / 16;                   // 16-byte loads a lane
  static constexpr int kPerWarp = 32 / kGroup;                          // vectors a warp
  static constexpr int kOutBytes = kPer < 16 ? kPer : 16;               // bytes a store
  static constexpr int kStores = kPer / kOutBytes;                      // stores a lane
  static_assert(kD % kPer == 0 && kGroup <= 32 && kWords >= 1 && kPer % 4 == 0 && kPer <= 32,
                "quantize geometry");
};
// Input bytes a lane: the appends' and the instantiate's (perf notes items 21, 30, 33).
constexpr int kAppendLaneBytes = 32, kPrefixLaneBytes = 64;
// Vectors from which an append takes K and V a lane: below, a decode step's few thousand vectors
// are latency-bound and one vector a lane keeps each lane's chain shorter (2.66 us against 2.98
// for 256 rows x 8 heads, H100); above, sharing the setup wins (a 5000-token prefill 13.6 us
// against 14.1, 32 layers of a decode step 0.64 us a layer against 0.67; perf notes item 33).
constexpr int64_t kPairFrom = 32768;

// max |x| over n values as a tree (a chain of n dependent maxima is the lane's longest path).
template <int n>
__device__ __forceinline__ float abs_max(const float* x) {
  if constexpr (n == 1) {
    return fabsf(x[0]);
  } else {
    return fmaxf(abs_max<n / 2>(x), abs_max<n - n / 2>(x + n / 2));
  }
}

// m[0] = the largest of m[0, n): halves folded onto each other, n a compile-time constant at
// every step (a loop over n left the 16-word instantiate's array in local memory).
template <bool kPacked, int n>
__device__ __forceinline__ void fold_max(uint32_t* m) {
  if constexpr (n > 1) {
#pragma unroll
    for (int j = 0; j < n / 2; ++j)
      m[j] = kPacked ? __vmaxu2(m[j], m[j + (n + 1) / 2]) : max(m[j], m[j + (n + 1) / 2]);
    fold_max<kPacked, (n + 1) / 2>(m);
  }
}
// max |x| over a lane's kPer values, a NaN among them giving NaN (a vector holding one takes the
// checked path). |x| of a float is its bits without the sign, and non-negative floats order as
// their bits, NaN above infinity: 16-bit values go two a word by an unsigned 16-bit maximum, the
// float widened once at the end (one instruction a value where decoding each value to float and
// its maximum took two).
template <Format kIn, int kPer>
__device__ __forceinline__ float abs_max_nan(const uint4* words) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(words);
  constexpr bool kPacked = kIn != Format::kF32;
  constexpr int kN = kPacked ? kPer / 2 : kPer;
  uint32_t m[kN];
#pragma unroll
  for (int j = 0; j < kN; ++j) m[j] = u[j] & (kPacked ? 0x7fff7fffu : 0x7fffffffu);
  fold_max<kPacked, kN>(m);
  const uint32_t top = m[0];
  if (kIn == Format::kF32) return __uint_as_float(top);
  if (kIn == Format::kBF16) return __uint_as_float(max(top << 16, top & 0xffff0000u));
  const uint32_t h = max(top & 0xffffu, top >> 16);
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}

// Value j of a lane's words, as float. Decoded where it is used (for the maximum, then for its
// byte), so that the compiler need not hold kPer floats beside the words (wide: 56 registers, was
// 71 with the floats held).
template <Format kIn>
__device__ __forceinline__ float word_value(const uint4* words, int j) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(words);
  const uint32_t w = kIn == Format::kF32 ? u[j] : u[j / 2];
  if (kIn == Format::kF32) return __uint_as_float(w);
  if (kIn == Format::kBF16) return __uint_as_float(j % 2 ? w & 0xffff0000u : w << 16);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
  return j % 2 ? f.y : f.x;
}

// int8 codes of two finite values within +-127 and a rounding (a per-token scale's quotients:
// |x| / s exceeds 127 by at most s's rounding): x + 1.5 * 2^23 rounds x to the integer of
// nearest even (the sum's step is 1, and 1.5 * 2^23 is even) and holds it in its low mantissa
// bits, so that its low byte is the code. One addition a value where the conversion to integer
// (cvt.rni, a quarter of the adds' rate) took one each.
__device__ __forceinline__ uint32_t encode_pair_s8_bounded(float lo, float hi) {
  constexpr float kRound = 0x1.8p23f;  // the codes in bytes 0-1; bytes 2-3 are not cleared
  return __byte_perm(__float_as_uint(__fadd_rn(lo, kRound)), __float_as_uint(__fadd_rn(hi, kRound)),
                     0x0040);
}

// The bytes of two finite values within +-QMAX, in bytes 0-1: fp8 by one conversion (no NaN to
// take out of line), int8 by encode_pair_s8_bounded (whose bytes 2-3 are not cleared).
template <Format kOut>
__device__ __forceinline__ uint32_t encode_pair_finite(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  if constexpr (kOut == Format::kE4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
  } else if constexpr (kOut == Format::kE5M2) {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
  }
#endif
  if constexpr (kOut == Format::kS8) return encode_pair_s8_bounded(lo, hi);
  return encode_pair(lo, hi, kOut);
}

// A lane's share of kVecs vectors' scales and bytes, before it is known where they go.
template <int kPer, int kVecs>
struct Encoded {
  float s[kVecs];                   // the scales
  uint32_t packed[kVecs][kPer / 4];  // the lane's bytes of each vector
};

// The value pipeline of the specialized kernels, shared by the append and the instantiate: a lane's
// kPer values of kVecs vectors (kWords 16-byte words each) to its share of their scales (per
// token: max |x| / QMAX over the kGroup lanes of a vector; else `given`) and bytes. Every lane
// calls it (the shuffles); `ok` false: a lane whose vectors are not written (no bytes computed).
template <Format kIn, Format kOut, int kD, int kLaneBytes, int kVecs>
__device__ __forceinline__ Encoded<Geometry<kIn, kD, kLaneBytes>::kPer, kVecs> encode_words(
    const uint4 (&words)[kVecs][Geometry<kIn, kD, kLaneBytes>::kWords], const float* given,
    bool per_token, bool ok) {
  using G = Geometry<kIn, kD, kLaneBytes>;
  constexpr int kPer = G::kPer, kGroup = G::kGroup;
  Encoded<kPer, kVecs> e;
  bool finite = true;  // no NaN among the lane's values (per tensor: not known)
  float amax[kVecs];   // per token: the vectors' max |x|
  if (per_token) {  // the same for every lane
    // The vector's max |x| with NaN kept (as bits: |x| orders as its bits), then, where a warp
    // holds a NaN, the scale's own maximum, which leaves NaN out (fmaxf): the common case pays no
    // second reduction, and the encoding below no NaN test a pair. The warp's vote is on each
    // lane's own values, so that it runs beside the shuffles.
#pragma unroll
    for (int v = 0; v < kVecs; ++v) amax[v] = abs_max_nan<kIn, kPer>(words[v]);
#pragma unroll
    for (int v = 0; v < kVecs; ++v) finite = finite && !(amax[v] != amax[v]);
    const bool any_nan = __any_sync(0xffffffffu, !finite);
#pragma unroll
    for (int off = kGroup / 2; off > 0; off >>= 1)
#pragma unroll
      for (int v = 0; v < kVecs; ++v)
        amax[v] = __uint_as_float(max(__float_as_uint(amax[v]),
                                      __shfl_xor_sync(0xffffffffu, __float_as_uint(amax[v]), off)));
    if (any_nan) {  // the whole warp: the shuffles
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        float x[kPer];
#pragma unroll
        for (int j = 0; j < kPer; ++j) x[j] = word_value<kIn>(words[v], j);
        amax[v] = abs_max<kPer>(x);
      }
#pragma unroll
      for (int off = kGroup / 2; off > 0; off >>= 1)
#pragma unroll
        for (int v = 0; v < kVecs; ++v)
          amax[v] = fmaxf(amax[v], __shfl_xor_sync(0xffffffffu, amax[v], off));
    }
    constexpr int kQmax = static_cast<int>(format_max(kOut));
#pragma unroll
    for (int v = 0; v < kVecs; ++v) e.s[v] = scale_quotient<kQmax>(amax[v]);  // in range: below
  } else {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) e.s[v] = given[v];
  }
  if (!ok) return e;
  // The bytes of x / s (quantize_value); `divide` gives x / s, `bounded`: finite and within
  // +-QMAX.
  auto encode_all = [&](auto divide, auto bounded) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
#pragma unroll
      for (int j = 0; j < kPer; j += 2) {
        const float lo = divide(v, word_value<kIn>(words[v], j));
        const float hi = divide(v, word_value<kIn>(words[v], j + 1));
        const uint32_t pair = decltype(bounded)::value ? encode_pair_finite<kOut>(lo, hi)
                                                         : encode_pair(lo, hi, kOut);
        if (kOut == Format::kS8 && decltype(bounded)::value) {  // its pair's bytes 0-1 only
          e.packed[v][j / 4] = j % 4 ? __byte_perm(e.packed[v][j / 4], pair, 0x5410) : pair;
        } else {
          e.packed[v][j / 4] = j % 4 ? e.packed[v][j / 4] | (pair << 16) : pair;
        }
      }
    }
  };
  // x / s by the reciprocal for every per-token scale of ordinary data (|x| / s <= QMAX, no NaN),
  // else (a scale given per tensor; a zero, huge, tiny or non-finite one; a NaN among the lane's
  // own values, where its vector's other lanes stay on this path) by the division itself, a NaN
  // keeping the sign it arrives with (as on the host).
  bool fast = per_token && finite;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) fast = fast && e.s[v] >= kQuotientMin && e.s[v] <= kQuotientMax;
  if (!fast && per_token) {  // a scale out of scale_quotient's range: the division itself
#pragma unroll
    for (int v = 0; v < kVecs; ++v) e.s[v] = amax[v] / format_max(kOut);
  }
  if (fast) {
    float r[kVecs];
#pragma unroll
    for (int v = 0; v < kVecs; ++v) r[v] = reciprocal(e.s[v]);
    encode_all([&](int v, float x) { return quotient(x, e.s[v], r[v]); }, std::true_type{});
  } else {
    encode_all([&](int v, float x) { return e.s[v] > 0.f ? copysignf(x / e.s[v], x) : 0.f; },
               std::false_type{});
  }
  return e;
}

// The lane's share of encode_words' result into its vectors' places (`ok` false: nowhere).
template <Format kIn, Format kOut, int kD, int kLaneBytes, int kVecs>
__device__ __forceinline__ void store_encoded(const Encoded<Geometry<kIn, kD, kLaneBytes>::kPer, kVecs>& e,
                                              const QuantTarget* t, bool ok, bool per_token, int sub) {
  using G = Geometry<kIn, kD, kLaneBytes>;
  using Out = typename Word<G::kOutBytes>::type;
  if (!ok) return;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    if (per_token && sub == 0) store_word(t[v].scale, e.s[v]);
    Out out[G::kStores];
    memcpy(out, e.packed[v], sizeof(out));
    Out* dst = reinterpret_cast<Out*>(t[v].dst) + sub * G::kStores;
#pragma unroll
    for (int j = 0; j < G::kStores; ++j) store_word(dst + j, out[j]);
  }
}

// Warps a block of the specialized append: 4 for the K-and-V-a-lane path, whose grid is thousands
// of blocks (a finished warp's place is taken sooner: the 5000-token prefill 1-2% faster than at
// 8, H200, perf notes item 51), 8 for the smaller appends (a decode step's 4096 vectors: 1% faster
// at 8).
constexpr int append_block_warps(bool pair) { return pair ? 4 : kWarps; }
// Blocks a multiprocessor the compiler is asked to fit (its register budget): 1 for the smaller
// appends, which then take 52 registers instead of 48 and run a decode step's append 4% faster;
// none (0) for the pair path, where the same hint (72-76 registers, fewer warps) made the int8
// prefill 6% slower (H200, perf notes item 51).
constexpr int append_min_blocks(bool pair) { return pair ? 0 : 1; }

template <Format kIn, Format kOut, int kD, bool kPair>
__global__ void __launch_bounds__(append_block_warps(kPair) * 32, append_min_blocks(kPair))
    quantize_kernel_fixed(const QuantAppend p, const VectorDivs divs) {
  using G = Geometry<kIn, kD, kAppendLaneBytes>;
  constexpr int kGroup = G::kGroup, kWords = G::kWords, kPerWarp = G::kPerWarp;
  constexpr int kVecs = kPair ? 2 : 1, kBlockWarps = append_block_warps(kPair);
  const int lane = threadIdx.x % 32, sub = lane % kGroup;
  const uint32_t units = static_cast<uint32_t>(kPair ? p.vectors() / 2 : p.vectors());
  const uint32_t warps = gridDim.x * kBlockWarps;
  // Whole warps go round together (every lane takes part in the shuffles); a lane past the end,
  // or whose vector is not written, computes and writes nothing.
  for (uint32_t w = blockIdx.x * kBlockWarps + threadIdx.x / 32; w * kPerWarp < units; w += warps) {
    const uint32_t i = w * kPerWarp + lane / kGroup;
    const bool in = i < units;
    const uint32_t at_i = in ? i : units - 1;
    const VectorIndex at = vector_index<!kPair>(divs, at_i);
    const uint4* src = reinterpret_cast<const uint4*>(quant_source(p, at)) + sub * kWords;
    const ptrdiff_t v_off = kPair ? p.v - p.k : 0;  // V's source beside K's
    uint4 words[kVecs][kWords];
    auto load = [&](bool live) {
#pragma unroll
      for (int v = 0; v < kVecs; ++v)
#pragma unroll
        for (int j = 0; j < kWords; ++j)
          words[v][j] = live ? load_word(reinterpret_cast<const uint4*>(
                                             reinterpret_cast<const char*>(src + j) + v * v_off))
                             : uint4{};
    };
    if (p.tokens == 1) load(in);  // a decode step: in flight beside the metadata
    // The row's metadata in one round trip: the page lookup waits on its length, the data's
    // load on its count.
    const RowFacts row{__ldg(p.layer), __ldg(p.lengths + at.b),
                       p.counts ? __ldg(p.counts + at.b) : p.tokens,
                       p.active ? __ldg(p.active) : p.batch};
    if (p.tokens != 1) {
      // Ragged rows: a warp whose vectors all lie past their rows' counts (a padded prefill's
      // tail) does nothing, and the padding is not read.
      if (p.counts && __all_sync(0xffffffffu, !in || at.t >= row.count)) continue;
      load(in && at.t < row.count);
    }
    const bool per_token = !p.tensor_k_scale;
    QuantTarget t[kVecs];
    if constexpr (kPair) {
      // Where the vectors go, then their scales and bytes. (Computing those while the page
      // lookup is in flight slowed the fp8 prefill by 1.2 us: perf notes item 33.)
      const bool ok = in && quant_target(p, at, row, &t[0]);
      if (ok) t[1] = v_target(p, t[0], row.layer + at.n);
      const float given[2] = {ok ? t[0].given : 0.f, ok ? t[1].given : 0.f};
      const auto e = encode_words<kIn, kOut, kD, kAppendLaneBytes, 2>(words, given, per_token, ok);
      store_encoded<kIn, kOut, kD, kAppendLaneBytes, 2>(e, t, ok, per_token, sub);
    } else {
      // A decode step: the page entry in flight, and everything that needs no page computed,
      // while the scale and bytes are computed (a vector not written computes none); then the
      // entry checked.
      const QuantSlot slot = quant_slot(p, at, row);
      const bool writes = in && slot.writes;
      const float given[1] = {slot.given};
      const auto e =
          encode_words<kIn, kOut, kD, kAppendLaneBytes, 1>(words, given, per_token, writes);
      const bool ok = writes && quant_target(p, slot, &t[0]);
      store_encoded<kIn, kOut, kD, kAppendLaneBytes, 1>(e, t, ok, per_token, sub);
    }
  }
}

// The instantiate's specialized kernel: 64 bytes a lane (a prefix is thousands of vectors a layer),
// every layer of one input format and head_dim. Consecutive vectors are consecutive tokens of one
// head, contiguous in the prefix and in the cache row.
template <Format kIn, Format kOut, int kD>
__global__ void __launch_bounds__(kWarps * 32)
    quantize_prefix_fixed(const __grid_constant__ QuantPrefix p) {
  using G = Geometry<kIn, kD, kPrefixLaneBytes>;
  constexpr int kGroup = G::kGroup, kWords = G::kWords, kPerWarp = G::kPerWarp;
  const int lane = threadIdx.x % 32, sub = lane % kGroup;
  const int64_t total = p.first_vector[p.num_layers], warps = int64_t{gridDim.x} * kWarps;
  for (int64_t w = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; w * kPerWarp < total; w += warps) {
    const int64_t i = w * kPerWarp + lane / kGroup;
    QuantTarget t;
    bool ok = false;
    if (i < total) {
      const int layer = layer_of_unit(p.first_vector, p.num_layers, i);
      ok = quant_prefix_target(p, layer, i - p.first_vector[layer], &t);
    }
    uint4 words[1][kWords];
    const uint4* src = ok ? reinterpret_cast<const uint4*>(t.src) + sub * kWords : nullptr;
#pragma unroll
    for (int j = 0; j < kWords; ++j) words[0][j] = ok ? load_word(src + j) : uint4{};
    const bool per_token = p.given == nullptr;
    const float given = ok ? t.given : 0.f;
    const auto e = encode_words<kIn, kOut, kD, kPrefixLaneBytes, 1>(words, &given, per_token, ok);
    store_encoded<kIn, kOut, kD, kPrefixLaneBytes, 1>(e, &t, ok, per_token, sub);
  }
}

// Calls l.template go<kIn, kOut, kD>() for a specialized kernel's input format, cache format and
// head_dim; false where head_dim has none (the generic kernel's case).
template <Format kIn, Format kOut, class L>
bool with_head_dim(int head_dim, const L& l) {
  switch (head_dim) {
    case 32: l.template go<kIn, kOut, 32>(); return true;
    case 64: l.template go<kIn, kOut, 64>(); return true;
    case 128: l.template go<kIn, kOut, 128>(); return true;
    case 256: l.template go<kIn, kOut, 256>(); return true;
    default: return false;
  }
}

template <Format kIn, class L>
bool with_format(Format format, int head_dim, const L& l) {
  switch (format) {
    case Format::kE4M3: return with_head_dim<kIn, Format::kE4M3>(head_dim, l);
    case Format::kE5M2: return with_head_dim<kIn, Format::kE5M2>(head_dim, l);
    default: return with_head_dim<kIn, Format::kS8>(head_dim, l);
  }
}

template <class L>
bool with_formats(Format input, Format format, int head_dim, const L& l) {
  switch (input) {
    case Format::kF32: return with_format<Format::kF32>(format, head_dim, l);
    case Format::kBF16: return with_format<Format::kBF16>(format, head_dim, l);
    default: return with_format<Format::kF16>(format, head_dim, l);
  }
}

struct AppendLaunch {
  cudaStream_t stream;
  const QuantAppend& p;
  const VectorDivs& d;
  template <Format kIn, Format kOut, int kD, bool kPair>
  void launch() const {
    constexpr int kBlockWarps = append_block_warps(kPair);
    const int64_t per_block = Geometry<kIn, kD, kAppendLaneBytes>::kPerWarp * kBlockWarps;
    const int64_t units = kPair ? p.vectors() / 2 : p.vectors();
    const int64_t blocks = std::min<int64_t>((units + per_block - 1) / per_block, 1 << 20);
    quantize_kernel_fixed<kIn, kOut, kD, kPair>
        <<<static_cast<unsigned>(blocks), kBlockWarps * 32, 0, stream>>>(p, d);
  }
  template <Format kIn, Format kOut, int kD>
  void go() const {
    if (p.vectors() >= kPairFrom)
      launch<kIn, kOut, kD, true>();
    else
      launch<kIn, kOut, kD, false>();
  }
};

struct PrefixLaunch {
  cudaStream_t stream;
  const QuantPrefix& p;
  template <Format kIn, Format kOut, int kD>
  void go() const {
    const int64_t per_block = Geometry<kIn, kD, kPrefixLaneBytes>::kPerWarp * kWarps;
    const int64_t vectors = p.first_vector[p.num_layers];
    const int64_t blocks = std::min<int64_t>((vectors + per_block - 1) / per_block, 1 << 20);
    quantize_prefix_fixed<kIn, kOut, kD><<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream>>>(p);
  }
};

ffi::Error launch(cudaStream_t stream, const QuantAppend& p, const char* op) {
  if (p.head_dim > 32 * kMaxValuesPerLane) return invalid(op, "head_dim above 256");
  const int64_t blocks = (p.vectors() + kWarps - 1) / kWarps;
  if (blocks == 0) return ffi::Error::Success();
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(blocks, 1 << 20));
  if (p.vectors() < (int64_t{1} << 31)) {
    const VectorDivs d{FastDiv(static_cast<uint32_t>(p.tokens)), FastDiv(static_cast<uint32_t>(p.heads)),
                       FastDiv(static_cast<uint32_t>(p.batch))};
    if (with_formats(p.input, p.format, p.head_dim, AppendLaunch{stream, p, d})) return cuda_status(op);
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
                                 ffi::Result<ffi::AnyBuffer> v_scales, bool per_token,
                                 bool ring) {
  const int32_t layout = static_cast<int32_t>(ring ? KVLayout::kDenseRing : KVLayout::kDense);
  auto p = make_quant_append("append_quantized", layout, k, v, nullptr, lengths, counts, &active,
                             layer, *cache, *cache, *k_scales, *v_scales, per_token);
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

ffi::Error quantize_prefix_cuda(cudaStream_t stream, ffi::Buffer<ffi::S32> slots,
                                ffi::Buffer<ffi::F32> given, ffi::RemainingArgs args,
                                ffi::RemainingRets rets, int64_t rows) {
  QuantPrefix p;
  if (auto e = describe_quant_prefix(slots, given, args, rets, rows, &p); e.failure()) return e;
  const int64_t blocks = (p.first_vector[p.num_layers] + kWarps - 1) / kWarps;
  if (blocks == 0) return ffi::Error::Success();
  bool uniform = true;  // every layer of one input format and head_dim: the specialized kernel
  for (int l = 1; l < p.num_layers; ++l)
    uniform = uniform && p.layers[l].input == p.layers[0].input &&
              p.layers[l].cache.token_bytes == p.layers[0].cache.token_bytes;
  if (uniform && with_formats(p.layers[0].input, p.layers[0].format,
                              p.layers[0].cache.token_bytes, PrefixLaunch{stream, p}))
    return cuda_status("quantize_prefix");
  quantize_prefix_kernel<<<static_cast<unsigned>(std::min<int64_t>(blocks, 1 << 20)), kWarps * 32, 0,
                           stream>>>(p);
  return cuda_status("quantize_prefix");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxkv_quantize_prefix_cuda, NoThrow<quantize_prefix_cuda>::call,
    bind_quantize_prefix(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    JAXKV_CUDA_TRAITS);
JAXKV_REGISTER_TARGET("jaxkv_quantize_prefix", "CUDA", jaxkv_quantize_prefix_cuda);
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxkv_append_quantized_cuda, NoThrow<append_quantized_cuda>::call,
    bind_append_quantized(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    JAXKV_CUDA_TRAITS);
JAXKV_REGISTER_TARGET("jaxkv_append_quantized", "CUDA", jaxkv_append_quantized_cuda);
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxkv_paged_append_quantized_cuda, NoThrow<paged_append_quantized_cuda>::call,
    bind_paged_append_quantized(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    JAXKV_CUDA_TRAITS);
JAXKV_REGISTER_TARGET("jaxkv_paged_append_quantized", "CUDA", jaxkv_paged_append_quantized_cuda);

}  // namespace jaxkv
