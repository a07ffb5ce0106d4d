// CUDA handlers of decode and prefill attention: split-KV (flash-decoding) over the cache in place.
//
// Block (query row r = (b, t), KV head group, split) attends the keys [split * keys_per_split, ...)
// of its row that are live (below AttentionProblem::keys), for up to kMaxHeads q heads of one KV
// head (the GQA group shares every K/V load). A warp takes kTokensPerWarp tokens at a time, each
// over kLanesPerToken lanes with 16-byte loads (8 for fp8), kUnroll groups of tokens in flight;
// scores and the softmax run in float32, base 2 (q pre-scaled by scale * log2 e * k_scale), with
// an online max per lane group, merged through shuffles and shared memory at the end. One split:
// the block writes the output. Several: it writes (unnormalized acc, max, sum) to the workspace and
// combine_kernel merges the live splits. Keys past the length are never loaded, so a block past a
// row's length exits at once: time follows the live bytes.
// Prefill: prefill_tc_kernel below (tensor cores, a tile of queries per K/V load) for bf16 / f16;
// otherwise the same split-KV kernel with one query row per new token.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <mma.h>

#include <algorithm>

#include "jaxkv/attention.h"
#include "jaxkv/cuda_launch.h"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 4;
constexpr int kMaxHeads = 8;  // q heads per block at most (python: _MAX_HEADS_PER_BLOCK)
constexpr float kLog2e = 1.4426950408889634f;

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
struct E4M3 {};
struct E5M2 {};
template <> struct Elem<E4M3> : Fp8<__NV_E4M3> {};
template <> struct Elem<E5M2> : Fp8<__NV_E5M2> {};

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

template <int kD, int kHeads, class QT, class KT>
__global__ void __launch_bounds__(kThreads)
    attention_kernel(const AttentionProblem p, int32_t keys_per_split, float* work) {
  using G = Geometry<kD, KT>;
  using W = typename Elem<KT>::W;
  const int row = blockIdx.x, split = blockIdx.z;
  const int b = row / p.tokens, t = row % p.tokens;
  int h0;
  const int nh = heads_of<kHeads>(p, blockIdx.y, &h0);
  const int kvh = h0 / p.group;
  const int splits = gridDim.z;
  const int32_t n = p.layer_ok() ? p.keys(b, t) : 0;
  const int32_t k0 = split * keys_per_split;
  const int32_t k1 = min(n, k0 + keys_per_split);
  QT* out = reinterpret_cast<QT*>(p.out);
  if (k0 >= k1) {
    // Nothing to read. With one split this block owns the output: zeros (n == 0). With several,
    // combine_kernel reads only the splits below n.
    if (splits == 1) {
      for (int i = threadIdx.x; i < nh * kD; i += kThreads)
        Elem<QT>::store1(out + p.q_index(b, t, h0 + i / kD) + i % kD, 0.f);
    }
    return;
  }
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

  for (int32_t it = k0; it < k1; it += G::kStep * kUnroll) {
    W kw[kUnroll][G::kVecsPerLane], vw[kUnroll][G::kVecsPerLane];
    bool live[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int32_t j = it + u * G::kStep + warp * G::kTokensPerWarp + sub;
      const int64_t off = j < k1 ? p.kv.offset(layer, b, kvh, j) : -1;
      live[u] = off >= 0;
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
        s[u][g] = live[u] ? dot : -INFINITY;
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
        float vf[G::kPerLane];
#pragma unroll
        for (int v = 0; v < G::kVecsPerLane; ++v) Elem<KT>::to_float(vw[u][v], vf + v * G::kElems);
#pragma unroll
        for (int i = 0; i < G::kPerLane; ++i) acc[g][i] = fmaf(pr, vf[i], acc[g][i]);
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
      const float o = sum > 0.f ? a / sum * *p.v_scale : 0.f;
      Elem<QT>::store1(out + p.q_index(b, t, h0 + g) + d, o);
    } else {
      // workspace [B, T, Hq, splits, D + 2]: acc, then max and sum
      float* w = work + (p.q_index(b, t, h0 + g) / kD * splits + split) * (kD + 2);
      w[d] = a;
      if (d == 0) w[kD] = mx, w[kD + 1] = sum;
    }
  }
}

// Merges the live splits of (row, q head): block (row, head), one thread per element of D.
template <class QT>
__global__ void combine_kernel(const AttentionProblem p, int32_t keys_per_split, int splits,
                               const float* work) {
  const int row = blockIdx.x, h = blockIdx.y;
  const int b = row / p.tokens, t = row % p.tokens;
  const int32_t n = p.layer_ok() ? p.keys(b, t) : 0;
  const int live = min(splits, (n + keys_per_split - 1) / keys_per_split);
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
    const float o = sum > 0.f ? a / sum * *p.v_scale : 0.f;
    Elem<QT>::store1(reinterpret_cast<QT*>(p.out) + p.q_index(b, t, h) + d, o);
  }
}

template <int kD, class QT, class KT>
ffi::Error launch_d(cudaStream_t stream, const AttentionProblem& p, int splits, float* work) {
  const int32_t per_split = (p.kv.capacity + splits - 1) / splits;
  const int heads = block_heads(p.group);
  const int head_blocks = (p.group + heads - 1) / heads;
  const dim3 grid(static_cast<unsigned>(int64_t{p.batch} * p.tokens),
                  static_cast<unsigned>(p.kv.heads * head_blocks), static_cast<unsigned>(splits));
  if (heads == 1)
    attention_kernel<kD, 1, QT, KT><<<grid, kThreads, 0, stream>>>(p, per_split, work);
  else if (heads == 4)
    attention_kernel<kD, 4, QT, KT><<<grid, kThreads, 0, stream>>>(p, per_split, work);
  else
    attention_kernel<kD, kMaxHeads, QT, KT><<<grid, kThreads, 0, stream>>>(p, per_split, work);
  if (splits > 1) {
    const dim3 cgrid(static_cast<unsigned>(int64_t{p.batch} * p.tokens), static_cast<unsigned>(p.q_heads));
    combine_kernel<QT><<<cgrid, std::min(kD, 256), 0, stream>>>(p, per_split, splits, work);
  }
  return cuda_status("attention");
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


// --- prefill on tensor cores (bf16 / f16 caches read by the same-dtype q) ---------------------------
//
// Block (token tile, KV head, row b) computes kRows = 64 query rows: kRows / group new tokens x the
// group's q heads, so every K/V tile loaded to shared memory serves the whole GQA group. Per key
// tile of kKeys tokens: S = Q K^T on tensor cores (WMMA 16x16x16, float accumulation), the masked
// online softmax in float32 (two lanes per row, base 2), O = O * alpha + P V on tensor cores with O
// kept in shared memory as float. Each warp owns 16 rows of S, P and O; only the K/V tiles are
// shared, so only their loads need block barriers.
constexpr int kRows = 64;
constexpr int kKeys = 64;

template <int kD, class T>
struct TcLayout {
  static constexpr int kLdT = kD + 8;      // Q, K, V rows (elements): 16-byte rows, 32-byte tiles
  static constexpr int kLdS = kKeys + 4;   // S (float)
  static constexpr int kLdP = kKeys + 8;   // P (T)
  static constexpr int kLdO = kD + 4;      // O (float)
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + sizeof(T) * kRows * kLdT;
  static constexpr size_t kV = kK + sizeof(T) * kKeys * kLdT;
  static constexpr size_t kS = kV + sizeof(T) * kKeys * kLdT;
  static constexpr size_t kP = kS + sizeof(float) * kRows * kLdS;
  static constexpr size_t kO = kP + sizeof(T) * kRows * kLdP;
  static constexpr size_t kOk = kO + sizeof(float) * kRows * kLdO;
  static constexpr size_t kBytes = kOk + sizeof(int) * kKeys;
};

// The tensor-core path takes bf16 or f16 caches read by a q of the same dtype, groups dividing the
// row tile, and shared memory within the device's opt-in limit.
template <int kD, class T>
bool tc_eligible(const AttentionProblem& p) {
  int device = 0, limit = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  return p.group <= kRows && kRows % p.group == 0 && TcLayout<kD, T>::kBytes <= static_cast<size_t>(limit);
}

template <int kD, class T>
__global__ void __launch_bounds__(kThreads) prefill_tc_kernel(const AttentionProblem p) {
  namespace wmma = nvcuda::wmma;
  using L = TcLayout<kD, T>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  float* sS = reinterpret_cast<float*>(smem + L::kS);
  T* sP = reinterpret_cast<T*>(smem + L::kP);
  float* sO = reinterpret_cast<float*>(smem + L::kO);
  int* sOk = reinterpret_cast<int*>(smem + L::kOk);
  constexpr int kChunks = kD * static_cast<int>(sizeof(T)) / 16;  // 16-byte words per token

  const int group = p.group, per_tile = kRows / group;
  const int b = blockIdx.z, kvh = blockIdx.y;
  const int t0 = blockIdx.x * per_tile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool layer_ok = p.layer_ok();
  const int64_t layer = *p.layer;
  // Keys of the block: those of its last live query (keys grow with t).
  const int t_last = min(t0 + per_tile, min(p.tokens, p.counts[b])) - 1;
  const int32_t n_max = (layer_ok && t_last >= t0) ? p.keys(b, t_last) : 0;

  // Q tile (rows past T or the count are zeros; they are masked below anyway).
  for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const int t = t0 + r / group, h = kvh * group + r % group;
    uint4 w = make_uint4(0, 0, 0, 0);
    if (t < p.tokens)
      w = load_word(reinterpret_cast<const uint4*>(p.q + p.q_index(b, t, h) * sizeof(T)) + c);
    *reinterpret_cast<uint4*>(sQ + r * L::kLdT + c * 8) = w;
  }
  for (int i = threadIdx.x; i < kRows * L::kLdO; i += kThreads) sO[i] = 0.f;

  // Softmax state of row `row` (two lanes per row, columns [half * 32, half * 32 + 32)).
  const int row = warp * 16 + lane / 2, half = lane % 2;
  const int t_row = t0 + row / group;
  const int32_t n_row = (layer_ok && t_row < p.tokens) ? p.keys(b, t_row) : 0;
  const float qscale = p.scale * kLog2e * *p.k_scale;
  float m = -INFINITY, l = 0.f;

  for (int32_t j0 = 0; j0 < n_max; j0 += kKeys) {
    __syncthreads();  // the previous tile's K/V are read by every warp
    for (int i = threadIdx.x; i < kKeys * kChunks; i += kThreads) {
      const int j = i / kChunks, c = i % kChunks;
      const int64_t off = j0 + j < n_max ? p.kv.offset(layer, b, kvh, j0 + j) : -1;
      uint4 kw = make_uint4(0, 0, 0, 0), vw = kw;
      if (off >= 0) {
        kw = load_word(reinterpret_cast<const uint4*>(p.kv.k + off) + c);
        vw = load_word(reinterpret_cast<const uint4*>(p.kv.v + off) + c);
      }
      *reinterpret_cast<uint4*>(sK + j * L::kLdT + c * 8) = kw;
      *reinterpret_cast<uint4*>(sV + j * L::kLdT + c * 8) = vw;
      if (c == 0) sOk[j] = off >= 0;
    }
    __syncthreads();

    // S (this warp's 16 rows x kKeys) = Q K^T.
    {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kKeys / 16];
#pragma unroll
      for (int c = 0; c < kKeys / 16; ++c) wmma::fill_fragment(acc[c], 0.f);
#pragma unroll
      for (int k = 0; k < kD; k += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::load_matrix_sync(a, sQ + warp * 16 * L::kLdT + k, L::kLdT);
#pragma unroll
        for (int c = 0; c < kKeys / 16; ++c) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kt;  // K^T
          wmma::load_matrix_sync(kt, sK + c * 16 * L::kLdT + k, L::kLdT);
          wmma::mma_sync(acc[c], a, kt, acc[c]);
        }
      }
#pragma unroll
      for (int c = 0; c < kKeys / 16; ++c)
        wmma::store_matrix_sync(sS + warp * 16 * L::kLdS + c * 16, acc[c], L::kLdS, wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax of the row over this tile; P in T, alpha rescales O.
    float* srow = sS + row * L::kLdS;
    float mx = m;
    for (int c = half * 32; c < half * 32 + 32; ++c) {
      const int j = j0 + c;
      const float v = (j < n_row && sOk[c]) ? srow[c] * qscale : -INFINITY;
      srow[c] = v;
      mx = fmaxf(mx, v);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float alpha = mx == -INFINITY ? 1.f : exp2f(m - mx);
    float sum = 0.f;
    T* prow = sP + row * L::kLdP;
    for (int c = half * 32; c < half * 32 + 32; ++c) {
      const float pr = mx == -INFINITY ? 0.f : exp2f(srow[c] - mx);
      const T pt = static_cast<T>(pr);
      prow[c] = pt;
      sum += static_cast<float>(pt);  // the rounded weights, as P V sees them
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    m = mx;
    l = l * alpha + sum;
    float* orow = sO + row * L::kLdO;
    for (int d = half; d < kD; d += 2) orow[d] *= alpha;
    __syncwarp();

    // O (this warp's 16 rows x kD) += P V.
#pragma unroll
    for (int c = 0; c < kD / 16; ++c) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
      float* otile = sO + warp * 16 * L::kLdO + c * 16;
      wmma::load_matrix_sync(o, otile, L::kLdO, wmma::mem_row_major);
#pragma unroll
      for (int k = 0; k < kKeys; k += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> v;
        wmma::load_matrix_sync(a, sP + warp * 16 * L::kLdP + k, L::kLdP);
        wmma::load_matrix_sync(v, sV + k * L::kLdT + c * 16, L::kLdT);
        wmma::mma_sync(o, a, v, o);
      }
      wmma::store_matrix_sync(otile, o, L::kLdO, wmma::mem_row_major);
    }
    __syncwarp();
  }
  __syncthreads();  // O was zeroed by every thread: visible here even when no tile ran

  // Output: O / l (zeros for rows with no key), rows past T are not written.
  if (t_row < p.tokens) {
    const int h = kvh * group + row % group;
    const float norm = l > 0.f ? *p.v_scale / l : 0.f;
    T* out = reinterpret_cast<T*>(p.out) + p.q_index(b, t_row, h);
    const float* orow = sO + row * L::kLdO;
    for (int d = half; d < kD; d += 2) out[d] = static_cast<T>(orow[d] * norm);
  }
}

template <int kD, class T>
ffi::Error launch_prefill_tc(cudaStream_t stream, const AttentionProblem& p) {
  using L = TcLayout<kD, T>;
  // The opt-in to more than 48 KiB of shared memory, once per device.
  constexpr int kMaxDevices = 64;
  static bool configured[kMaxDevices] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (!configured[device % kMaxDevices]) {
    cudaFuncSetAttribute(prefill_tc_kernel<kD, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(L::kBytes));
    configured[device % kMaxDevices] = true;
  }
  const int per_tile = kRows / p.group;
  const dim3 grid(static_cast<unsigned>((p.tokens + per_tile - 1) / per_tile),
                  static_cast<unsigned>(p.kv.heads), static_cast<unsigned>(p.batch));
  prefill_tc_kernel<kD, T><<<grid, kThreads, L::kBytes, stream>>>(p);
  return cuda_status("attention.prefill");
}

// The tensor-core prefill where it applies; false: use the split-KV kernel per query token.
template <class T>
bool try_prefill_tc(cudaStream_t stream, const AttentionProblem& p, ffi::Error* status) {
  if (p.batch > 65535 || p.kv.heads > 65535) return false;
  switch (p.head_dim) {
    case 64:
      if (!tc_eligible<64, T>(p)) return false;
      *status = launch_prefill_tc<64, T>(stream, p);
      return true;
    case 128:
      if (!tc_eligible<128, T>(p)) return false;
      *status = launch_prefill_tc<128, T>(stream, p);
      return true;
    case 256:
      if (!tc_eligible<256, T>(p)) return false;
      *status = launch_prefill_tc<256, T>(stream, p);
      return true;
    default:
      return false;
  }
}

template <bool kPrefill>
ffi::Error attention_cuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> starts,
                          ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> work,
                          float scale, int32_t layout) {
  auto p = make_attention("attention", q, k, v, table, starts, counts, layer, k_scale, v_scale, out,
                          scale, layout);
  if (p.has_error()) return p.error();
  if (p->batch == 0 || p->tokens == 0 || p->q_heads == 0) return ffi::Error::Success();
  auto wd = work->dimensions();
  int splits = 1;
  if (wd.size() == 5) {
    splits = static_cast<int>(wd[3]);
    if (wd[0] != p->batch || wd[1] != p->tokens || wd[2] != p->q_heads || wd[4] != p->head_dim + 2)
      return invalid("attention", "workspace must be [B, T, Hq, splits, D + 2]");
  }
  if (splits < 1 || splits > 65535 || int64_t{p->batch} * p->tokens > 0x7fffffff ||
      int64_t{p->kv.heads} * ((p->group + kMaxHeads - 1) / kMaxHeads) > 65535)
    return invalid("attention", "too many query rows, heads or splits for one launch");
  float* w = work->typed_data();
  using D = ffi::DataType;
  const D qt = p->q_type, kt = p->kv_type;
  if (kPrefill) {
    ffi::Error status = ffi::Error::Success();
    if (qt == D::BF16 && kt == D::BF16 && try_prefill_tc<__nv_bfloat16>(stream, *p, &status)) return status;
    if (qt == D::F16 && kt == D::F16 && try_prefill_tc<__half>(stream, *p, &status)) return status;
  }
  if (qt == D::F32 && kt == D::F32) return launch_types<float, float>(stream, *p, splits, w);
  if (qt == D::BF16 && kt == D::BF16) return launch_types<__nv_bfloat16, __nv_bfloat16>(stream, *p, splits, w);
  if (qt == D::F16 && kt == D::F16) return launch_types<__half, __half>(stream, *p, splits, w);
  if (qt == D::BF16 && kt == D::F8E4M3FN) return launch_types<__nv_bfloat16, E4M3>(stream, *p, splits, w);
  if (qt == D::BF16 && kt == D::F8E5M2) return launch_types<__nv_bfloat16, E5M2>(stream, *p, splits, w);
  if (qt == D::F16 && kt == D::F8E4M3FN) return launch_types<__half, E4M3>(stream, *p, splits, w);
  if (qt == D::F16 && kt == D::F8E5M2) return launch_types<__half, E5M2>(stream, *p, splits, w);
  return invalid("attention", "unsupported dtypes of q and the cache");
}

}  // namespace

// Decode: the split-KV kernel. Prefill: the tensor-core kernel where it applies (bf16 / f16, head
// dims 64, 128, 256, groups dividing 64), else the split-KV kernel with a query row per new token.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxkv_attention_decode_cuda, attention_cuda<false>,
    bind_attention(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JAXKV_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxkv_attention_prefill_cuda, attention_cuda<true>,
    bind_attention(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JAXKV_CUDA_TRAITS);
JAXKV_REGISTER_TARGET("jaxkv_attention_decode", "CUDA", jaxkv_attention_decode_cuda);
JAXKV_REGISTER_TARGET("jaxkv_attention_prefill", "CUDA", jaxkv_attention_prefill_cuda);

}  // namespace jaxkv
