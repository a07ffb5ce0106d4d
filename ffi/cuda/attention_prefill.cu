// CUDA prefill attention on tensor cores (mma.sync): a bf16 / f16 q over a cache of its dtype or
// an 8-bit one, where the wgmma kernel of attention_prefill_wgmma.cu (Hopper; head_dim 128, or
// 256 over a 16-bit cache) does not take it; the split-KV kernels of attention_decode.cu take the
// rest.
#include <cfloat>
#include <climits>

#include "attention_device.cuh"

namespace jaxkv {
namespace {

// --- prefill on tensor cores (bf16 / f16 q over a cache of its dtype or an 8-bit one) --------------
//
// FlashAttention-2's forward on mma.sync m16n8k16. Block (token tile, KV head, row b) computes
// kRows query rows: kRows / group new tokens x the group's q heads, so every K/V tile serves the
// whole GQA group. Warp w owns kM 16-row tiles: S = Q K^T, the online softmax and O = O * alpha +
// P V all stay in registers, P taken straight from the S fragments; Q, K and V go through shared
// memory (16-byte chunks XOR-swizzled by row: ldmatrix is conflict-free). K and V tiles of kN keys
// stream by cp.async through a ring of three stages (two tiles in flight while one is read: one
// block barrier a tile). Masks (causal, a key without a page) apply only to tiles that need them;
// tiles run longest first (a causal block's work grows with its tokens). Instructions bound the
// first versions (docs/perf-notes.md item 18): shared addresses are 32-bit, computed once per lane
// and moved by an XOR per 16 columns; one page lookup per key, a tile ahead, serves K and V.
// An 8-bit cache (KT fp8 e4m3 / e5m2, int8): the ring holds the tiles' bytes (half a 16-bit
// tile) and their per-token scales; each tile is converted, exactly, into one pair of 16-bit
// tiles that the same MMA code reads (a second barrier a tile): K into q's dtype, V into bf16.
// K's scale multiplies its scores (float32), V's the weights before they round to bf16 (so that
// no V scale can overflow them, as f16 weights could); a per-tensor V scale multiplies the output.
// A window: the K/V tiles start at the one holding the block's first query's first key (the
// smallest: no tile before it is read, nor keys of that tile before it, whose pages may be gone);
// keys below a row's first key are masked, on the tiles of the window's lower edge only (those
// below the block's last query's first key), as the causal mask on the diagonal's. A soft cap:
// each raw score (after the K scales) becomes tanh(s / c), c the cap in raw units, and the
// exponent's factor the cap in base-2 units instead of qscale (c tanh(s / c) qscale: the same),
// one uniform branch a tile. A sink enters the final normalization (sink_norm).
template <int kD> struct PrefillShape;  // kM 16-row tiles per warp, kN keys per K/V tile
template <> struct PrefillShape<64> { static constexpr int kM = 2, kN = 64; };
template <> struct PrefillShape<128> { static constexpr int kM = 2, kN = 32; };
template <> struct PrefillShape<256> { static constexpr int kM = 1, kN = 16; };  // O: 128 registers

// Shared memory: Q rows, then per stage K and V tiles, then per stage which keys a page holds,
// then each row's first key (a window's).
// Rows are kD * 2 bytes (a power of two) and the base is aligned to 1 KiB, so chunk c of row r,
// at byte (c ^ (r & 7)) * 16 of the row, is the row's address XOR a lane's fixed bits XOR c * 16.
// k8 (an 8-bit cache): one pair of 16-bit tiles (the converted tile), then per stage the K and V
// bytes (rows of kD bytes, unswizzled) and the K and V scales.
template <int kD, bool k8 = false>
struct PrefillLayout {
  static constexpr int kM = PrefillShape<kD>::kM, kN = PrefillShape<kD>::kN;
  static constexpr int kStages = 3;  // K/V tiles: one read, two in flight
  static constexpr int kRows = kWarps * 16 * kM;
  static constexpr int kChunks = kD * 2 / 16;  // 16-byte chunks of a row
  static constexpr unsigned kRowBytes = kD * 2;
  static constexpr unsigned kTile = kN * kRowBytes;  // K (or V) of one stage
  static constexpr unsigned kKV = kRows * kRowBytes;  // after Q
  static constexpr unsigned kTile8 = kN * kD;  // an 8-bit cache: K (or V) bytes of one stage
  static constexpr unsigned kRing8 = kKV + 2 * kTile;
  static constexpr unsigned kScales8 = kRing8 + 2 * kStages * kTile8;
  static constexpr unsigned kOk = k8 ? kScales8 + 2 * kStages * kN * sizeof(float) : kKV + 2 * kStages * kTile;
  static constexpr unsigned kAlign = 1024;
  static constexpr unsigned kFirst = kOk + sizeof(int) * kStages * kN;  // int [kRows]: rows' first keys
  static_assert(kFirst % sizeof(int) == 0, "first keys");
  static constexpr size_t kBytes = kFirst + sizeof(int) * kRows + kAlign;  // + the alignment slack
  static_assert(kChunks % 8 == 0, "swizzle");
  __device__ static unsigned row(unsigned base, int r, int c) {  // byte c * 16 of row r, swizzled
    return base + r * kRowBytes + ((c ^ (r & 7)) << 4);
  }
  __device__ static unsigned kv(unsigned base, int stage, int kind) {
    return base + kKV + (stage * 2 + kind) * kTile;
  }
  __device__ static unsigned bytes8(unsigned base, int stage, int kind) {  // 8-bit rows
    return base + kRing8 + (stage * 2 + kind) * kTile8;
  }
  __device__ static unsigned scales8(unsigned base, int stage, int kind) {  // float [kN]
    return base + kScales8 + (stage * 2 + kind) * kN * sizeof(float);
  }
};

// KT: T (a cache of q's dtype) or E4M3 / E5M2 / S8 (an 8-bit cache, converted tile by tile).
template <int kD, class T, class KT = T>
__global__ void __launch_bounds__(kThreads, 2) prefill_tc_kernel(const AttentionProblem p) {
  constexpr bool k8 = !std::is_same_v<KT, T>;
  using PT = std::conditional_t<k8, __nv_bfloat16, T>;  // P and V in the P V MMA
  using L = PrefillLayout<kD, k8>;
  constexpr int kM = L::kM, kN = L::kN, kChunks = L::kChunks;
  constexpr int kSt = kN / 8, kOt = kD / 8;  // 8-column fragments of S and of O
  constexpr int kLanes = kThreads / kN;  // copy lanes a key
  constexpr int kCopyChunks = k8 ? kD / 16 : kChunks;  // 16-byte chunks a key copies, K or V
  static_assert(kThreads % kN == 0 && kThreads % L::kRows == 0 && kCopyChunks % kLanes == 0 &&
                (!k8 || kLanes >= 2), "copy geometry");
  extern __shared__ __align__(128) unsigned char smem[];
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned base = (raw + L::kAlign - 1) & ~(L::kAlign - 1);
  unsigned char* const aligned = smem + (base - raw);  // generic pointer of `base`
  int* const ok_flags = reinterpret_cast<int*>(aligned + L::kOk);
  const bool token_scales = k8 && p.scales.k != nullptr;

  const PrefillTile q_tile(p, L::kRows);
  const int b = q_tile.b, kvh = q_tile.kvh;
  const int32_t n_max = q_tile.n_max;
  const int tiles = q_tile.tiles(kN);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The window: first keys grow with t, so the block's first query has the smallest (f_min: its
  // tile is the first read) and its last live one the largest (f_max: tiles from there on need no
  // window mask). Full attention: both 0. A window <= 0 shows no key: no tile is read (zeros).
  const int32_t window = *p.window;
  int32_t f_min = 0, f_max = 0;
  if (n_max > 0) {
    const int t_last = min(q_tile.t0 + q_tile.per_tile, min(p.tokens, p.counts[b])) - 1;
    f_min = p.first_key(b, q_tile.t0, window);
    f_max = p.first_key(b, t_last, window);
  }
  const int first_tile = window > 0 ? f_min / kN : tiles;
  __builtin_assume(first_tile >= 0);  // (unsigned tile arithmetic below, as from 0)
  int* const first_keys = ok_flags + L::kStages * kN;  // at L::kFirst
  if (threadIdx.x < L::kRows) {  // row r's, for the mask (read after the loop's first barrier)
    const PrefillTile::Row q = q_tile.row(p, threadIdx.x);
    first_keys[threadIdx.x] = q_tile.keys(p, q) > 0 ? p.first_key(b, q.t, window) : 0;
  }

  // Q (rows past the tile's tokens, T or the count are zeros, masked below): kThreads / kRows
  // lanes a row, every kQLanes-th chunk each.
  {
    constexpr int kQLanes = kThreads / L::kRows;
    const int r = threadIdx.x / kQLanes, c0 = threadIdx.x % kQLanes;
    const PrefillTile::Row q = q_tile.row(p, r);
    const bool live = q.live;
    const char* src = live ? p.q + (q_tile.q_index(p, q) + c0 * 8) * 2 : p.q;
    const unsigned dst = L::row(base, r, c0);
#pragma unroll
    for (int y = 0; y < kChunks / kQLanes; ++y) copy16(dst ^ (y * kQLanes * 16), src + (live ? y * kQLanes * 16 : 0), live);
  }
  // K and V of tile i into its stage, one commit group; true when a key below n_max has no page.
  // kLanes threads a key (one key a thread), every kLanes-th chunk each: one table entry per key
  // serves K and V.
  const KVView& kv = p.kv;
  const int c_copy = threadIdx.x % kLanes, j_copy = threadIdx.x / kLanes;
  const int layer = q_tile.layer_ok ? *p.layer : 0;
  const int64_t head_base = layer * kv.layer_stride + kvh * kv.head_stride + c_copy * 16;
  const int32_t* table = kv.page_table ? kv.page_table + int64_t{b} * kv.max_pages : nullptr;
  // The table entry of this thread's key of tile i (-1: past n_max, or below `lo`: before the
  // block's window, never looked up nor read), loaded a tile ahead of its use.
  auto fetch = [&](int i, int32_t lo) -> int32_t {
    const int32_t pos = i * kN + j_copy;
    if (pos >= n_max || pos < lo) return -1;
    return table ? table[kv.column(pos)] : b;
  };
  const int64_t scale_base = layer * p.scales.layer_stride + kvh * p.scales.head_stride;
  auto issue = [&](int i, int32_t page) {
    const int32_t pos = i * kN + j_copy;
    const bool live = pos < n_max && kv.holds(page);
    const int64_t off = live ? head_base + page * kv.page_stride + int64_t{kv.slot(pos)} * kv.token_stride : 0;
#pragma unroll
    for (int kind = 0; kind < 2; ++kind) {
      const char* src = (kind == 0 ? kv.k : kv.v) + off;
      if constexpr (k8) {  // rows of kD bytes: this thread's chunks c_copy + y kLanes
        const unsigned dst = L::bytes8(base, i % L::kStages, kind) + j_copy * kD + c_copy * 16;
#pragma unroll
        for (int y = 0; y < kCopyChunks / kLanes; ++y) copy16(dst + y * kLanes * 16, src + (live ? y * kLanes * 16 : 0), live);
      } else {
        const unsigned dst = L::row(L::kv(base, i % L::kStages, kind), j_copy, c_copy);
#pragma unroll
        for (int y = 0; y < kChunks / kLanes; ++y) copy16(dst ^ (y * kLanes * 16), src + (live ? y * kLanes * 16 : 0), live);
      }
    }
    if (token_scales && c_copy < 2) {  // lane 0 of a key its K scale, lane 1 its V scale
      const int64_t so = live ? scale_base + page * p.scales.page_stride + int64_t{kv.slot(pos)} * p.scales.token_stride : 0;
      float* dst = reinterpret_cast<float*>(aligned + (L::scales8(base, i % L::kStages, c_copy) - base)) + j_copy;
      copy_async(dst, (c_copy == 0 ? p.scales.k : p.scales.v) + so, live);
    }
    copy_commit();
    if (c_copy == 0) ok_flags[(i % L::kStages) * kN + j_copy] = live;
    return pos < n_max && !live;
  };
  // Bit k: tile i + k needs the mask for a key without a page or the window's lower edge (tile
  // i: the one read now). The edge's tiles, those below f_max, are set here: at most 127 / kN + 2
  // (f_max - f_min < the tile's tokens). Only the first tile can hold keys before the window
  // (INT_MIN: no bound, folded away).
  const int edge = (f_max + kN - 1) / kN - first_tile;
  unsigned missing = edge > 0 ? ~0u >> (32 - min(edge, 32)) : 0u;
  missing |= issue(first_tile, fetch(first_tile, f_min));  // its group also holds Q
  if (first_tile + 1 < tiles) missing |= unsigned{issue(first_tile + 1, fetch(first_tile + 1, INT_MIN))} << 1;
  else copy_commit();  // empty groups keep the count of pending groups fixed
  int32_t ahead = fetch(first_tile + 2, INT_MIN);  // tile i + 2's entry

  // Rows of this thread: tile mi, half hf (fragment rows g and g + 8).
  int32_t n_row[kM][2];
#pragma unroll
  for (int mi = 0; mi < kM; ++mi)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      n_row[mi][hf] = q_tile.keys(p, q_tile.row(p, warp * 16 * kM + mi * 16 + lane / 4 + 8 * hf));
    }
  // ldmatrix addresses of this lane at column 0 (k-step 0): Q rows of the warp, K and V rows of
  // stage 0; 16 columns further is an XOR with 32.
  const unsigned q_lane = L::row(base, warp * 16 * kM + lane % 16, lane / 16);
  const unsigned k_lane = L::row(L::kv(base, 0, 0), (lane / 16) * 8 + lane % 8, (lane / 8) % 2);
  const unsigned v_lane = L::row(L::kv(base, 0, 1), ((lane / 8) % 2) * 8 + lane % 8, lane / 16);
  // Scores stay raw, scaled inside each exponent (one FFMA): m is the maximum raw score, which
  // needs a positive scale. A negative one negates Q instead (exact in bf16 / f16); 0 becomes the
  // smallest normal float (every weight 1, as with 0).
  float qscale = p.scale * kLog2e * *p.k_scale;
  if (qscale < 0.f) {
    copy_wait<0>();  // this thread's Q chunks (it negates only those)
    constexpr int kQLanes = kThreads / L::kRows;
    const unsigned dst = L::row(base, threadIdx.x / kQLanes, threadIdx.x % kQLanes);
#pragma unroll
    for (int y = 0; y < kChunks / kQLanes; ++y) negate16(dst ^ (y * kQLanes * 16));
    qscale = -qscale;
  }
  qscale = fmaxf(qscale, FLT_MIN);
  // A soft cap c (base 2: soft_cap log2 e; FLT_MAX for a cap past it, as good as none): scores
  // become tanh(raw qscale / c), weighed by c in the exponent.
  float inv_cap = 0.f;  // qscale / c: raw units to the cap's
  if (p.soft_cap > 0.f) {
    const float c = fminf(p.soft_cap * kLog2e, FLT_MAX);
    inv_cap = qscale / c;
    qscale = c;
  }
  float o[kM][kOt][4] = {}, m[kM][2], l[kM][2] = {};
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) m[mi][0] = m[mi][1] = -INFINITY;

  for (int i = first_tile; i < tiles; ++i) {
    const int st = i % L::kStages;
    copy_wait<L::kStages - 2>();  // this tile (and Q)
    // One barrier a tile: tile i landed for every warp, and every warp is done with tile i - 1,
    // whose stage tile i + 2 refills.
    const bool mask = __syncthreads_or(missing & 1u) || (i + 1) * kN > q_tile.n_min;
    missing >>= 1;
    if (i + 2 < tiles) missing |= unsigned{issue(i + 2, ahead)} << 1;
    else copy_commit();
    ahead = fetch(i + 3, INT_MIN);
    if constexpr (k8) {  // the tile's bytes into the converted 16-bit tiles: this thread's chunks
#pragma unroll
      for (int kind = 0; kind < 2; ++kind) {
        const unsigned char* from = aligned + (L::bytes8(base, st, kind) - base) + j_copy * kD;
        unsigned char* to = aligned + (L::kv(base, 0, kind) - base) + j_copy * L::kRowBytes;
        const bool to_bf16 = kind == 1 || std::is_same_v<T, __nv_bfloat16>;
#pragma unroll
        for (int y = 0; y < kCopyChunks / kLanes; ++y) {
          const int c = c_copy + y * kLanes;  // 16 bytes -> 16-bit chunks 2c, 2c + 1 of the row
          const uint4 w = *reinterpret_cast<const uint4*>(from + c * 16);
          const uint32_t u[4] = {w.x, w.y, w.z, w.w};
          uint32_t h[8];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            Tc8<KT>::to_h2(u[e], h[2 * e], h[2 * e + 1]);
            if (to_bf16) h[2 * e] = half2_to_bf16x2(h[2 * e]), h[2 * e + 1] = half2_to_bf16x2(h[2 * e + 1]);
          }
          *reinterpret_cast<uint4*>(to + (((2 * c) ^ (j_copy & 7)) << 4)) = make_uint4(h[0], h[1], h[2], h[3]);
          *reinterpret_cast<uint4*>(to + (((2 * c + 1) ^ (j_copy & 7)) << 4)) = make_uint4(h[4], h[5], h[6], h[7]);
        }
      }
      __syncthreads();  // the converted tiles are complete
    }
    const int ring = k8 ? 0 : st;  // the 16-bit tiles the MMAs read

    // S = Q K^T: per 16 dims, A from Q, two 8-key B fragments per ldmatrix.
    const unsigned k_st = k_lane + ring * 2 * L::kTile;
    float s[kM][kSt][4] = {};
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      uint32_t a[kM][4];
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) ldmatrix_x4<false>(a[mi], (q_lane ^ (ks << 5)) + mi * 16 * L::kRowBytes);
#pragma unroll
      for (int np = 0; np < kSt / 2; ++np) {
        uint32_t kb[4];
        ldmatrix_x4<false>(kb, (k_st ^ (ks << 5)) + np * 16 * L::kRowBytes);
#pragma unroll
        for (int mi = 0; mi < kM; ++mi) {
          mma_16816<T>(s[mi][2 * np], a[mi], kb[0], kb[1]);
          mma_16816<T>(s[mi][2 * np + 1], a[mi], kb[2], kb[3]);
        }
      }
    }
    // Scales per token: K's on its scores (before the maximum), V's for the weights below.
    float vsc[kSt][2];
    if (token_scales) {
      const float* ks = reinterpret_cast<const float*>(aligned + (L::scales8(base, st, 0) - base));
      const float* vs = reinterpret_cast<const float*>(aligned + (L::scales8(base, st, 1) - base));
#pragma unroll
      for (int nt = 0; nt < kSt; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int jt = nt * 8 + 2 * (lane % 4) + e;
          const float f = ks[jt];
          vsc[nt][e] = vs[jt];
#pragma unroll
          for (int mi = 0; mi < kM; ++mi) s[mi][nt][e] *= f, s[mi][nt][2 + e] *= f;
        }
    }
    if (p.soft_cap > 0.f) {  // uniform; before the masks (a capped -inf would be finite)
#pragma unroll
      for (int mi = 0; mi < kM; ++mi)
#pragma unroll
        for (int nt = 0; nt < kSt; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mi][nt][e] = tanh_approx(s[mi][nt][e] * inv_cap);
    }

    // Masked tiles (rare: the diagonal, a window's lower edge, keys without a page): those
    // scores to -inf.
    if (mask) {
      const int* ok = ok_flags + st * kN;
      int32_t f_row[kM][2];
#pragma unroll
      for (int mi = 0; mi < kM; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) f_row[mi][hf] = first_keys[warp * 16 * kM + mi * 16 + lane / 4 + 8 * hf];
#pragma unroll
      for (int nt = 0; nt < kSt; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int jt = nt * 8 + 2 * (lane % 4) + e;
          const bool held = ok[jt] != 0;
#pragma unroll
          for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
              if (!held | (i * kN + jt >= n_row[mi][hf]) | (i * kN + jt < f_row[mi][hf])) s[mi][nt][2 * hf + e] = -INFINITY;
        }
    }
    // The online softmax on the fragments (4 lanes share a row): every row's maximum first
    // (trees, then the shuffles of all rows together: independent chains), then the weights; P
    // as A fragments of P V.
    float mx[kM][2];
#pragma unroll
    for (int mi = 0; mi < kM; ++mi)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float t[kSt];
#pragma unroll
        for (int nt = 0; nt < kSt; ++nt) t[nt] = fmaxf(s[mi][nt][2 * hf], s[mi][nt][2 * hf + 1]);
#pragma unroll
        for (int w = kSt / 2; w >= 1; w /= 2)
#pragma unroll
          for (int nt = 0; nt < w; ++nt) t[nt] = fmaxf(t[nt], t[nt + w]);
        mx[mi][hf] = fmaxf(m[mi][hf], t[0]);
      }
#pragma unroll
    for (int x = 1; x <= 2; x *= 2)
#pragma unroll
      for (int mi = 0; mi < kM; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) mx[mi][hf] = fmaxf(mx[mi][hf], __shfl_xor_sync(0xffffffffu, mx[mi][hf], x));
    uint32_t pa[kM][kN / 16][4];  // P in PT
    bool moved = false;
#pragma unroll
    for (int mi = 0; mi < kM; ++mi)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float top = mx[mi][hf];
        const float alpha = top == -INFINITY ? 1.f : fast_exp2((m[mi][hf] - top) * qscale);
        moved |= alpha != 1.f;
        const float mb = top == -INFINITY ? 0.f : top * qscale;
        float sums[kSt];
#pragma unroll
        for (int nt = 0; nt < kSt; ++nt) {
          const float p0 = fast_exp2(fmaf(s[mi][nt][2 * hf], qscale, -mb));
          const float p1 = fast_exp2(fmaf(s[mi][nt][2 * hf + 1], qscale, -mb));
          sums[nt] = p0 + p1;
          pa[mi][nt / 2][(nt % 2) * 2 + hf] =
              token_scales ? pack2<PT>(p0 * vsc[nt][0], p1 * vsc[nt][1]) : pack2<PT>(p0, p1);
        }
#pragma unroll
        for (int w = kSt / 2; w >= 1; w /= 2)
#pragma unroll
          for (int nt = 0; nt < w; ++nt) sums[nt] += sums[nt + w];
        m[mi][hf] = top;
        l[mi][hf] = l[mi][hf] * alpha + sums[0];  // this lane's columns; the row's sum at the end
        s[mi][0][2 * hf] = alpha;  // kept for the rescale below
      }
    // O *= alpha only when some row's maximum moved (rarely, after the first tiles).
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int mi = 0; mi < kM; ++mi)
#pragma unroll
        for (int dt = 0; dt < kOt; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[mi][dt][e] *= s[mi][0][2 * (e / 2)];
    }

    // O += P V, V read transposed: two 8-column fragments of O per ldmatrix.
    const unsigned v_st = v_lane + ring * 2 * L::kTile;
#pragma unroll
    for (int dp = 0; dp < kOt / 2; ++dp) {
      const unsigned v_dp = v_st ^ (dp << 5);
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) {
        uint32_t vb[4];
        ldmatrix_x4<true>(vb, v_dp + kk * 16 * L::kRowBytes);
#pragma unroll
        for (int mi = 0; mi < kM; ++mi) {
          mma_16816<PT>(o[mi][2 * dp], pa[mi][kk], vb[0], vb[1]);
          mma_16816<PT>(o[mi][2 * dp + 1], pa[mi][kk], vb[2], vb[3]);
        }
      }
    }
  }
  copy_wait<0>();

  // Output: O / l (with a sink in l: sink_norm, m in base 2 as l's weights); zeros for a row with
  // no key; rows past the tile, T are not written.
#pragma unroll
  for (int mi = 0; mi < kM; ++mi)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float sum = l[mi][hf];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const PrefillTile::Row q = q_tile.row(p, warp * 16 * kM + mi * 16 + lane / 4 + 8 * hf);
      if (!q.live) continue;
      const bool live = n_row[mi][hf] > 0 && sum != 0.f;
      const float norm = live ? *p.v_scale * sink_norm(m[mi][hf] * qscale, sum, sink_log2(p, q.head)) : 0.f;
      T* out = reinterpret_cast<T*>(p.out) + q_tile.q_index(p, q) + 2 * (lane % 4);
#pragma unroll
      for (int dt = 0; dt < kOt; ++dt) {
        const uint32_t w = live ? pack2<T>(o[mi][dt][2 * hf] * norm, o[mi][dt][2 * hf + 1] * norm) : 0u;
        *reinterpret_cast<uint32_t*>(out + dt * 8) = w;
      }
    }
}

// The tensor-core path takes groups within the row tile and shared memory within the device's
// opt-in limit.
template <int kD, class T, class KT>
using PrefillLayoutOf = PrefillLayout<kD, !std::is_same_v<KT, T>>;

template <int kD, class T, class KT>
bool tc_eligible(const AttentionProblem& p) {
  int device = 0, limit = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  return p.group <= PrefillLayoutOf<kD, T, KT>::kRows &&
         PrefillLayoutOf<kD, T, KT>::kBytes <= static_cast<size_t>(limit);
}

template <int kD, class T, class KT>
ffi::Error launch_prefill_tc(cudaStream_t stream, const AttentionProblem& p) {
  using L = PrefillLayoutOf<kD, T, KT>;
  allow_shared_memory(prefill_tc_kernel<kD, T, KT>, L::kBytes);
  prefill_tc_kernel<kD, T, KT><<<PrefillTile::grid(p, L::kRows), kThreads, L::kBytes, stream>>>(p);
  return cuda_status("attention.prefill");
}

// The tensor-core prefill where it applies (q T over a cache of KT: T, or an 8-bit format);
// false: use the split-KV kernel per query token.
template <class T, class KT = T>
bool try_prefill_tc(cudaStream_t stream, const AttentionProblem& p, ffi::Error* status) {
  if (p.batch > 65535 || p.kv.heads > 65535) return false;
  switch (p.head_dim) {
    case 64:
      if (!tc_eligible<64, T, KT>(p)) return false;
      *status = launch_prefill_tc<64, T, KT>(stream, p);
      return true;
    case 128:
      if (!tc_eligible<128, T, KT>(p)) return false;
      *status = launch_prefill_tc<128, T, KT>(stream, p);
      return true;
    case 256:
      if (!tc_eligible<256, T, KT>(p)) return false;
      *status = launch_prefill_tc<256, T, KT>(stream, p);
      return true;
    default:
      return false;
  }
}

}  // namespace

bool launch_prefill_tc(cudaStream_t stream, const AttentionProblem& p, ffi::Error* status) {
  if (launch_prefill_wgmma(stream, p, status)) return true;
  bool launched = false;
  with_attention_types(p.q_type, p.kv_type, [&](auto q, auto kv) {
    using T = typename decltype(q)::type;
    if constexpr (!std::is_same_v<T, float>)
      launched = try_prefill_tc<T, typename decltype(kv)::type>(stream, p, status);
  });
  return launched;
}

}  // namespace jaxkv
