// CUDA split-KV attention (flash-decoding) over the cache in place: decode, and prefill where the
// tensor-core prefill does not apply (attention_prefill.cu).
//
// Block (query row r = (b, t), KV head group, split) attends the keys [k0, k1) of split z of the
// query's window [first_key, keys) (AttentionProblem), cut into runs of keys_per_split =
// ceil(span / splits) keys from first_key (split_keys: the one rule of the kernels and
// combine_kernel). Keys before the window are never read: their pages may be unmapped or reused.
// Three kernels share that grid and the workspace: attention_tc_kernel below (tensor cores) for
// bf16 / f16 caches with head dims 64, 128 and 256; attention_tc8_kernel (tensor cores, f16
// MMAs) for 8-bit caches (fp8 e4m3 / e5m2, int8) under a bf16 / f16 q with head dims 64 and 128;
// attention_kernel (CUDA cores) for the rest (f32, other head dims). Both kernels that read 8-bit
// caches apply their per-token scales: the key's to its score, the value's to its weight.
// attention_kernel takes up to kMaxHeads q heads of one KV head (the GQA group shares every K/V
// load). A warp takes kTokensPerWarp tokens at a time, each over kLanesPerToken lanes with
// 16-byte loads (8 for fp8), kUnroll groups of tokens in flight; scores and the softmax run in
// float32, base 2 (q pre-scaled by scale * log2 e * k_scale), with an online max per lane group,
// merged through shuffles and shared memory at the end. (A cp.async ring in shared memory made it
// slower on the H200: fewer resident warps for a kernel bound by issuing its math;
// docs/perf-notes.md.)
// A soft cap (p.soft_cap > 0) caps each final score (after the per-token K scale) at
// soft_cap * log2 e, the scores' base-2 units, before the running max (tanhf for a float32 q,
// else tanh.approx): a template flag of attention_kernel and attention_tc_kernel (a runtime
// branch cost their plain paths registers or predicated instructions), a uniform branch once per
// stage in attention_tc8_kernel.
// One split: the block writes the output. Several: it writes (unnormalized acc, max, sum) to the
// workspace and combine_kernel merges the live splits. A head's sink enters only at that final
// normalization (sink_norm). Keys outside the window are never loaded, so a block past it exits
// at once: time follows the bytes in the window.
#include <algorithm>
#include <cfloat>

#include "attention_device.cuh"

namespace jaxkv {
namespace {

constexpr int kUnroll = 4;

// A pair of per-head values (the tensor-core kernels' two heads of lane tq) reduced by op over
// the 8 lanes g = lane / 4 that hold the same heads' other keys.
template <class Op>
__device__ __forceinline__ void over_keys(float& x0, float& x1, Op op) {
#pragma unroll
  for (int x = 4; x < 32; x *= 2) {
    x0 = op(x0, __shfl_xor_sync(0xffffffffu, x0, x));
    x1 = op(x1, __shfl_xor_sync(0xffffffffu, x1, x));
  }
}

// Element types and their vector loads: kElems elements per word W.
template <class T> struct Elem;
template <> struct Elem<float> {
  using W = uint4;
  static constexpr int kElems = 4;
  __device__ static void to_float(const W& w, float* f) {
    f[0] = __uint_as_float(w.x), f[1] = __uint_as_float(w.y);
    f[2] = __uint_as_float(w.z), f[3] = __uint_as_float(w.w);
  }
  __device__ static float load1(const float* p) { return *p; }
  __device__ static void store1(float* p, float f) { *p = f; }
};
template <> struct Elem<__nv_bfloat16> {
  using W = uint4;
  static constexpr int kElems = 8;
  __device__ static void to_float(const W& w, float* f) {
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) f[2 * i] = __uint_as_float(u[i] << 16), f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
  __device__ static float load1(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  __device__ static void store1(__nv_bfloat16* p, float f) { *p = __float2bfloat16_rn(f); }
};
template <> struct Elem<__half> {
  using W = uint4;
  static constexpr int kElems = 8;
  __device__ static void to_float(const W& w, float* f) {
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      memcpy(&h, &u[i], 4);
      const float2 x = __half22float2(h);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
  __device__ static float load1(const __half* p) { return __half2float(*p); }
  __device__ static void store1(__half* p, float f) { *p = __float2half_rn(f); }
};
template <__nv_fp8_interpretation_t kKind> struct Fp8 {
  using W = uint2;
  static constexpr int kElems = 8;
  __device__ static void to_float(const W& w, float* f) {
    const uint32_t u[2] = {w.x, w.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>((u[i] >> (16 * j)) & 0xffffu), kKind);
        __half2 h;
        memcpy(&h, &r, 4);
        const float2 x = __half22float2(h);
        f[4 * i + 2 * j] = x.x, f[4 * i + 2 * j + 1] = x.y;
      }
    }
  }
};
template <> struct Elem<E4M3> : Fp8<__NV_E4M3> {};
template <> struct Elem<E5M2> : Fp8<__NV_E5M2> {};
template <> struct Elem<S8> {
  using W = uint2;
  static constexpr int kElems = 8;
  __device__ static void to_float(const W& w, float* f) {
    const uint32_t u[2] = {w.x, w.y};
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(static_cast<int8_t>(u[i / 4] >> (8 * (i % 4))));
  }
};
template <int kD, class KT>
struct Geometry {
  static constexpr int kElems = Elem<KT>::kElems;
  static constexpr int kVecs = kD / kElems;                             // words per token
  static constexpr int kLanes = kVecs < 32 ? kVecs : 32;                // lanes per token
  static constexpr int kVecsPerLane = kVecs / kLanes;
  static constexpr int kPerLane = kVecsPerLane * kElems;               // floats per lane
  static constexpr int kTokensPerWarp = 32 / kLanes;
  static constexpr int kStep = kWarps * kTokensPerWarp;               // tokens per block step
  static_assert(kVecs * kElems == kD && kVecs % kLanes == 0, "head_dim must be a multiple of the word");
};

// q heads one block takes: the GQA group, in blocks of at most kMaxHeads, rounded up to 1, 4 or
// 8 (kernels are compiled for those; fewer registers let more blocks load at once).
inline int block_heads(int group) { return group <= 1 ? 1 : group <= 4 ? 4 : kMaxHeads; }

// First q head of block y (KV head y / head_blocks), and how many (<= kHeads).
template <int kHeads>
__device__ __forceinline__ int heads_of(const AttentionProblem& p, int y, int* first) {
  const int head_blocks = (p.group + kHeads - 1) / kHeads;
  const int kvh = y / head_blocks, hb = y % head_blocks;
  *first = kvh * p.group + hb * kHeads;
  return min(kHeads, p.group - hb * kHeads);
}

// Split z's keys of query (b, t): its window [first_key, keys) cut into runs of kps keys from
// first_key, [k0, k1) (k0 >= k1: none, a split past the window). Returns the live splits, those
// with a key: a prefix, z < live. The one rule of the split kernels and combine_kernel, so that
// combine reads exactly the splits that wrote the workspace. (first_key is read whatever the
// layer: a layer out of range has n = 0, so no live split. k0 is not clamped to n: clamped, it
// cost attention_kernel up to 20 registers. k0 + kps < first + span + splits: no overflow for
// capacities below 2^30.)
__device__ __forceinline__ int split_keys(const AttentionProblem& p, int b, int t, int32_t kps, int z,
                                          int splits, int32_t* k0, int32_t* k1) {
  const int32_t n = p.layer_ok() ? p.keys(b, t) : 0;
  const int32_t first = p.first_key(b, t, *p.window);
  *k0 = first + z * kps;
  *k1 = min(n, *k0 + kps);
  return n > first ? min(splits, (n - first - 1) / kps + 1) : 0;
}

// Keys a split takes (the launchers and combine_kernel): the splits cover the widest window,
// span keys (span 0: no query sees a key, and any positive size will do).
inline int32_t keys_per_split(const AttentionProblem& p, int splits) {
  return (std::max(p.span, 1) + splits - 1) / splits;
}

// A split-KV block's share of the grid (split_grid): query row (b, t) and q heads [h0, h0 + nh)
// of KV head kvh (at most kHeads of the GQA group) from block x, the keys [k0, k1) of split z
// (split_keys).
struct SplitBlock {
  int b, t, h0, nh, kvh, split, splits;
  int32_t k0, k1;
};

// The split-KV grid of head_blocks blocks a KV head: x the (row, KV head, head block) triples,
// heads fastest, z the splits. The blocks of one row's heads start together: in an NHD page the
// heads of a token lie side by side (and so do their scales), read at about the same time.
inline dim3 split_grid(const AttentionProblem& p, int head_blocks, int splits) {
  return dim3(static_cast<unsigned>(int64_t{p.batch} * p.tokens * p.kv.heads * head_blocks), 1,
              static_cast<unsigned>(splits));
}

template <int kHeads>
__device__ __forceinline__ SplitBlock split_block(const AttentionProblem& p, int32_t keys_per_split) {
  SplitBlock s;
  const int per_row = p.kv.heads * ((p.group + kHeads - 1) / kHeads);
  const int row = blockIdx.x / per_row;
  s.split = blockIdx.z;
  s.splits = gridDim.z;
  s.b = row / p.tokens, s.t = row % p.tokens;
  s.nh = heads_of<kHeads>(p, blockIdx.x % per_row, &s.h0);
  s.kvh = s.h0 / p.group;
  split_keys(p, s.b, s.t, keys_per_split, s.split, s.splits, &s.k0, &s.k1);
  return s;
}

// True where the block has no key to read: with one split it owns the output and writes zeros
// (no key in the window: zeros with a sink too); with several, combine_kernel reads only the
// live splits.
template <int kD, class QT>
__device__ __forceinline__ bool empty_split(const AttentionProblem& p, const SplitBlock& s) {
  if (s.k0 < s.k1) return false;
  if (s.splits == 1) {
    QT* out = reinterpret_cast<QT*>(p.out);
    for (int i = threadIdx.x; i < s.nh * kD; i += kThreads)
      Elem<QT>::store1(out + p.q_index(s.b, s.t, s.h0 + i / kD) + i % kD, 0.f);
  }
  return true;
}

// kCap: scores soft-capped (p.soft_cap > 0). A compile-time flag: a runtime branch in the loop
// cost the plain path 10-30 registers (an occupancy step in several instantiations).
template <int kD, int kHeads, class QT, class KT, bool kCap>
__global__ void __launch_bounds__(kThreads)
    attention_kernel(const AttentionProblem p, int32_t keys_per_split, float* work) {
  using G = Geometry<kD, KT>;
  using W = typename Elem<KT>::W;
  const SplitBlock blk = split_block<kHeads>(p, keys_per_split);
  if (empty_split<kD, QT>(p, blk)) return;
  const auto [b, t, h0, nh, kvh, split, splits, k0, k1] = blk;
  QT* out = reinterpret_cast<QT*>(p.out);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane / G::kLanes, part = lane % G::kLanes;
  const int64_t layer = *p.layer;

  // This lane's slice of each q head, pre-scaled.
  float q[kHeads][G::kPerLane];
  const float qscale = p.scale * kLog2e * *p.k_scale;
  const QT* qp = reinterpret_cast<const QT*>(p.q);
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
#pragma unroll
    for (int v = 0; v < G::kVecsPerLane; ++v) {
#pragma unroll
      for (int e = 0; e < G::kElems; ++e) {
        const int d = (v * G::kLanes + part) * G::kElems + e;
        q[g][v * G::kElems + e] = g < nh ? Elem<QT>::load1(qp + p.q_index(b, t, h0 + g) + d) * qscale : 0.f;
      }
    }
  }
  float m[kHeads], l[kHeads], acc[kHeads][G::kPerLane];
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    m[g] = -INFINITY, l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < G::kPerLane; ++i) acc[g][i] = 0.f;
  }

  const bool token_scales = p.scales.k != nullptr;  // an 8-bit cache scaled per token and head
  // The soft cap in the scores' units (scale * log2 e * k_scale folded into q: log2 e).
  const float cap = p.soft_cap * kLog2e, inv_cap = 1.f / cap;
  // it counts from 0, uniform: the thread's first token jt carries k0 (from memory, per block).
  const int32_t jt = k0 + warp * G::kTokensPerWarp + sub;
  for (int32_t it = 0; it < k1 - k0; it += G::kStep * kUnroll) {
    W kw[kUnroll][G::kVecsPerLane], vw[kUnroll][G::kVecsPerLane];
    bool live[kUnroll];
    float ks[kUnroll], vs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int32_t j = jt + it + u * G::kStep;
      const int32_t page = j < k1 ? p.kv.page(b, j) : -1;
      const int64_t off = page < 0 ? -1 : p.kv.at(layer, page, kvh, j);
      live[u] = off >= 0;
      ks[u] = vs[u] = 1.f;
      if (token_scales && live[u]) {
        const int64_t so = p.scales.at(layer, page, kvh, j);
        ks[u] = p.scales.k_float(so), vs[u] = p.scales.v_float(so);
      }
#pragma unroll
      for (int v = 0; v < G::kVecsPerLane; ++v) {
        const int64_t o = off + int64_t{(v * G::kLanes + part)} * sizeof(W);
        kw[u][v] = live[u] ? load_word(reinterpret_cast<const W*>(p.kv.k + o)) : W{};
        vw[u][v] = live[u] ? load_word(reinterpret_cast<const W*>(p.kv.v + o)) : W{};
      }
    }
    float s[kUnroll][kHeads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[G::kPerLane];
#pragma unroll
      for (int v = 0; v < G::kVecsPerLane; ++v) Elem<KT>::to_float(kw[u][v], kf + v * G::kElems);
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < G::kPerLane; ++i) dot = fmaf(q[g][i], kf[i], dot);
#pragma unroll
        for (int o = G::kLanes / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        float sc = dot * ks[u];  // the final score: capped here, dead tokens at -inf
        if constexpr (kCap) sc = soft_capped<std::is_same_v<QT, float>>(sc, cap, inv_cap);
        s[u][g] = live[u] ? sc : -INFINITY;
      }
    }
#pragma unroll
    for (int g = 0; g < kHeads; ++g) {
      if (g >= nh) continue;
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) mx = fmaxf(mx, s[u][g]);
      if (mx == -INFINITY) continue;  // no live token yet
      const float rescale = exp2f(m[g] - mx);
      m[g] = mx;
      l[g] *= rescale;
#pragma unroll
      for (int i = 0; i < G::kPerLane; ++i) acc[g][i] *= rescale;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float pr = exp2f(s[u][g] - mx);
        l[g] += pr;
        const float pv = pr * vs[u];  // V's scale folded into the weight
        float vf[G::kPerLane];
#pragma unroll
        for (int v = 0; v < G::kVecsPerLane; ++v) Elem<KT>::to_float(vw[u][v], vf + v * G::kElems);
#pragma unroll
        for (int i = 0; i < G::kPerLane; ++i) acc[g][i] = fmaf(pv, vf[i], acc[g][i]);
      }
    }
  }

  // Merge the lane groups of a warp (same part, different sub), then the warps through smem.
  __shared__ float sm_acc[kWarps][kHeads][kD];
  __shared__ float sm_m[kWarps][kHeads], sm_l[kWarps][kHeads];
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    float mx = m[g];
#pragma unroll
    for (int o = G::kLanes; o < 32; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float r = mx == -INFINITY ? 0.f : exp2f(m[g] - mx);
    float lg = l[g] * r;
#pragma unroll
    for (int o = G::kLanes; o < 32; o *= 2) lg += __shfl_xor_sync(0xffffffffu, lg, o);
#pragma unroll
    for (int i = 0; i < G::kPerLane; ++i) {
      float a = acc[g][i] * r;
#pragma unroll
      for (int o = G::kLanes; o < 32; o *= 2) a += __shfl_xor_sync(0xffffffffu, a, o);
      acc[g][i] = a;
    }
    if (sub == 0) {
#pragma unroll
      for (int v = 0; v < G::kVecsPerLane; ++v)
#pragma unroll
        for (int e = 0; e < G::kElems; ++e)
          sm_acc[warp][g][(v * G::kLanes + part) * G::kElems + e] = acc[g][v * G::kElems + e];
      if (part == 0) sm_m[warp][g] = mx, sm_l[warp][g] = lg;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nh * kD; i += kThreads) {
    const int g = i / kD, d = i % kD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float a = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float r = sm_m[w][g] == -INFINITY ? 0.f : exp2f(sm_m[w][g] - mx);
      a += sm_acc[w][g][d] * r;
      sum += sm_l[w][g] * r;
    }
    if (splits == 1) {
      const float o = a * sink_norm(mx, sum, sink_log2(p, h0 + g)) * *p.v_scale;
      Elem<QT>::store1(out + p.q_index(b, t, h0 + g) + d, o);
    } else {
      // workspace [B, T, Hq, splits, D + 2]: acc, then max and sum
      float* w = work + (p.q_index(b, t, h0 + g) / kD * splits + split) * (kD + 2);
      w[d] = a;
      if (d == 0) w[kD] = mx, w[kD + 1] = sum;
    }
  }
}

// --- split-KV on tensor cores (bf16 / f16 caches read by the same-dtype q, head dims 64-256) ------
//
// The same blocks and splits as attention_kernel, with the math on mma.sync m16n8k16, the keys as
// the MMA's 16 rows and up to kTcN = 8 q heads of the GQA group as its 8 columns: S^T = K Q^T
// (A: a K tile read by ldmatrix, B: Q's fragments in registers), then O^T += V^T P^T (A: the V
// tile read transposed, B: P^T, the S^T fragments moved across the warp by movmatrix). A group of
// 8 or fewer heads fills the MMA (with the heads as the 16 rows it filled a quarter of them at a
// group of 4), so the MMAs and O's registers are half those of the heads-as-rows kernel
// (docs/perf-notes.md item 20). A stage is 16 tokens for each slice of kSplitD warps, streamed with
// cp.async into a ring of kStages tiles (rows of D elements, 16-byte chunks XOR-swizzled by row
// so that ldmatrix is conflict-free); kTcLanes threads copy a token and the warps read each
// other's tokens, so the ring needs a block barrier per stage. At head_dim 256 two warps share a
// slice (kSplitD 2): both score its 16 tokens, each accumulates half of O, so a warp holds at
// most 32 of O's floats and a stage is 32 tokens (32 KiB: three blocks per multiprocessor).
constexpr int kTcN = 8;
// The ring's depth and the blocks a multiprocessor keeps, by the grid (try_split_tc). Two stages
// (one in flight while one is read) at three blocks a multiprocessor, measured on the H200 for the
// heads-as-rows kernel against 3 stages x 2 blocks (326 vs 310 us on the paged case), 3 x 3
// (327), 4 x 2 (577: one block per SM), and against 2x / 4x more splits (330 / 399 us: shorter
// pipelines per block). But where the grid takes two waves at either occupancy (more than 3
// blocks a multiprocessor, at most 4), three stages at two blocks, cuDNN's occupancy: each block's
// pipeline deeper at no cost in waves (B56 / B64 rows of 8 KV heads at D128, D256 B128 of 4:
// 2-3% faster; past 4 blocks a multiprocessor 0-2% slower: docs/perf-notes.md item 39).
template <int kStages_, int kMinBlocks_>
struct TcDepth {
  static constexpr int kStages = kStages_, kMinBlocks = kMinBlocks_;
};
using TcShallow = TcDepth<2, kDecodeResidentBlocks>;
using TcDeep = TcDepth<3, 2>;
// Threads that copy one token's K and V (kTcLanes 16-byte chunks a copy instruction), measured on
// the H200 (docs/perf-notes.md item 17): 8 against 16, 4 and 2.
constexpr int kTcLanes = 8;
// The 8-bit kernel below: 64-token stages, 16 tokens a warp.
constexpr int kTcTokens = 64;

template <int kD, class T, int kTokens, int kStages>
struct TcRing {
  static constexpr int kChunks = kD * 2 / 16;                      // 16-byte chunks per token
  static constexpr size_t kTile = size_t{kTokens} * kD * 2;        // bytes of K (or V) per stage
  static constexpr size_t kLive = 2 * kTile * kStages;             // byte offset of the live flags
  static constexpr size_t kRingBytes = kLive + sizeof(int) * kTokens * kStages;
  static_assert(kChunks % 8 == 0, "swizzle");
  // Chunk c of token j of K (kind 0) or V (kind 1) in stage `stage`.
  __device__ static unsigned char* chunk(unsigned char* smem, int stage, int kind, int j, int c) {
    return smem + (stage * 2 + kind) * kTile + (static_cast<size_t>(j) * kChunks + (c ^ (j & 7))) * 16;
  }
  __device__ static int* live(unsigned char* smem, int stage) {
    return reinterpret_cast<int*>(smem + kLive) + stage * kTokens;
  }
};

// The copies of a tensor-core split-KV block into its ring, a stage of kTokens tokens at a time:
// kLanes threads take a token, kLanes consecutive 16-byte chunks per instruction (16 kLanes
// contiguous bytes), kTokens * kLanes / kThreads tokens a stage each, one table entry and one
// address per token; the entries are loaded a stage ahead. kLanes is a tuning knob
// (docs/perf-notes.md item 17): fewer lanes per token, fewer lookups, shorter contiguous runs.
template <int kLanes, int kChunks, int kTokens>
struct TcCopy {
  static constexpr int kPerPass = kThreads / kLanes;  // tokens per pass
  static constexpr int kPasses = kTokens / kPerPass;  // tokens per thread and stage
  static_assert(kTokens % kPerPass == 0 && kChunks % kLanes == 0, "copy geometry");
  const int32_t* table;  // the row's page-table row; null: a dense cache (the row is the page)
  int32_t b, k0, k1, iters;
  int c0, jt0;           // this thread's chunk in a token, and its token in a pass
  int32_t raw[kPasses];  // table entries of the next stage to issue, loads in flight

  __device__ TcCopy(const AttentionProblem& p, int32_t b, int32_t k0, int32_t k1, int iters)
      : table(p.kv.page_table ? p.kv.page_table + int64_t{b} * p.kv.max_pages : nullptr),
        b(b), k0(k0), k1(k1), iters(iters), c0(threadIdx.x % kLanes), jt0(threadIdx.x / kLanes) {}

  // Loads the table entries of stage i's tokens (-1: past the split, or no stage i).
  __device__ void fetch(const KVView& kv, int i) {
#pragma unroll
    for (int x = 0; x < kPasses; ++x) {
      const int32_t j = k0 + i * kTokens + x * kPerPass + jt0;
      raw[x] = i < iters && j < k1 ? (table ? table[kv.column(j)] : b) : -1;
    }
  }
  // f(jt, ok, page, slot) for each token of stage i (fetched) that this thread copies: its index
  // in the stage, whether a page holds it, the page and the token's slot in it.
  template <class F>
  __device__ void each_token(const KVView& kv, int i, F f) const {
#pragma unroll
    for (int x = 0; x < kPasses; ++x) {
      const int jt = x * kPerPass + jt0;
      const int32_t j = k0 + i * kTokens + jt;
      f(jt, kv.holds(raw[x]), raw[x], kv.slot(j));
    }
  }
  // This thread's K and V chunks of token jt (at byte offset `off` of the pools) into stage st.
  // kL2: the bytes L2 fetches from DRAM around each copy's address (copy16).
  template <class Ring, int kL2 = 0>
  __device__ void copy_token(unsigned char* smem, const KVView& kv, int st, int jt, int64_t off,
                             bool ok) const {
#pragma unroll
    for (int y = 0; y < kChunks / kLanes; ++y) {
      const int c = c0 + y * kLanes;
      copy_async<kL2>(reinterpret_cast<uint4*>(Ring::chunk(smem, st, 0, jt, c)), kv.k + off + 16 * y * kLanes, ok);
      copy_async<kL2>(reinterpret_cast<uint4*>(Ring::chunk(smem, st, 1, jt, c)), kv.v + off + 16 * y * kLanes, ok);
    }
  }
};

// The rows of O^T that tc_finish merges in shared memory: a float of padding after every kD / 8
// of them and rows kStride floats apart, so that a warp's stores of its fragments are free of
// bank conflicts in both kernels' orders (lanes g one or kD / 8 + 1 floats apart, lanes tq two
// rows, 24 banks, apart); unpadded they were 4-way (bf16) and 16-way (8-bit) conflicts.
template <int kD>
struct MergeRows {
  static constexpr int kStride = kD + 8 + 4;
  __device__ static int at(int d) { return d + d / (kD / 8); }
};

// The end of a keys-as-rows block, after its ring is drained. Lane (g, tq) holds the running
// max and its own part of the sums of heads 2 tq, 2 tq + 1: the sums are added over the lanes g,
// then slot `slot`'s O^T goes to shared memory (store(row): head 2 tq's row at row, head
// 2 tq + 1's at row + MergeRows<kD>::kStride, element d at MergeRows<kD>::at(d)), with its max
// and sums (written by the slot's `writes_stats` warp), and the slots are merged: for each of the
// nh heads, the output (one split) or the workspace (several). Slots past a head's live keys hold
// max -inf.
template <int kD, int kSlots, class OT, class Store>
__device__ __forceinline__ void tc_finish(unsigned char* smem, int slot, bool writes_stats,
                                          float m0, float m1, float l0, float l1, Store store,
                                          const AttentionProblem& p, int b, int t, int h0, int nh,
                                          int split, int splits, float* work) {
  const int lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  over_keys(l0, l1, [](float a, float c) { return a + c; });
  using M = MergeRows<kD>;
  float* sm_acc = reinterpret_cast<float*>(smem);  // [kSlots][kTcN][M::kStride]
  float* sm_m = sm_acc + kSlots * kTcN * M::kStride;  // [kSlots][kTcN]
  float* sm_l = sm_m + kSlots * kTcN;
  store(sm_acc + (slot * kTcN + 2 * tq) * M::kStride);
  if (g == 0 && writes_stats) {
    sm_m[slot * kTcN + 2 * tq] = m0, sm_l[slot * kTcN + 2 * tq] = l0;
    sm_m[slot * kTcN + 2 * tq + 1] = m1, sm_l[slot * kTcN + 2 * tq + 1] = l1;
  }
  __syncthreads();
  OT* out = reinterpret_cast<OT*>(p.out);
  for (int x = threadIdx.x; x < nh * kD; x += kThreads) {
    const int h = x / kD, d = x % kD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kSlots; ++w) mx = fmaxf(mx, sm_m[w * kTcN + h]);
    float a = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < kSlots; ++w) {
      const float mw = sm_m[w * kTcN + h];
      const float r = mw == -INFINITY ? 0.f : exp2f(mw - mx);
      a += sm_acc[(w * kTcN + h) * M::kStride + M::at(d)] * r;
      sum += sm_l[w * kTcN + h] * r;
    }
    if (splits == 1) {
      const float o = a * sink_norm(mx, sum, sink_log2(p, h0 + h)) * *p.v_scale;
      Elem<OT>::store1(out + p.q_index(b, t, h0 + h) + d, o);
    } else {
      float* w = work + (p.q_index(b, t, h0 + h) / kD * splits + split) * (kD + 2);
      w[d] = a;
      if (d == 0) w[kD] = mx, w[kD + 1] = sum;
    }
  }
}

template <int kD, int kSplitD, int kStages>
struct TcShape {
  static constexpr int kTokens = 16 * kWarps / kSplitD;  // a stage: 16 tokens a slice of warps
  static constexpr int kSlices = kWarps / kSplitD;
  static constexpr int kDW = kD / kSplitD;               // O's columns a warp accumulates
  template <class T>
  using Ring = TcRing<kD, T, kTokens, kStages>;
  static constexpr size_t kMergeBytes = sizeof(float) * kSlices * kTcN * (MergeRows<kD>::kStride + 2);
  template <class T>
  static constexpr size_t bytes() {
    return Ring<T>::kRingBytes > kMergeBytes ? Ring<T>::kRingBytes : kMergeBytes;
  }
};

// kCap: scores soft-capped (p.soft_cap > 0), a compile-time flag as in attention_kernel: ptxas
// turned a runtime branch into 12 predicated instructions a stage on the plain path.
template <int kD, class T, int kLanes, int kSplitD, class Depth, bool kCap>
__global__ void __launch_bounds__(kThreads, Depth::kMinBlocks)
    attention_tc_kernel(const AttentionProblem p, int32_t keys_per_split, float* work) {
  constexpr int kStages = Depth::kStages;
  using S = TcShape<kD, kSplitD, kStages>;
  using R = typename S::template Ring<T>;
  constexpr int kTokens = S::kTokens, kDW = S::kDW;
  extern __shared__ __align__(128) unsigned char smem[];
  const SplitBlock blk = split_block<kTcN>(p, keys_per_split);
  if (empty_split<kD, T>(p, blk)) return;
  const auto [b, t, h0, nh, kvh, split, splits, k0, k1] = blk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;  // fragment row (key, or O's column) and column pair (heads)
  const int jw = (warp / kSplitD) * 16;   // this warp's tokens in a stage
  const int dw = (warp % kSplitD) * kDW;  // and its columns of O
  const int iters = (k1 - k0 + kTokens - 1) / kTokens;

  // Copies (TcCopy): the thread's chunks of its tokens, and (lane 0 of a token) its live flag.
  TcCopy<kLanes, R::kChunks, kTokens> cp(p, b, k0, k1, iters);
  const int64_t base = *p.layer * p.kv.layer_stride + kvh * p.kv.head_stride + cp.c0 * 16;
  auto issue = [&](int i) {
    if (i < iters) {
      const int st = i % kStages;
      cp.each_token(p.kv, i, [&](int jt, bool ok, int32_t page, int32_t slot) {
        const int64_t off = ok ? base + page * p.kv.page_stride + slot * p.kv.token_stride : 0;
        cp.template copy_token<R>(smem, p.kv, st, jt, off, ok);
        if (cp.c0 == 0) R::live(smem, st)[jt] = ok;
      });
    }
    copy_commit();
    cp.fetch(p.kv, i + 1);
  };
  cp.fetch(p.kv, 0);
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);

  // Q as B fragments, pre-scaled (heads past the block's are zeros): lane (g, tq) holds head g's
  // pairs d = 16 ks + 2 tq and d + 8, one 4-byte load each.
  uint32_t qb[kD / 16][2];
  {
    const float qscale = p.scale * kLog2e * *p.k_scale;
    const T* qp = reinterpret_cast<const T*>(p.q);
    const uint32_t* r = reinterpret_cast<const uint32_t*>(qp + p.q_index(b, t, h0 + min(g, nh - 1)));
    const bool live = g < nh;
    auto pair = [&](int d) -> uint32_t {
      if (!live) return 0u;
      const float2 f = unpack2<T>(__ldg(r + d / 2));
      return pack2<T>(f.x * qscale, f.y * qscale);
    };
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      qb[ks][0] = pair(ks * 16 + 2 * tq);
      qb[ks][1] = pair(ks * 16 + 8 + 2 * tq);
    }
  }
  // O^T: rows d = dw + 16 mt + g (+ 8), columns heads 2 tq, 2 tq + 1.
  float o[kDW / 16][4];
#pragma unroll
  for (int mt = 0; mt < kDW / 16; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  // Heads 2 tq and 2 tq + 1: running max (the same in the 8 lanes of a tq) and this lane's sums.
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  // The soft cap in the scores' units (scale * log2 e folded into q: log2 e).
  const float cap = p.soft_cap * kLog2e, inv_cap = 1.f / cap;

  for (int i = 0; i < iters; ++i) {
    copy_wait<kStages - 2>();
    __syncthreads();  // stage i landed for every thread; every warp is done with stage i - 1
    issue(i + kStages - 1);
    const int st = i % kStages;

    // S^T = K Q^T over the warp's 16 tokens: sc[0, 1] token g, sc[2, 3] token g + 8.
    float sc[4] = {};
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      uint32_t ka[4];
      ldmatrix_x4<false>(ka, R::chunk(smem, st, 0, jw + lane % 8 + ((lane / 8) % 2) * 8, 2 * ks + lane / 16));
      mma_16816<T>(sc, ka, qb[ks][0], qb[ks][1]);
    }
    if constexpr (kCap) {  // before the mask, which sets dead tokens to -inf
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[e] = soft_capped(sc[e], cap, inv_cap);
    }
    const int* live = R::live(smem, st);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int jt = jw + g + 8 * e;
      if (!(live[jt] && k0 + i * kTokens + jt < k1)) sc[2 * e] = sc[2 * e + 1] = -INFINITY;
    }
    // Online softmax per head: the max over the 8 lanes g of each tq.
    float mx0 = fmaxf(m0, fmaxf(sc[0], sc[2])), mx1 = fmaxf(m1, fmaxf(sc[1], sc[3]));
    over_keys(mx0, mx1, [](float a, float c) { return fmaxf(a, c); });
    const float a0 = mx0 == -INFINITY ? 1.f : exp2f(m0 - mx0);
    const float a1 = mx1 == -INFINITY ? 1.f : exp2f(m1 - mx1);
    m0 = mx0, m1 = mx1;
    float pr[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float mx = e % 2 ? mx1 : mx0;
      // the weight as P V sees it: rounded to T
      pr[e] = mx == -INFINITY ? 0.f : static_cast<float>(static_cast<T>(exp2f(sc[e] - mx)));
    }
    l0 = l0 * a0 + pr[0] + pr[2];
    l1 = l1 * a1 + pr[1] + pr[3];
    // P^T as B fragments (keys 2 tq, 2 tq + 1 of head g; then keys + 8): the packed S^T tiles
    // of keys 0-7 and 8-15, transposed.
    const uint32_t pb0 = movmatrix_trans(pack2<T>(pr[0], pr[1]));
    const uint32_t pb1 = movmatrix_trans(pack2<T>(pr[2], pr[3]));
    // O^T = O^T * alpha + V^T P^T, the rescale only where a head's maximum moved in this warp.
    if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
      for (int mt = 0; mt < kDW / 16; ++mt) o[mt][0] *= a0, o[mt][1] *= a1, o[mt][2] *= a0, o[mt][3] *= a1;
    }
#pragma unroll
    for (int mt = 0; mt < kDW / 16; ++mt) {
      uint32_t va[4];  // V^T's A fragment: keys 0-7 then 8-15 of columns d, d + 8 (16-byte chunks)
      ldmatrix_x4<true>(va, R::chunk(smem, st, 1, jw + lane % 8 + (lane / 16) * 8, (dw + 16 * mt) / 8 + (lane / 8) % 2));
      mma_16816<T>(o[mt], va, pb0, pb1);
    }
  }
  copy_wait<0>();
  __syncthreads();  // the ring's shared memory now holds the slices' partial results

  // Each warp's half (kSplitD 2) or whole of its slice's O^T, rows d = dw + 16 mt + g (+ 8).
  tc_finish<kD, S::kSlices, T>(smem, warp / kSplitD, warp % kSplitD == 0, m0, m1, l0, l1,
                               [&](float* row) {
    using M = MergeRows<kD>;
#pragma unroll
    for (int mt = 0; mt < kDW / 16; ++mt) {
      const int d = dw + 16 * mt + g;
      row[M::at(d)] = o[mt][0], row[M::kStride + M::at(d)] = o[mt][1];
      row[M::at(d + 8)] = o[mt][2], row[M::kStride + M::at(d + 8)] = o[mt][3];
    }
  }, p, b, t, h0, nh, split, splits, work);
}

// --- split-KV on tensor cores for 8-bit caches (fp8 e4m3 / e5m2, int8; q bf16 or f16) ------------
//
// attention_tc_kernel's blocks, MMA shape (keys as the 16 rows, up to 8 q heads as the columns),
// cp.async ring and online softmax over K and V tiles of one byte an element (half the bytes per
// stage; 64-token stages, 16 tokens a warp), converted to f16 in registers as the MMA fragments
// are built: e4m3 by cvt, e5m2 by a byte move (its byte is an f16's high byte), int8 by a byte
// move under the exponent of 1024 and a subtraction. Every e4m3, e5m2 and int8 value is exact in
// f16, so the MMAs run in f16 whatever q's dtype is. Numerics (float32 softmax and accumulation,
// as the CUDA-core kernel):
// - Q: q times a power of two 2^e per block (max |q| in [2^14, 2^15)), rounded to f16: exact for
//   a bf16 or f16 q (8 or 11 significant bits), except values below 2^-28 of the block's max.
//   The softmax scale, log2 e, 2^-e and the K scale (per tensor, or the token's) multiply the
//   float32 scores, so S is q . (k_scale * k) up to float32 accumulation.
// - P: exp2(s - max) * v_scale(token) / vref in f16, vref a power of two above every V scale the
//   warp has read (O is rescaled when it grows, as for the running max): no overflow whatever the
//   scales, each weight rounded to 2^-11 (the bf16 kernel's P: 2^-8). The row sums add the
//   float32 weights; O * vref at the end. Per tensor, vref is 1 and V's scale multiplies the
//   output, as in the other kernels.
// K and V convert exactly, so the one rounding beyond the CUDA-core kernel's is P's (f16): the
// tolerances of tests/test_quantized.py (2e-2 against jaxkv.reference over the dequantized
// values) hold with room, for bf16 and f16 queries alike.
// Fragments: a lane reads 16-byte words of its tokens' rows, and the MMAs' head_dim orders are
// permuted to match. S^T: lane (g, tq) holds d = tq * kD / 4 + 4 ks + {0, 1} as k = 2 tq + {0, 1}
// of k-step ks and + {2, 3} as k = 2 tq + {8, 9}, for keys g and g + 8 (q's B fragment is built in
// the same order), so K needs no byte shuffle. O^T: m-tile mt's row g is d = g * kD / 8 + 2 mt and
// row g + 8 is d + 1, so lane g reads bytes [g * kD / 8, (g + 1) * kD / 8) of its four keys (k =
// 2 tq + {0, 1, 8, 9}) and pairs the keys' bytes with one byte_perm per two registers.

// Two stages and four blocks per multiprocessor (<= 128 registers): measured on the H200 for the
// heads-as-rows kernel in docs/perf-notes.md, item 16.
constexpr int kTc8Stages = 2;
constexpr int kTc8MinBlocks = 4;
// Threads that copy one token: a lane per 16-byte chunk (8 at D 128, 4 at D 64), so that a warp's
// copy instruction asks for whole 128-byte lines. With 4 lanes at D 128 each instruction asked
// for half of each line and a line was requested twice: ncu put L2 at 88% of its throughput
// against DRAM's 77%, and 8 lanes read 5-7% faster on the H200 (docs/perf-notes.md item 44).
template <int kD>
constexpr int kTc8Lanes = kD / 16;
// Each copy asks L2 for the 256 bytes around it, its neighbours' in the same fetch (an HND
// page's tokens, a linear row's, an NHD token's heads, which their blocks read at about the same
// time). On the H100 -2.5% to -5% against the default sector fetches (measured with 4 lanes a
// token), bit for bit the same output; 3 stages instead of 2 slower there with and without it
// and on the H200; on the 16-bit kernel no change (docs/perf-notes.md items 40, 44).
constexpr int kTc8L2 = 256;

template <int kD, int kStages>
struct TcRing8 {
  static constexpr int kChunks = kD / 16;                          // 16-byte chunks per token
  static constexpr size_t kTile = size_t{kTcTokens} * kD;          // bytes of K (or V) per stage
  static constexpr size_t kLive = 2 * kTile * kStages;             // live flags [stages][tokens]
  static constexpr size_t kScales = kLive + sizeof(int) * kTcTokens * kStages;  // K, V scales
  static constexpr size_t kRingBytes = kScales + 2 * sizeof(float) * kTcTokens * kStages;
  static constexpr size_t kMergeBytes = sizeof(float) * kWarps * kTcN * (MergeRows<kD>::kStride + 2);
  static constexpr size_t kBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;
  static_assert(kD == 64 || kD == 128, "head dims 64, 128");
  // 16-byte slot of chunk c of token j. 128-byte lines are XOR-swizzled so that the fragment
  // reads (K: tokens g = 0..7 x chunks of tq; V: tokens 2 tq + e x chunk g, or its half at D 64)
  // are conflict-free: D 128, a token a line, chunk c ^ (j & 7); D 64, two tokens a line, chunk
  // (4 (j & 1) + c) ^ (2 line & 7).
  __device__ static int slot(int j, int c) {
    if constexpr (kD == 128) return j * 8 + (c ^ (j & 7));
    else return (j >> 1) * 8 + ((4 * (j & 1) + c) ^ ((j >> 1) * 2 & 7));
  }
  __device__ static unsigned char* tile(unsigned char* smem, int stage, int kind) {
    return smem + (stage * 2 + kind) * kTile;
  }
  __device__ static unsigned char* chunk(unsigned char* smem, int stage, int kind, int j, int c) {
    return tile(smem, stage, kind) + slot(j, c) * 16;
  }
  __device__ static int* live(unsigned char* smem, int stage) {
    return reinterpret_cast<int*>(smem + kLive) + stage * kTcTokens;
  }
  __device__ static float* scales(unsigned char* smem, int stage, int kind) {  // kind 0: K, 1: V
    return reinterpret_cast<float*>(smem + kScales) + (kind * kStages + stage) * kTcTokens;
  }
};

template <int kD, int kStages, class QT, class KT, int kLanes, bool kTokenScales>
__global__ void __launch_bounds__(kThreads, kTc8MinBlocks)
    attention_tc8_kernel(const AttentionProblem p, int32_t keys_per_split, float* work) {
  using R = TcRing8<kD, kStages>;
  extern __shared__ __align__(128) unsigned char smem[];
  const SplitBlock blk = split_block<kTcN>(p, keys_per_split);
  if (empty_split<kD, QT>(p, blk)) return;
  const auto [b, t, h0, nh, kvh, split, splits, k0, k1] = blk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;  // fragment row (head) and column pair
  const int iters = (k1 - k0 + kTcTokens - 1) / kTcTokens;

  // Copies (TcCopy): the thread's chunks of its tokens; lanes 0 and 1 of a token also its K and V
  // scale, lane 0 its live flag.
  static_assert(kLanes >= 2, "two lanes copy a token's scales");
  TcCopy<kLanes, R::kChunks, kTcTokens> cp(p, b, k0, k1, iters);
  const int64_t layer = *p.layer;
  const int64_t base = layer * p.kv.layer_stride + kvh * p.kv.head_stride + cp.c0 * 16;
  constexpr bool token_scales = kTokenScales;  // else one scale per tensor (in qk and v_scale)
  const int64_t sbase = layer * p.scales.layer_stride + kvh * p.scales.head_stride;
  const char* sptr = cp.c0 == 1 ? p.scales.v : p.scales.k;
  auto issue = [&](int i) {
    if (i < iters) {
      const int st = i % kStages;
      cp.each_token(p.kv, i, [&](int jt, bool ok, int32_t page, int32_t slot) {
        const int64_t off = ok ? base + page * p.kv.page_stride + slot * p.kv.token_stride : 0;
        cp.template copy_token<R, kTc8L2>(smem, p.kv, st, jt, off, ok);
        if (cp.c0 == 0) R::live(smem, st)[jt] = ok;
        if (token_scales && cp.c0 < 2) {
          const int64_t so = ok ? sbase + page * p.scales.page_stride + slot * p.scales.token_stride : 0;
          copy_async(R::scales(smem, st, cp.c0) + jt, sptr + so, ok);
        }
      });
    }
    copy_commit();
    cp.fetch(p.kv, i + 1);
  };
  cp.fetch(p.kv, 0);
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);

  // Q as B fragments in f16, times 2^e (heads past the block's are zeros): lane (g, tq) holds
  // head g's elements [dq, dq + kD / 4) (the order above), kD / 32 16-byte words.
  constexpr int kKs = kD / 16, kQW = kD / 32;
  const int dq = tq * (kD / 4);  // this lane's head_dim slice
  float qf[kD / 4];
  {
    const uint4* src = reinterpret_cast<const uint4*>(
        reinterpret_cast<const QT*>(p.q) + p.q_index(b, t, h0 + min(g, nh - 1)) + dq);
#pragma unroll
    for (int w = 0; w < kQW; ++w) {
      const uint4 word = g < nh ? load_word(src + w) : make_uint4(0, 0, 0, 0);
      Elem<QT>::to_float(word, qf + 8 * w);
    }
  }
  float amax = 0.f;
#pragma unroll
  for (int d = 0; d < kD / 4; ++d) amax = fmaxf(amax, fabsf(qf[d]));
#pragma unroll
  for (int x = 1; x < 32; x *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, x));
  const float qmul = f16_headroom(amax);
  uint32_t qb[kKs][2];
#pragma unroll
  for (int ks = 0; ks < kKs; ++ks) {
    qb[ks][0] = pack2<__half>(qf[4 * ks] * qmul, qf[4 * ks + 1] * qmul);
    qb[ks][1] = pack2<__half>(qf[4 * ks + 2] * qmul, qf[4 * ks + 3] * qmul);
  }
  // Scores' float32 factor (a token's K scale on top where scaled per token).
  const float qk = p.scale * kLog2e * *p.k_scale / qmul;
  // The soft cap in the scores' units (qk: base 2).
  const bool capped = p.soft_cap > 0.f;
  const float cap = p.soft_cap * kLog2e, inv_cap = 1.f / cap;

  // O^T: m-tile mt's row g is d = g kD / 8 + 2 mt, row g + 8 is d + 1; columns heads 2 tq, + 1.
  float o[kD / 16][4];
#pragma unroll
  for (int mt = 0; mt < kD / 16; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  // Heads 2 tq and 2 tq + 1: running max (the same in the 8 lanes of a tq) and this lane's sums.
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  // O's scale: a power of two above every V scale read, and its reciprocal (exact).
  float vref = token_scales ? 0x1p-100f : 1.f, inv = token_scales ? 0x1p100f : 1.f;

  const int jw = warp * 16;  // this warp's tokens in a stage
  // This lane's fragment reads, as byte offsets in a stage's K or V tile (the same every stage):
  // K: tokens g and g + 8 (jw is a multiple of 16) at the chunks of tq; V: tokens 2 tq + {0, 1,
  // 8, 9} at byte g kD / 8 of their rows.
  int koff[kD / 64][2], voff[4];
#pragma unroll
  for (int h = 0; h < kD / 64; ++h) {
    koff[h][0] = R::slot(jw + g, tq * (kD / 64) + h) * 16;
    koff[h][1] = R::slot(jw + g + 8, tq * (kD / 64) + h) * 16;
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int jt = jw + 2 * tq + (r & 1) + (r >> 1) * 8;
    voff[r] = kD == 128 ? R::slot(jt, g) * 16 : R::slot(jt, g >> 1) * 16 + (g & 1) * 8;
  }
  for (int i = 0; i < iters; ++i) {
    copy_wait<kStages - 2>();
    __syncthreads();  // stage i landed for every thread; every warp is done with stage i - 1
    issue(i + kStages - 1);
    const int st = i % kStages;
    const unsigned char* ktile = R::tile(smem, st, 0);
    const unsigned char* vtile = R::tile(smem, st, 1);

    // S^T = K Q^T: lane (g, tq) reads tokens g and g + 8's bytes [tq kD / 4, +kD / 4).
    float sc[4] = {};
#pragma unroll
    for (int h = 0; h < kD / 64; ++h) {
      const uint4 w0 = *reinterpret_cast<const uint4*>(ktile + koff[h][0]);
      const uint4 w1 = *reinterpret_cast<const uint4*>(ktile + koff[h][1]);
      const uint32_t u0[4] = {w0.x, w0.y, w0.z, w0.w}, u1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        uint32_t a[4];  // {token g, k 2 tq..}, {token g + 8, ..}, {token g, k 2 tq + 8..}, {g + 8, ..}
        Tc8<KT>::to_h2(u0[e], a[0], a[2]);
        Tc8<KT>::to_h2(u1[e], a[1], a[3]);
        mma_16816<__half>(sc, a, qb[4 * h + e][0], qb[4 * h + e][1]);
      }
    }
    // Scales of this lane's tokens (jw + g + 8 e), the mask, the running max per head.
    const int* live = R::live(smem, st);
    float vs[2];
    float vmax = 0.f;
    bool ok[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int jt = jw + g + 8 * e;
      ok[e] = live[jt] && k0 + i * kTcTokens + jt < k1;
      const float f = token_scales ? qk * R::scales(smem, st, 0)[jt] : qk;
      vs[e] = !token_scales ? 1.f : ok[e] ? R::scales(smem, st, 1)[jt] : 0.f;
      vmax = fmaxf(vmax, vs[e]);
      sc[2 * e] *= f, sc[2 * e + 1] *= f;
    }
    if (capped) {  // uniform; the final scores (K's scales applied), before the mask
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[e] = soft_capped(sc[e], cap, inv_cap);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[e] = ok[e / 2] ? sc[e] : -INFINITY;
    float mx0 = fmaxf(m0, fmaxf(sc[0], sc[2])), mx1 = fmaxf(m1, fmaxf(sc[1], sc[3]));
    over_keys(mx0, mx1, [](float a, float c) { return fmaxf(a, c); });
    const float a0 = mx0 == -INFINITY ? 1.f : fast_exp2(m0 - mx0);
    const float a1 = mx1 == -INFINITY ? 1.f : fast_exp2(m1 - mx1);
    m0 = mx0, m1 = mx1;
    float rescale = 1.f;  // O's: vref's growth
    if constexpr (token_scales) {  // the warp's tokens: the same for every tq
#pragma unroll
      for (int x = 4; x < 32; x *= 2) vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, x));
      if (vmax > vref) {  // O's old values rescaled by vref / up (exact: powers of two)
        const Pow2 up = pow2_above(vmax);
        rescale = vref * up.inverse;
        vref = up.value, inv = up.inverse;
      }
    }
    float pr[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float mx = e % 2 ? mx1 : mx0;
      pr[e] = mx == -INFINITY ? 0.f : fast_exp2(sc[e] - mx);
    }
    l0 = l0 * a0 + pr[0] + pr[2];
    l1 = l1 * a1 + pr[1] + pr[3];
    // P^T (times V's scales) as B fragments: the packed S^T tiles of keys 0-7 and 8-15, transposed.
    const float w0 = vs[0] * inv, w1 = vs[1] * inv;
    const uint32_t pb0 = movmatrix_trans(pack2<__half>(pr[0] * w0, pr[1] * w0));
    const uint32_t pb1 = movmatrix_trans(pack2<__half>(pr[2] * w1, pr[3] * w1));
    const float o0 = a0 * rescale, o1 = a1 * rescale;
    if (__any_sync(0xffffffffu, o0 != 1.f || o1 != 1.f)) {  // mostly not, once the maxima settle
#pragma unroll
      for (int mt = 0; mt < kD / 16; ++mt) o[mt][0] *= o0, o[mt][1] *= o1, o[mt][2] *= o0, o[mt][3] *= o1;
    }
    // O^T += V^T P^T: lane g's bytes of keys 2 tq, 2 tq + 1 (rows r = 0, 1) and 2 tq + 8, + 9.
    constexpr int kW = kD / 32;  // words of kD / 8 bytes
    uint32_t va[4][kW];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if constexpr (kD == 128) {
        const uint4 w = *reinterpret_cast<const uint4*>(vtile + voff[r]);
        va[r][0] = w.x, va[r][1] = w.y, va[r][2] = w.z, va[r][3] = w.w;
      } else {
        const uint2 w = *reinterpret_cast<const uint2*>(vtile + voff[r]);
        va[r][0] = w.x, va[r][1] = w.y;
      }
    }
#pragma unroll
    for (int wi = 0; wi < kW; ++wi) {
      // Bytes 4 wi .. 4 wi + 3 of the run: m-tiles 2 wi (rows g, g + 8: bytes 0, 1) and 2 wi + 1.
      uint32_t lo[4], hi[4];  // A fragments: keys 0-7 of rows g, g + 8, then keys 8-15
      Tc8<KT>::to_h2(__byte_perm(va[0][wi], va[1][wi], 0x5140), lo[0], lo[1]);
      Tc8<KT>::to_h2(__byte_perm(va[2][wi], va[3][wi], 0x5140), lo[2], lo[3]);
      Tc8<KT>::to_h2(__byte_perm(va[0][wi], va[1][wi], 0x7362), hi[0], hi[1]);
      Tc8<KT>::to_h2(__byte_perm(va[2][wi], va[3][wi], 0x7362), hi[2], hi[3]);
      mma_16816<__half>(o[2 * wi], lo, pb0, pb1);
      mma_16816<__half>(o[2 * wi + 1], hi, pb0, pb1);
    }
  }
  copy_wait<0>();
  __syncthreads();  // the ring's shared memory now holds the warps' partial results

  // Each warp's O^T (times vref) in head_dim's own order: m-tile mt's rows are d = g kD / 8 + 2 mt
  // and d + 1.
  tc_finish<kD, kWarps, QT>(smem, warp, true, m0, m1, l0, l1, [&](float* row) {
    using M = MergeRows<kD>;
#pragma unroll
    for (int mt = 0; mt < kD / 16; ++mt) {
      float* r = row + M::at(g * (kD / 8) + 2 * mt);  // d and d + 1 share a padding group
      r[0] = o[mt][0] * vref, r[M::kStride] = o[mt][1] * vref;
      r[1] = o[mt][2] * vref, r[M::kStride + 1] = o[mt][3] * vref;
    }
  }, p, b, t, h0, nh, split, splits, work);
}

// Merges the live splits of (row, q head) and normalizes, the head's sink in the denominator:
// block (row, head), one thread per element of D.
template <class QT>
__global__ void combine_kernel(const AttentionProblem p, int32_t keys_per_split, int splits,
                               const float* work) {
  const int row = blockIdx.x, h = blockIdx.y;
  const int b = row / p.tokens, t = row % p.tokens;
  int32_t k0, k1;
  const int live = split_keys(p, b, t, keys_per_split, 0, splits, &k0, &k1);
  const float sink = sink_log2(p, h);
  const int D = p.head_dim;
  const float* w = work + (p.q_index(b, t, h) / D) * splits * (D + 2);
  float mx = -INFINITY;
  for (int s = 0; s < live; ++s) mx = fmaxf(mx, w[s * (D + 2) + D]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = 0.f, sum = 0.f;
    for (int s = 0; s < live; ++s) {
      const float* ws = w + s * (D + 2);
      const float r = ws[D] == -INFINITY ? 0.f : exp2f(ws[D] - mx);
      a += ws[d] * r;
      sum += ws[D + 1] * r;
    }
    const float o = a * sink_norm(mx, sum, sink) * *p.v_scale;
    Elem<QT>::store1(reinterpret_cast<QT*>(p.out) + p.q_index(b, t, h) + d, o);
  }
}

template <int kD, int kHeads, class QT, class KT>
void launch_split(cudaStream_t stream, dim3 grid, const AttentionProblem& p, int32_t per_split, float* work) {
  if (p.soft_cap > 0.f)
    attention_kernel<kD, kHeads, QT, KT, true><<<grid, kThreads, 0, stream>>>(p, per_split, work);
  else
    attention_kernel<kD, kHeads, QT, KT, false><<<grid, kThreads, 0, stream>>>(p, per_split, work);
}

template <int kD, class QT, class KT>
ffi::Error launch_d(cudaStream_t stream, const AttentionProblem& p, int splits, float* work) {
  const int32_t per_split = keys_per_split(p, splits);
  const int heads = block_heads(p.group);
  const int head_blocks = (p.group + heads - 1) / heads;
  const dim3 grid = split_grid(p, head_blocks, splits);
  if (heads == 1)
    launch_split<kD, 1, QT, KT>(stream, grid, p, per_split, work);
  else if (heads == 4)
    launch_split<kD, 4, QT, KT>(stream, grid, p, per_split, work);
  else
    launch_split<kD, kMaxHeads, QT, KT>(stream, grid, p, per_split, work);
  if (splits > 1) {
    const dim3 cgrid(static_cast<unsigned>(int64_t{p.batch} * p.tokens), static_cast<unsigned>(p.q_heads));
    combine_kernel<QT><<<cgrid, std::min(kD, 256), 0, stream>>>(p, per_split, splits, work);
  }
  return cuda_status("attention");
}

// The tensor-core split-KV kernel for 16-bit caches read by a q of their dtype, head_dim 64 / 128
// / 256; false: not eligible.
template <class T>
bool try_split_tc(cudaStream_t stream, const AttentionProblem& p, int splits, float* work, ffi::Error* status) {
  const int32_t per_split = keys_per_split(p, splits);
  const dim3 grid = split_grid(p, (p.group + kTcN - 1) / kTcN, splits);
  auto launch = [&](auto kernel, size_t bytes) {
    allow_shared_memory(kernel, bytes);
    kernel<<<grid, kThreads, bytes, stream>>>(p, per_split, work);
  };
  auto at_depth = [&](auto depth, auto capped) {
    using Depth = decltype(depth);
    constexpr int kStages = Depth::kStages;
    constexpr bool kCap = decltype(capped)::value;
    if (p.head_dim == 64)
      launch(attention_tc_kernel<64, T, kTcLanes, 1, Depth, kCap>, TcShape<64, 1, kStages>::template bytes<T>());
    else if (p.head_dim == 128)
      launch(attention_tc_kernel<128, T, kTcLanes, 1, Depth, kCap>, TcShape<128, 1, kStages>::template bytes<T>());
    else
      launch(attention_tc_kernel<256, T, kTcLanes, 2, Depth, kCap>, TcShape<256, 2, kStages>::template bytes<T>());
  };
  auto at = [&](auto depth) {
    if (p.soft_cap > 0.f) at_depth(depth, std::true_type{});
    else at_depth(depth, std::false_type{});
  };
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return false;
  const int64_t blocks = int64_t{grid.x} * grid.y * grid.z, sms = multiprocessor_count();
  const bool two_waves_either_way =
      blocks > TcShallow::kMinBlocks * sms && blocks <= 2 * TcDeep::kMinBlocks * sms;
  if (two_waves_either_way) at(TcDeep{});
  else at(TcShallow{});
  if (splits > 1) {
    const dim3 cgrid(static_cast<unsigned>(int64_t{p.batch} * p.tokens), static_cast<unsigned>(p.q_heads));
    combine_kernel<T><<<cgrid, std::min(p.head_dim, 256), 0, stream>>>(p, per_split, splits, work);
  }
  *status = cuda_status("attention");
  return true;
}

// The 8-bit tensor-core kernel (attention_tc8_kernel) for head_dim 64 / 128; false: not eligible.
template <class QT, class KT>
bool try_split_tc8(cudaStream_t stream, const AttentionProblem& p, int splits, float* work, ffi::Error* status) {
  if (p.head_dim != 64 && p.head_dim != 128) return false;
  const int32_t per_split = keys_per_split(p, splits);
  const dim3 grid = split_grid(p, (p.group + kTcN - 1) / kTcN, splits);
  auto launch = [&](auto kernel, size_t bytes) {
    allow_shared_memory(kernel, bytes);
    kernel<<<grid, kThreads, bytes, stream>>>(p, per_split, work);
  };
  // Per-token scales or one per tensor, fixed at compile time: the latter's loop then carries
  // none of the former's loads, selects and running V reference.
  auto at = [&](auto token_scales) {
    constexpr bool kScaled = decltype(token_scales)::value;
    if (p.head_dim == 64)
      launch(attention_tc8_kernel<64, kTc8Stages, QT, KT, kTc8Lanes<64>, kScaled>, TcRing8<64, kTc8Stages>::kBytes);
    else
      launch(attention_tc8_kernel<128, kTc8Stages, QT, KT, kTc8Lanes<128>, kScaled>, TcRing8<128, kTc8Stages>::kBytes);
  };
  if (p.scales.k != nullptr) at(std::true_type{});
  else at(std::false_type{});
  if (splits > 1) {
    const dim3 cgrid(static_cast<unsigned>(int64_t{p.batch} * p.tokens), static_cast<unsigned>(p.q_heads));
    combine_kernel<QT><<<cgrid, std::min(p.head_dim, 256), 0, stream>>>(p, per_split, splits, work);
  }
  *status = cuda_status("attention");
  return true;
}

// The tensor-core kernels where they apply to q QT over a cache of KT; false: not eligible.
template <class QT, class KT>
bool try_split_any_tc(cudaStream_t stream, const AttentionProblem& p, int splits, float* work, ffi::Error* status) {
  if constexpr (std::is_same_v<QT, float>) return false;
  else if constexpr (std::is_same_v<QT, KT>) return try_split_tc<QT>(stream, p, splits, work, status);
  else return try_split_tc8<QT, KT>(stream, p, splits, work, status);
}

template <class QT, class KT>
ffi::Error launch_types(cudaStream_t stream, const AttentionProblem& p, int splits, float* work) {
  switch (p.head_dim) {
    case 16: return launch_d<16, QT, KT>(stream, p, splits, work);
    case 32: return launch_d<32, QT, KT>(stream, p, splits, work);
    case 64: return launch_d<64, QT, KT>(stream, p, splits, work);
    case 128: return launch_d<128, QT, KT>(stream, p, splits, work);
    case 256: return launch_d<256, QT, KT>(stream, p, splits, work);
    default:
      return invalid("attention", "unsupported head_dim " + std::to_string(p.head_dim) +
                                      " (16, 32, 64, 128, 256)");
  }
}

}  // namespace

ffi::Error launch_split_kv(cudaStream_t stream, const AttentionProblem& p, int splits, float* w) {
  ffi::Error status = ffi::Error::Success();
  const bool known = with_attention_types(p.q_type, p.kv_type, [&](auto q, auto kv) {
    using QT = typename decltype(q)::type;
    using KT = typename decltype(kv)::type;
    if (!try_split_any_tc<QT, KT>(stream, p, splits, w, &status))  // the tensor cores first
      status = launch_types<QT, KT>(stream, p, splits, w);
  });
  return known ? status : invalid("attention", "unsupported dtypes of q and the cache");
}

}  // namespace jaxkv
