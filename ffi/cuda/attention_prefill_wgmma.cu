// CUDA prefill attention on Hopper's warpgroup MMA (wgmma, sm_90a): a bf16 / f16 q over a cache
// of its dtype or an 8-bit one (fp8 e4m3 / e5m2, int8) at head_dim 128, or over a cache of its
// dtype at head_dim 256. Elsewhere (another GPU or head_dim) the mma.sync kernel of
// attention_prefill.cu runs.
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <climits>
#include <cstdlib>
#include <string_view>

#include "attention_device.cuh"
#include "wgmma.cuh"

namespace jaxkv {
namespace {

// FlashAttention-3's forward, without its copy engine (TMA): persistent blocks (one a
// multiprocessor, WgItems) of three warpgroups, each taking items (token tile, KV head, row b) of
// 128 query rows (128 / group new tokens x the group's q heads) in turn, the stages' ring running
// on from one item to the next, so that no block starts or ends between items: the producer
// loads an item's Q and tiles while the consumers write the one before's output (a 16-bit cache's
// Q, and then its tiles, once their last MMAs have read Q; an 8-bit cache's tiles sooner). The
// producer (warps 0-3, most of its registers given to the others by setmaxnreg; 16 lanes a key of
// a 16-bit cache, two of an 8-bit one) looks up the pages and streams K/V tiles of 128 keys by
// cp.async through three shared-memory stages (at head_dim 256 tiles of 64 keys through two),
// each with two mbarriers: `full` (the tile landed: each producer thread's cp.async arrival, and a
// plain arrival after the flags of the keys it looked up) and `empty` (both consumers are done with it; its refill
// waits). The two consumers (64 rows each) never meet at a block barrier, so they run out of
// phase: they take turns at the tensor cores (two named barriers), and one's softmax (its
// exponentials are a quarter of the tensor cores' time) overlaps the other's MMAs. A turn issues
// O += P V of tile i (P from registers, V read MN-major) and S = Q K^T of tile i + 1 (m64nNk16, Q
// and K from shared memory); then the online softmax of tile i + 1 on the accumulators. A
// soft-capped prefill over a 16-bit cache at head_dim 128 (three stages) issues S(i + 1) first and
// runs its softmax while P V(i) is still on the tensor cores (FlashAttention-3's overlap inside a
// warpgroup; launch_wgmma says where it pays). Masks (causal, keys without a page) only on the
// tiles that need them; token tiles run longest first. The page lookups and masks are the
// mma.sync kernel's.
//
// An 8-bit cache's producer copies the bytes of tile i + 1 (cp.async, into one of two byte stages)
// while it converts tile i from the other into the 16-bit stages, and a consumer waits for tile
// i + 1 only after issuing P V of tile i, so that the conversion runs beside that MMA. An int8 cache
// (and an fp8 one under a float16 q) runs both MMAs in f16, in which every 8-bit value is exact
// (one instruction converts a pair, docs/perf-notes.md item 36), K and V converted into two 16-bit
// stages (two, where a 16-bit cache has three, set its time: the bf16 path given two takes as long,
// perf notes item 47). An fp8 cache under a bfloat16 q keeps three stages: S = Q K^T runs in e4m3
// on K's bytes as stored (copied into the stage as they are, a 16 KiB K stage where f16 takes 32),
// Q as two e4m3 tiles, hi = e4m3(q 2^e) and lo = e4m3(q 2^e - hi), which hold a bf16 value exactly
// (its residual has at most 4 significant bits; a float16 one's has 7, item 48); only V is
// converted, from byte stages of its own. Per-token scales (a template argument, so that a cache
// scaled per tensor carries none of their work): the consumers multiply K's into the scores; V's,
// over `vref` and rounded to f16, multiply V as the producer converts it (fp8) or P before it is
// rounded to f16 (int8, whose producer converts K too, item 46): two roundings to 11 bits, where
// bf16 had one to 8. vref is a power of two above every V scale of the row's keys, found before
// the prefill by v_max_kernel (so that the producer's warps need not agree on one a tile), the
// same in the whole block; O is multiplied by it at the end. The consumers convert their own rows
// of Q (int8: to f16 times a power of two a row, exact for a bf16 or f16 q but for values below
// 2^-28 of the row's largest), the power of two divided out of the float32 scores with K's
// per-token scales. JAXKV_NO_WGMMA=1 in the environment takes the mma.sync kernel instead (to
// compare).
//
// A window (*p.window, read once): both roles run the tiles from the one holding the item's first
// query's first key (the smallest; first keys grow with t) to its last query's end, so no tile
// wholly before the window is loaded, and the producer treats keys before that first key as keys
// without a page (never read). The consumers mask each row's keys before its own first key on the
// tiles that meet the window's lower edge (keys below the last query's first key), beside the
// causal mask. A soft cap (p.soft_cap > 0, a uniform branch on each tile) replaces each raw score,
// after K's per-token scales, by tanh of it over the cap, the cap moved into the exponents'
// factor; sinks enter at the final normalization (sink_norm, with the row's
// running maximum times qs: base 2, as its sum).
constexpr int kWgThreads = 384;  // the producer and two consumers
constexpr int kWgRows = 128;     // query rows a block
using QTile = SwizzledTile<kWgRows>;
// Keys a K/V tile at head_dim kD (128 or 256): 128; at 256, 64, as FlashAttention-3 (80 there),
// where Q (64 KiB) and two stages of a K and a V tile (32 KiB each) fill the shared memory, and
// a consumer's O (128 floats a thread) leaves room for S (32) and P (16) in its registers.
template <int kD>
constexpr int kWgKeys = kD == 256 ? 64 : 128;

// Bytes from the 1024-aligned base: Q, per stage K, per stage V, an 8-bit cache's two stages of its
// bytes (cp.async, converted from there: int8 K and V, fp8 V), per stage the key flags (a byte a
// key), an 8-bit cache's per stage K scales (float a key) and V scales over vref (f16 a key), per
// stage the ring's last tile (g + 1) with a key without a page, two slots of the items taken
// (WgItems), the mbarriers (full, then empty, then q_free, then the slots' full and empty).
// 227 KiB at most (Hopper's opt-in limit).
template <bool k8, bool f8k = false, int kD = 128>
struct WgLayout {
  static constexpr int kN = kWgKeys<kD>;
  // Stages: one tile read, two in flight (an int8 cache: one; its bytes are in flight in the byte
  // stages, and a consumer waits for tile i + 1 only once it has issued P V of tile i). An fp8
  // cache's K stages hold its bytes (read as they are by the e4m3 MMA), and only V has byte stages.
  // At head_dim 256 two stages (192 KiB with Q; a third would not fit), waited for as an int8
  // cache's.
  static constexpr int kStages = kD == 256 || (k8 && !f8k) ? 2 : 3;
  static constexpr unsigned kQ = kWgRows * kD * 2;  // f16, or an fp8 cache's two e4m3 tiles
  static constexpr unsigned kKTile = kN * kD * (f8k ? 1 : 2), kVTile = kN * kD * 2;
  static constexpr unsigned kBytesTile = k8 ? (f8k ? 1 : 2) * kN * kD : 0;  // bytes of a tile
  static constexpr unsigned kRaw = kQ + kStages * (kKTile + kVTile);
  static constexpr unsigned kOk = kRaw + 2 * kBytesTile;
  static constexpr unsigned kKs = kOk + kStages * kN;
  static constexpr unsigned kMissing = kKs + (k8 ? (sizeof(float) + sizeof(__half)) * kStages * kN : 0);
  static constexpr unsigned kSlots = kMissing + sizeof(int) * kStages;
  static constexpr unsigned kBars = (kSlots + sizeof(int) * 2 + 7) & ~7u;
  static constexpr size_t kBytes = kBars + 8 * (2 * kStages + 5) + 1024;  // + alignment slack
  __device__ static unsigned kv(unsigned base, int stage, int kind) {
    return base + kQ + (kind == 0 ? stage * kKTile : kStages * kKTile + stage * kVTile);
  }
  __device__ static unsigned bytes(unsigned base, int stage) { return base + kRaw + stage * kBytesTile; }
  __device__ static unsigned full(unsigned base, int stage) { return base + kBars + 8 * stage; }
  __device__ static unsigned empty(unsigned base, int stage) { return base + kBars + 8 * (kStages + stage); }
  // Q is free for the next item (a 16-bit cache's, which the producer loads): the consumers' arrivals.
  __device__ static unsigned q_free(unsigned base) { return base + kBars + 16 * kStages; }
  // Slot s holds the item taken (WgItems::take), its index j with j % 2 == s: `slot_full`, the
  // producer's thread 0 wrote it; `slot_empty`, the consumers read it (the slot free for j + 2).
  __device__ static unsigned slot_full(unsigned base, int s) { return base + kBars + 8 * (2 * kStages + 1 + s); }
  __device__ static unsigned slot_empty(unsigned base, int s) { return base + kBars + 8 * (2 * kStages + 3 + s); }
};
// The most any of them takes (an 8-bit cache only at head_dim 128).
constexpr size_t kWgMaxBytes = std::max({WgLayout<false>::kBytes, WgLayout<true>::kBytes, WgLayout<true, true>::kBytes,
                                         WgLayout<false, false, 256>::kBytes});
static_assert(kWgMaxBytes <= 227 * 1024, "shared memory");

// The blocks are persistent: one a multiprocessor (grid x), each taking items (token tile, KV
// head, row b) until none is left, so that an item's loads start while the consumers finish the
// one before. Item k is token tile tiles - 1 - k % tiles (a row's longest first, causal) of KV head
// j % heads of row j / heads, j = k / tiles (the order of a block an item's grid): the items that
// run at once read few rows' keys. Block g takes item g first, then the next not taken (a counter
// in global memory, p.item_counter, zeroed before the launch) as its producer starts on one: rows
// of unequal lengths (a serving step's) leave each block's sum of work about the same, where a
// static order left the slowest block at 1.99x the mean (serving step: 525 against 862 us on an
// H100, the same output; 1-2% faster on uniform rows: perf notes item 79). The producer's
// thread 0 takes each item and hands it to the block's other threads through two slots in shared
// memory. With no counter (JAXKV_PREFILL_STATIC) a static snake instead: block g of G takes item
// r G + g in round r, or r G + G - 1 - g in an odd round.
struct WgItems {
  int token_tiles, count;
  int* counter;
  __device__ explicit WgItems(const AttentionProblem& p)
      : token_tiles(tiles_of(p)), count(token_tiles * p.kv.heads * p.batch), counter(p.item_counter) {}
  static __host__ __device__ int tiles_of(const AttentionProblem& p) {
    const int per = kWgRows / p.group;
    return (p.tokens + per - 1) / per;
  }
  __device__ int at(int round) const {  // the static snake's item of the round (>= count: none)
    const int g = blockIdx.x, n = gridDim.x;
    return round * n + (round % 2 ? n - 1 - g : g);
  }
  // The block's j-th item by the counter (>= count: none; the producer's thread 0 only).
  __device__ int take(int j) const {
    return j == 0 ? static_cast<int>(blockIdx.x) : static_cast<int>(gridDim.x) + atomicAdd(counter, 1);
  }
  __device__ PrefillTile tile(const AttentionProblem& p, int k) const {
    const int j = k / token_tiles;
    return PrefillTile(p, kWgRows, token_tiles - 1 - k % token_tiles, j % p.kv.heads, j / p.kv.heads);
  }
};

// x[0] = x[0] + ... + x[2 kW - 1] (op: max or sum) by a tree (a loop of halving widths is not
// unrolled by the compiler at 16 fragments, which moves the array to local memory).
template <int kW, class Op>
__device__ __forceinline__ void tree(float* x, Op op) {
#pragma unroll
  for (int j = 0; j < kW; ++j) x[j] = op(x[j], x[j + kW]);
  if constexpr (kW > 1) tree<kW / 2>(x, op);
}

// The largest V scale of each (row b, KV head) over the keys its queries see (from its first
// query's first key to its last query's end: a page outside may be unmapped or another row's), into
// p.v_maxima[b * H + head] (zeroed before; the bits of non-negative floats order as integers): a
// block of 256 keys a (row, head), a key a thread. Every block of the prefill then takes the same
// power of two above it (v_reference). Measured on the H200 (docs/perf-notes.md item 50): this
// pass and no exchange a tile between the producer's warps, fp8 1.85 ms, against 1.96 with one.
__global__ void __launch_bounds__(256) v_max_kernel(const AttentionProblem p) {
  const int b = blockIdx.z, kvh = blockIdx.y;
  const KVView& kv = p.kv;
  const int32_t window = *p.window;
  const int32_t t_last = min(p.tokens, p.counts[b]) - 1;
  const bool any = p.layer_ok() && t_last >= 0 && window > 0;
  const int32_t n = any ? p.keys(b, t_last) : 0, first = any ? p.first_key(b, 0, window) : 0;
  const int32_t pos = blockIdx.x * 256 + threadIdx.x;
  if (blockIdx.x * 256 >= n || (blockIdx.x + 1) * 256 <= first) return;  // the same for the whole block
  float top = 0.f;
  if (pos >= first && pos < n) {
    const int32_t entry = kv.entry(b, pos);
    if (kv.holds(entry))  // fmaxf: a NaN scale (a NaN vector's) is ignored
      top = fmaxf(top, p.scales.v_float(p.scales.at_slot(*p.layer, entry, kvh, kv.slot(pos))));
  }
  __shared__ float warp_max[8];
#pragma unroll
  for (int x = 1; x < 32; x *= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, x));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = top;
  __syncthreads();
  if (threadIdx.x == 0) {
    tree<4>(warp_max, [](float a, float c) { return fmaxf(a, c); });
    if (warp_max[0] > 0.f)
      atomicMax(reinterpret_cast<int*>(p.v_maxima) + int64_t{b} * kv.heads + kvh, __float_as_int(warp_max[0]));
  }
}

// vref of the block of (row b, KV head kvh) and its reciprocal: the power of two above the row's
// largest V scale (at most 2^127; 2^-100 where none is larger).
__device__ __forceinline__ Pow2 v_reference(const AttentionProblem& p, int b, int kvh) {
  const float top = fminf(p.v_maxima[int64_t{b} * p.kv.heads + kvh], 0x1p126f);
  return top > 0x1p-100f ? pow2_above(top) : Pow2{0x1p-100f, 0x1p100f};
}

// An fp8 cache under a bfloat16 q: S = Q K^T runs in e4m3 on K's bytes as stored, Q as hi + lo
// e4m3 tiles, which hold bfloat16's 8 significant bits exactly but only 8 of float16's 11 (a
// float16 q keeps the float16 path: tests/test_quantized.py::test_prefill_keeps_every_bit_of_q).
template <class T, class KT>
constexpr bool kFp8K = std::is_same_v<T, __nv_bfloat16> && (std::is_same_v<KT, E4M3> || std::is_same_v<KT, E5M2>);

// KT: T (a cache of q's dtype) or E4M3 / E5M2 / S8 (an 8-bit cache); kTokenScales: an 8-bit
// cache's scales per token (else one per tensor, in p.k_scale and p.v_scale), fixed at compile
// time so that neither path carries the other's branches. kD: head_dim, 128 or 256 (a 16-bit
// cache only).
template <class T, class KT = T, bool kTokenScales = false, int kD = 128, bool kOverlap = false>
__global__ void __launch_bounds__(kWgThreads, 1) prefill_wgmma_kernel(const AttentionProblem p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool k8 = !std::is_same_v<KT, T>;
  static_assert(kD == 128 || (kD == 256 && !k8), "head_dim 128, or 256 over a 16-bit cache");
  using MT = std::conditional_t<k8, __half, T>;  // both MMAs' operands (Q, K; P, V)
  constexpr bool f8k = kFp8K<T, KT>;
  using L = WgLayout<k8, f8k, kD>;
  constexpr int kN = L::kN;           // keys a K/V tile
  constexpr int kPasses = kN / 64;    // the producer's passes over a tile, 64 keys each
  using KVTile = SwizzledTile<kN>;
  constexpr int kConsumers = 256;
  // Registers a thread after setmaxnreg (the launch's 168 x 384 redistributed): an 8-bit cache's
  // producer holds a key's K and V bytes while it converts them. At head_dim 256 (a consumer's O
  // alone takes 128) 48 and 224 leave no spill in the producer or the consumers' loop (ptxas,
  // CUDA 13.0: a few words at the consumers' start and end; 40 and 232 spill in the producer's
  // loop, 56 and 208 in the consumers'). The overlap's second P buffer takes 232 at head_dim 128,
  // where the producer (16 lanes a key) runs in 40 without a spill (SASS: no local memory).
  constexpr int kProducerRegs = k8 ? 72 : kD == 256 ? 48 : kOverlap ? 40 : 56;
  constexpr int kConsumerRegs = k8 ? 216 : kOverlap ? 232 : 224;
  // setmaxnreg moves registers within the block's launch allotment (168 a thread at 384 threads).
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kWgThreads * 168, "the registers");
  constexpr int kChunks = kD / 8;  // 16-byte chunks of a row
  extern __shared__ __align__(128) unsigned char smem[];
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned base = (raw + 1023) & ~1023u;
  unsigned char* const ok_flags = smem + (base - raw) + L::kOk;
  float* const k_scales = reinterpret_cast<float*>(smem + (base - raw) + L::kKs);  // k8 only
  __half* const v_factors = reinterpret_cast<__half*>(k_scales + L::kStages * kN);  // k8 only
  constexpr bool token_scales = k8 && kTokenScales;
  int* const missing_at = reinterpret_cast<int*>(smem + (base - raw) + L::kMissing);
  volatile int* const slots = reinterpret_cast<int*>(smem + (base - raw) + L::kSlots);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < L::kStages; ++st) {
      mbar_init(L::full(base, st), k8 && !f8k ? 128 : 2 * 128);  // the producer's threads, one or two arrivals each
      mbar_init(L::empty(base, st), kConsumers);
      missing_at[st] = 0;
    }
    mbar_init(L::q_free(base), kConsumers);
    for (int s = 0; s < 2; ++s) {
      mbar_init(L::slot_full(base, s), 1);
      mbar_init(L::slot_empty(base, s), kConsumers);
    }
  }
  __syncthreads();

  // The window: an item's keys are [f_min, n_max), f_min its first query's first key; its tiles
  // (the producer's and the consumers' alike) start there, tile i's first key key0 + i kN (not
  // rounded down to a multiple of kN: a window's span of 1024 + 31 keys takes 9 tiles, not 9 or
  // 10). A window <= 0 shows no key.
  const int32_t window = *p.window;
  const WgItems items(p);
  // The block's j-th item: the producer's thread 0 takes it (once the consumers have read slot
  // j % 2's item j - 2) and writes it to the slot; the producer's warps read it after a barrier of
  // theirs, the consumers after its mbarrier (and then free the slot).
  auto producer_item = [&](int j) {
    if (items.counter == nullptr) return items.at(j);
    const int s = j % 2;
    if (threadIdx.x == 0) {
      const int k = items.take(j);
      if (j >= 2) mbar_wait(L::slot_empty(base, s), (j / 2 - 1) & 1);
      slots[s] = k;
      mbar_arrive(L::slot_full(base, s));
    }
    named_sync(3, 128);
    return slots[s];
  };
  auto consumer_item = [&](int j) {
    if (items.counter == nullptr) return items.at(j);
    const int s = j % 2;
    mbar_wait(L::slot_full(base, s), (j / 2) & 1);
    const int k = slots[s];
    mbar_arrive(L::slot_empty(base, s));
    return k;
  };
  struct Item {
    PrefillTile q_tile;
    int32_t key0;
    int tiles;
  };
  auto item_at = [&](int k) {
    const PrefillTile q_tile = items.tile(p, k);
    const int32_t f_min = q_tile.n_max > 0 ? p.first_key(q_tile.b, q_tile.t0, window) : 0;
    const int tiles = window > 0 && q_tile.n_max > f_min ? (q_tile.n_max - f_min + kN - 1) / kN : 0;
    return Item{q_tile, f_min, tiles};
  };
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Raw scores, scaled inside each exponent; a negative scale negates Q (exact), 0 becomes the
  // smallest normal float (as the mma.sync kernel). An 8-bit cache's consumers load Q themselves.
  const float q_scale_signed = p.scale * kLog2e * *p.k_scale;
  const float q_sign = q_scale_signed < 0.f ? -1.f : 1.f;
  const float qscale = fmaxf(fabsf(q_scale_signed), FLT_MIN);

  if (warp < 4) {  // the producer
    set_registers<false, kProducerRegs>();
    // The producer's threads copy two lanes a row of Q or a key of an 8-bit cache's K/V tile (so
    // that a warp's 16-byte copies fill whole 32-byte sectors), every other chunk each, in passes
    // of 64 rows (Q two, a K/V tile kPasses):
    // chunk c_copy + 2 y of row r in block y / 4, at the row's offset of chunk c_copy XOR
    // (2 y % 8) * 16 (SwizzledTile::chunk with the constant part taken out of the loop).
    const int c_copy = threadIdx.x % 2, r_half = (threadIdx.x % 128) / 2;  // rows r_half + 64 pass
    auto row_off = [&](int r) { return r * 128u + ((c_copy ^ (r & 7)) << 4); };
    auto chunk_at = [&](unsigned tile, unsigned block, unsigned off, int y) {
      return tile + (y / 4) * block + (off ^ ((2 * y % 8) << 4));
    };
    const KVView& kv = p.kv;
    // ring: the tiles of the block's earlier items (tile i's stage (ring + i) % kStages); q_loads:
    // its Qs.
    int ring = 0, q_loads = 0;
    for (int j = 0, k; (k = producer_item(j)) < items.count; ++j) {
      const Item item = item_at(k);
      const PrefillTile& q_tile = item.q_tile;
      const int b = q_tile.b, kvh = q_tile.kvh, tiles = item.tiles;
      const int32_t n_max = q_tile.n_max, f_min = item.key0, key0 = item.key0;
      if (tiles == 0) continue;  // its consumers write zeros
      if constexpr (!k8) {
        // Q (tracked by tile 0's arrival), once the consumers' last S = Q K^T of the block's item
        // before has read it: rows past the tile's tokens, T or the count are zeros.
        if (q_loads > 0) mbar_wait(L::q_free(base), (q_loads - 1) & 1);
        ++q_loads;
#pragma unroll
        for (int pass = 0; pass < 2; ++pass) {
          const int r = r_half + 64 * pass;
          const PrefillTile::Row q = q_tile.row(p, r);
          const bool live = q.live;
          const char* src = live ? p.q + q_tile.q_index(p, q) * 2 : p.q;
#pragma unroll
          for (int y = 0; y < kChunks / 2; ++y)
            copy16(chunk_at(base, QTile::kBlock, row_off(r), y), src + (live ? (c_copy + 2 * y) * 16 : 0), live);
        }
        if (q_sign < 0.f) {  // the same for every thread; tile 0's plain arrival comes after
          asm volatile("cp.async.wait_all;\n" ::: "memory");  // its chunks landed (it negates only those)
#pragma unroll
          for (int pass = 0; pass < 2; ++pass)
#pragma unroll
            for (int y = 0; y < kChunks / 2; ++y) negate16(chunk_at(base, QTile::kBlock, row_off(r_half + 64 * pass), y));
          fence_async_shared();
        }
      }
      const int layer = q_tile.layer_ok ? *p.layer : 0;
      const int64_t head_base = layer * kv.layer_stride + kvh * kv.head_stride;
      const int32_t* table = kv.page_table ? kv.page_table + int64_t{b} * kv.max_pages : nullptr;
      // Whether key pos is one of the item's, [f_min, n_max) (one unsigned compare): a key before
      // the window is not read, as one past the last query's end (its page may be another row's).
      auto in_keys = [&](int32_t pos) {
        return static_cast<uint32_t>(pos - f_min) < static_cast<uint32_t>(n_max - f_min);
      };
      if constexpr (!k8) {
        // A 16-bit cache: 16 lanes a key, a 16-byte chunk each (two at head_dim 256), so that one copy
        // instruction of a warp reads two keys' rows whole (four full 128-byte lines at head_dim 128)
        // where two lanes a key read 32 bytes of 16 lines (docs/perf-notes.md item 76). Warp w copies
        // keys [w kWarpKeys, (w + 1) kWarpKeys) of a tile; its lane l < kWarpKeys looks up key
        // w kWarpKeys + l a tile ahead and computes its offset, which the copying lanes take by
        // shuffle (-1: no page holds the key, or it is not one of the item's).
        constexpr int kKeyLanes = 16, kWarpKeys = kN / 4, kLaneChunks = kChunks / kKeyLanes;
        const int lane_c = lane % kKeyLanes, half = lane / kKeyLanes, own = warp * kWarpKeys + lane;
        auto lookup = [&](int i) -> int32_t {  // the entry of key `own` of tile i (-1: not the item's)
          const int32_t pos = key0 + i * kN + own;
          return lane < kWarpKeys && in_keys(pos) ? (table ? table[kv.column(pos)] : b) : -1;
        };
        int32_t entry = tiles > 0 ? lookup(0) : -1;
        for (int i = 0; i < tiles; ++i) {
          const int g = ring + i, st = g % L::kStages;  // the ring's tile g
          const int32_t ahead = lookup(i + 1);  // in flight while tile i is copied
          const int32_t pos = key0 + i * kN + own;
          const bool live = kv.holds(entry);
          const int64_t off = live ? head_base + entry * kv.page_stride + kv.slot(pos) * kv.token_stride : -1;
          if (g >= L::kStages) mbar_wait(L::empty(base, st), (g / L::kStages - 1) & 1);
#pragma unroll
          for (int j = 0; j < kWarpKeys / 2; ++j) {
            const int src = 2 * j + half;  // the lane that owns the key
            const int64_t key_off = __shfl_sync(0xffffffffu, off, src);
            const bool held = key_off >= 0;
            const int r = warp * kWarpKeys + src;
#pragma unroll
            for (int kind = 0; kind < 2; ++kind)
#pragma unroll
              for (int c = 0; c < kLaneChunks; ++c) {
                const int chunk = lane_c + kKeyLanes * c;
                copy16(KVTile::chunk(L::kv(base, st, kind), r, chunk),
                       (kind == 0 ? kv.k : kv.v) + (held ? key_off + chunk * 16 : 0), held);
              }
          }
          if (lane < kWarpKeys) {
            ok_flags[st * kN + own] = live;
            if (in_keys(pos) && !live) atomicMax(missing_at + st, g + 1);
          }
          mbar_arrive_copies(L::full(base, st));
          mbar_arrive(L::full(base, st));
          entry = ahead;
        }
      } else {
        // An 8-bit cache: two lanes a key (r_half), every other 16-byte word each. Its producer runs
        // two tiles ahead in the table and one in the data: tile i + 1's bytes are copied (cp.async)
        // into a byte stage and its scales loaded into registers while tile i is converted from the
        // other (an fp8 cache: V's bytes; K's of tile i are copied into the stage as they are once it
        // is free). Each thread converts the words it copied: its 16-byte words (pass, kind, y) of a
        // stage, lane-interleaved (conflict-free), need no barrier.
        const int64_t scale_base = layer * p.scales.layer_stride + kvh * p.scales.head_stride;
        auto fetch = [&](int i, int pass) -> int32_t {  // the table entry of a key of tile i
          const int32_t pos = key0 + i * kN + r_half + 64 * pass;
          if (!in_keys(pos)) return -1;
          return table ? table[kv.column(pos)] : b;
        };
        // Whether a page holds key `pass` of tile i (table entry `entry`), and its offsets in the
        // pools and in the scales.
        struct Key {
          bool live;
          int64_t off, scale_off;
        };
        auto key_at = [&](int i, int pass, int32_t entry) -> Key {
          const int32_t pos = key0 + i * kN + r_half + 64 * pass;
          const bool live = in_keys(pos) && kv.holds(entry);
          const int64_t slot = live ? kv.slot(pos) : 0;
          return {live, live ? head_base + entry * kv.page_stride + slot * kv.token_stride : 0,
                  live ? scale_base + entry * p.scales.page_stride + slot * p.scales.token_stride : 0};
        };
        auto load_scales = [&](int i, const int32_t* entries, float* k_scale, float* v_scale) {
#pragma unroll
          for (int pass = 0; pass < kPasses; ++pass) {
            const Key key = key_at(i, pass, entries[pass]);
            k_scale[pass] = key.live ? *reinterpret_cast<const float*>(p.scales.k + key.scale_off) : 0.f;
            v_scale[pass] = key.live ? *reinterpret_cast<const float*>(p.scales.v + key.scale_off) : 0.f;
          }
        };
        // The kinds with bytes to convert: K and V, an fp8 cache's V only.
        constexpr int kFirstKind = f8k ? 1 : 0, kByteKinds = 2 - kFirstKind;
        auto word_at = [&](int i, int pass, int kind, int y) {
          return L::bytes(base, i % 2) +
                 ((((pass * kByteKinds + kind - kFirstKind) * (kChunks / 4) + y) * 128) + threadIdx.x % 128) * 16u;
        };
        auto copy_bytes = [&](int i, const int32_t* entries) {  // tile i's, one commit group
#pragma unroll
          for (int pass = 0; pass < kPasses; ++pass) {
            const Key key = key_at(i, pass, entries[pass]);
#pragma unroll
            for (int kind = kFirstKind; kind < 2; ++kind)
#pragma unroll
              for (int y = 0; y < kChunks / 4; ++y)
                copy16(word_at(i, pass, kind, y), (kind == 0 ? kv.k : kv.v) + key.off + (key.live ? (c_copy + 2 * y) * 16 : 0),
                       key.live);
          }
          copy_commit();
        };
        int32_t page[kPasses], ahead[kPasses];  // tile i's entries, tile i + 1's
        float k_scale[kPasses] = {}, v_scale[kPasses] = {};  // tile i's keys' scales (scaled per token)
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) page[pass] = tiles > 0 ? fetch(0, pass) : -1, ahead[pass] = fetch(1, pass);
        if constexpr (token_scales) load_scales(0, page, k_scale, v_scale);
        if (tiles > 0) copy_bytes(0, page);
        // Scaled per token: the reciprocal of vref (exact).
        const float inv = token_scales ? v_reference(p, b, kvh).inverse : 1.f;
        for (int i = 0; i < tiles; ++i) {
          const int g = ring + i, st = g % L::kStages;  // the ring's tile g
          int32_t next[kPasses];  // in flight
#pragma unroll
          for (int pass = 0; pass < kPasses; ++pass) next[pass] = fetch(i + 2, pass);
          float k_scale_next[kPasses] = {}, v_scale_next[kPasses] = {};
          copy_bytes(i + 1, ahead);  // past the last tile: no key, zeros (a commit group all the same)
          if constexpr (token_scales) load_scales(i + 1, ahead, k_scale_next, v_scale_next);
          if (g >= L::kStages) mbar_wait(L::empty(base, st), (g / L::kStages - 1) & 1);
          if (token_scales && c_copy == 0) {  // the tile's K scales (and int8: its V scales over vref)
#pragma unroll
            for (int pass = 0; pass < kPasses; ++pass) {
              k_scales[st * kN + r_half + 64 * pass] = k_scale[pass];
              if (!f8k)  // each key's V scale over vref, rounded to f16 (as it was on V itself)
                v_factors[st * kN + r_half + 64 * pass] = __float2half_rn(v_scale[pass] * inv);
            }
          }
          if constexpr (f8k) {  // K's bytes into its stage as they are, in the MMA's swizzle
#pragma unroll
            for (int pass = 0; pass < kPasses; ++pass) {
              const Key key = key_at(i, pass, page[pass]);
#pragma unroll
              for (int y = 0; y < kChunks / 4; ++y)
                copy16(KVTile::chunk(L::kv(base, st, 0), r_half + 64 * pass, c_copy + 2 * y),
                       kv.k + key.off + (key.live ? (c_copy + 2 * y) * 16 : 0), key.live);
            }
            copy_commit();
            mbar_arrive_copies(L::full(base, st));  // once they (and tile i + 1's V bytes) landed
          }
          // This thread's bytes of tile i (tile i + 1's in flight, and an fp8 cache's K of tile i).
          copy_wait<f8k ? 2 : 1>();
#pragma unroll
          for (int pass = 0; pass < kPasses; ++pass) {
            const int r = r_half + 64 * pass;
            const int32_t pos = key0 + i * kN + r;
            const bool live = key_at(i, pass, page[pass]).live;
#pragma unroll
            for (int kind = kFirstKind; kind < 2; ++kind)
#pragma unroll
              for (int y = 0; y < kChunks / 4; ++y) {
                const uint4 wy = load16(word_at(i, pass, kind, y));
                const uint32_t u[4] = {wy.x, wy.y, wy.z, wy.w};
                uint32_t h[8];
#pragma unroll
                for (int e = 0; e < 4; ++e) Tc8<KT>::to_h2(u[e], h[2 * e], h[2 * e + 1]);
                if constexpr (f8k && token_scales) {  // V times its key's scale over vref (rounded to f16)
                  const __half2 f = __half2half2(__float2half_rn(v_scale[pass] * inv));
#pragma unroll
                  for (int e = 0; e < 8; ++e) {
                    __half2 x = *reinterpret_cast<const __half2*>(&h[e]);
                    x = __hmul2(x, f);
                    h[e] = *reinterpret_cast<const uint32_t*>(&x);
                  }
                }
                const int c = 2 * (c_copy + 2 * y);  // the first of its two 16-bit chunks
                store16(KVTile::chunk(L::kv(base, st, kind), r, c), h[0], h[1], h[2], h[3]);
                store16(KVTile::chunk(L::kv(base, st, kind), r, c + 1), h[4], h[5], h[6], h[7]);
              }
            if (c_copy == 0) {
              ok_flags[st * kN + r] = live;
              if (in_keys(pos) && !live) atomicMax(missing_at + st, g + 1);
            }
          }
          fence_async_shared();  // its stores, before the tensor cores read them
          mbar_arrive(L::full(base, st));
#pragma unroll
          for (int pass = 0; pass < kPasses; ++pass) {
            page[pass] = ahead[pass], ahead[pass] = next[pass];
            k_scale[pass] = k_scale_next[pass], v_scale[pass] = v_scale_next[pass];
          }
        }
        // The byte stages free for the next item (its first copies go to byte stage 0).
        asm volatile("cp.async.wait_all;\n" ::: "memory");
      }
      ring += tiles;
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  set_registers<true, kConsumerRegs>();

  // A consumer. This thread's rows: consumer wg's 64 rows, warp (warp % 4)'s 16 of them, g and g + 8.
  const int wg = warp / 4 - 1, row_w = wg * 64 + (warp % 4) * 16 + lane / 4;
  // Turns at the tensor cores (below): warpgroup w's is named barrier 1 + w.
  const int mine = 1 + wg, theirs = 2 - wg;
  int ring = 0;  // the tiles of the block's earlier items, as the producer's
  for (int j = 0, k; (k = consumer_item(j)) < items.count; ++j) {
    const Item item = item_at(k);
    const PrefillTile& q_tile = item.q_tile;
    const int b = q_tile.b, kvh = q_tile.kvh, tiles = item.tiles;
    const int32_t n_max = q_tile.n_max, key0 = item.key0;
    // Its rows' keys [f_row, n_row) relative to key0 (a row without keys: n_rel <= 0), and the
    // item's bounds of the masks: tiles ending past its first query's end (n_min) take the causal
    // mask, tiles starting below its last query's first key (f_max) the window's.
    int32_t n_rel[2], f_rel[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const PrefillTile::Row q = q_tile.row(p, row_w + 8 * hf);
      const int32_t n = q_tile.keys(p, q);
      n_rel[hf] = n - key0;
      f_rel[hf] = (n > 0 ? p.first_key(b, q.t, window) : 0) - key0;
    }
    const int32_t n_min_rel = q_tile.n_min - key0;
    const int t_last = min(q_tile.t0 + q_tile.per_tile, min(p.tokens, p.counts[b])) - 1;
    const int32_t f_max_rel = (n_max > 0 ? p.first_key(b, t_last, window) : 0) - key0;
    const float vref = token_scales ? v_reference(p, b, kvh).value : 1.f;  // O's factor at the end
    // Writes O / l of this thread's rows (zeros for a row with no key; rows past the tile or T are
    // not written); m2: the rows' running maxima in base 2 (times qs), as their sums, for the sink.
    auto write_out = [&](const float* o, const float* l, const float* m2) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float sum = l[hf];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const PrefillTile::Row q = q_tile.row(p, row_w + 8 * hf);
        if (!q.live) continue;
        const bool live = n_rel[hf] > 0 && sum != 0.f;
        const float norm = live ? *p.v_scale * vref * sink_norm(m2[hf], sum, sink_log2(p, q.head)) : 0.f;
        T* out = reinterpret_cast<T*>(p.out) + q_tile.q_index(p, q) + 2 * (lane % 4);
#pragma unroll
        for (int dt = 0; dt < kD / 8; ++dt) {
          const uint32_t w = live ? pack2<T>(o[4 * dt + 2 * hf] * norm, o[4 * dt + 2 * hf + 1] * norm) : 0u;
          *reinterpret_cast<uint32_t*>(out + dt * 8) = w;
        }
      }
    };
    if (tiles == 0) {  // no key: zeros (the same for the whole item)
      const float zeros[kD / 2] = {}, none[2] = {};
      write_out(zeros, none, none);
      continue;
    }
    // An 8-bit cache: this thread's two rows of Q into the tile as f16 times q's sign and 2^e (the
    // row's largest |q| in [2^14, 2^15)), a quarter of each row by each of its four lanes; qs: the
    // scores' factor of each row (2^-e divided out).
    float qs[2] = {qscale, qscale};
    if constexpr (k8) {
      named_sync(4 + wg, 128);  // the warpgroup's S of the block's item before has read its rows
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = row_w + 8 * hf;
        const PrefillTile::Row q = q_tile.row(p, r);
        const uint4* src = reinterpret_cast<const uint4*>(p.q + (q.live ? q_tile.q_index(p, q) * 2 : 0)) + 4 * (lane % 4);
        float x[32];
#pragma unroll
        for (int y = 0; y < 4; ++y) {
          const uint4 w = q.live ? __ldg(src + y) : make_uint4(0u, 0u, 0u, 0u);
          const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = unpack2<T>(u[e]);
            x[8 * y + 2 * e] = f.x, x[8 * y + 2 * e + 1] = f.y;
          }
        }
        float amax = 0.f;
#pragma unroll
        for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(x[j]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        if constexpr (f8k) {
          // Two e4m3 tiles, hi = e4m3(q 2^e) and lo = e4m3(q 2^e - hi) (the row's largest |q 2^e|
          // in [2^7, 2^8)): hi + lo keeps 8 bits of each value, as bf16 has. Chunk 2 (lane % 4) + c
          // of a row holds its values 16 c to 16 c + 15 of x.
          const float mul = f16_headroom(amax) * 0x1p-7f;
          qs[hf] = fmaxf(qscale / mul, FLT_MIN);
          const float m = mul * q_sign;
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            uint32_t hi[4], lo[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              hi[e] = lo[e] = 0u;
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                const int j = 16 * c + 4 * e + 2 * half;
                const float2 v = make_float2(x[j] * m, x[j + 1] * m);
                const __nv_fp8x2_storage_t h = __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3);
                const float2 back = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(h, __NV_E4M3)));
                const __nv_fp8x2_storage_t rest =
                    __nv_cvt_float2_to_fp8x2(make_float2(v.x - back.x, v.y - back.y), __NV_SATFINITE, __NV_E4M3);
                hi[e] |= uint32_t{h} << (16 * half), lo[e] |= uint32_t{rest} << (16 * half);
              }
            }
            store16(QTile::chunk(base, r, 2 * (lane % 4) + c), hi[0], hi[1], hi[2], hi[3]);
            store16(QTile::chunk(base + QTile::kBlock, r, 2 * (lane % 4) + c), lo[0], lo[1], lo[2], lo[3]);
          }
        } else {
          const float mul = f16_headroom(amax);
          qs[hf] = fmaxf(qscale / mul, FLT_MIN);
          const float m = mul * q_sign;
#pragma unroll
          for (int y = 0; y < 4; ++y)
            store16(QTile::chunk(base, r, 4 * (lane % 4) + y), pack2<__half>(x[8 * y] * m, x[8 * y + 1] * m),
                    pack2<__half>(x[8 * y + 2] * m, x[8 * y + 3] * m), pack2<__half>(x[8 * y + 4] * m, x[8 * y + 5] * m),
                    pack2<__half>(x[8 * y + 6] * m, x[8 * y + 7] * m));
        }
      }
      fence_async_shared();       // the tile's stores, before the tensor cores read them
      named_sync(4 + wg, 128);    // the warpgroup's 64 rows
    }

    // A soft cap of at most 2^12 in base 2 (cap2 = soft_cap log2 e, cap_fold): the scores are kept
    // as tanh(s qs / cap2) and the exponents' factor becomes cap2 (tanh is odd, and Q carries the
    // scale's sign): a multiplication a score fewer on the path the multi-function unit's tanh and
    // exp2 already load. A larger cap (as good as none) caps each raw score at cap2 / qs, the
    // exponents' factor kept (its tanh input would leave float's range).
    const bool capped = p.soft_cap > 0.f, cap_fold = capped && p.soft_cap * kLog2e <= 0x1p12f;
    float to_tanh[2] = {0.f, 0.f}, cap_raw[2] = {0.f, 0.f};  // cap_raw: capped but not cap_fold
    if (cap_fold) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) to_tanh[hf] = qs[hf] / (p.soft_cap * kLog2e), qs[hf] = p.soft_cap * kLog2e;
    } else if (capped) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        to_tanh[hf] = fminf(fmaxf(qs[hf] / (p.soft_cap * kLog2e), FLT_MIN), FLT_MAX);
        cap_raw[hf] = 1.f / to_tanh[hf];  // finite
      }
    }

    constexpr int kSt = kN / 8, kOt = kD / 8;  // 8-column fragments of S and of O
    float s[kSt * 4], o[kOt * 4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    uint32_t pa[kN / 16][4];  // P of the tile whose P V comes next, as A fragments
#pragma unroll
    for (int j = 0; j < kOt * 4; ++j) o[j] = 0.f;
#pragma unroll
    for (int j = 0; j < kSt * 4; ++j) s[j] = 0.f;
    const Wgmma<MT, kN> s_op;  // S = Q K^T
    const Wgmma<MT, kD> o_op;  // O += P V
    // Tile i has landed. (No proxy fence: the copies are cp.async, whose completion the barrier
    // tracks; a fence here compiled to MEMBAR.ALL.CTA on every tile.)
    auto wait_full = [&](int i) { mbar_wait(L::full(base, (ring + i) % L::kStages), ((ring + i) / L::kStages) & 1); };
    auto issue_s = [&](int i) {  // S = Q K^T of tile i into s
      const unsigned k_tile = L::kv(base, (ring + i) % L::kStages, 0);
      if constexpr (f8k) {  // Q's hi tile, then its lo tile, on K's bytes (32 a k-step)
        constexpr bool e5m2 = std::is_same_v<KT, E5M2>;
#pragma unroll
        for (int kk = 0; kk < kD / 32; ++kk)
          mma_ss_f8<e5m2>(s, desc_k_major<kWgRows>(base, wg * 64, kk), desc_k_major<kN>(k_tile, 0, kk), kk > 0);
#pragma unroll
        for (int kk = 0; kk < kD / 32; ++kk)
          mma_ss_f8<e5m2>(s, desc_k_major<kWgRows>(base + QTile::kBlock, wg * 64, kk), desc_k_major<kN>(k_tile, 0, kk), 1);
      } else {
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk)
          mma_ss<0>(s_op, s, desc_k_major<kWgRows>(base, wg * 64, kk), desc_k_major<kN>(k_tile, 0, kk), kk > 0);
      }
    };
    // The online softmax of tile i on s (4 lanes share a row): P into `out`, and each row's factor
    // for O (alpha; rescale(alpha) applies it, once no P V that adds to O is in flight).
    // keep false (a turn past the last tile, in the overlap's unbranched path): m and l unchanged.
    auto softmax = [&](int i, uint32_t (&out)[kN / 16][4], float (&alpha)[2], bool keep) {
      const int st = (ring + i) % L::kStages;
      if constexpr (token_scales) {  // an 8-bit cache's K scales on their scores
        const float* ks = k_scales + st * kN;
#pragma unroll
        for (int nt = 0; nt < kSt; ++nt) {
          const float2 f = *reinterpret_cast<const float2*>(ks + nt * 8 + 2 * (lane % 4));
          s[4 * nt] *= f.x, s[4 * nt + 1] *= f.y, s[4 * nt + 2] *= f.x, s[4 * nt + 3] *= f.y;
        }
      }
      if (cap_fold) {  // uniform: each score becomes tanh(s qs / cap2)
#pragma unroll
        for (int j = 0; j < kSt * 4; ++j) s[j] = tanh_approx(s[j] * to_tanh[j % 4 / 2]);
      } else if (capped) {  // uniform: each raw score capped at cap_raw
#pragma unroll
        for (int j = 0; j < kSt * 4; ++j) s[j] = soft_capped<false>(s[j], cap_raw[j % 4 / 2], to_tanh[j % 4 / 2]);
      }
      // The diagonal, the window's lower edge, keys without a page (or before the item's first key).
      // Not past the last tile (keep false), where the producer may be refilling the stage's flags.
      if (keep && (missing_at[st] == ring + i + 1 || (i + 1) * kN > n_min_rel || i * kN < f_max_rel)) {
        const unsigned char* ok = ok_flags + st * kN;
#pragma unroll
        for (int nt = 0; nt < kSt; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int jt = nt * 8 + 2 * (lane % 4) + e, key = i * kN + jt;  // key0 + key: the key
            const bool held = ok[jt] != 0;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
              if (!held | (key >= n_rel[hf]) | (key < f_rel[hf])) s[4 * nt + 2 * hf + e] = -INFINITY;
          }
      }
      float mx[2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float t[kSt];
#pragma unroll
        for (int nt = 0; nt < kSt; ++nt) t[nt] = fmaxf(s[4 * nt + 2 * hf], s[4 * nt + 2 * hf + 1]);
        tree<kSt / 2>(t, [](float a, float c) { return fmaxf(a, c); });
        mx[hf] = fmaxf(m[hf], t[0]);
      }
#pragma unroll
      for (int x = 1; x <= 2; x *= 2)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], x));
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float top = mx[hf];
        alpha[hf] = top == -INFINITY ? 1.f : fast_exp2((m[hf] - top) * qs[hf]);
        const float mb = top == -INFINITY ? 0.f : top * qs[hf];
        float sums[kSt];
#pragma unroll
        for (int nt = 0; nt < kSt; ++nt) {
          const float p0 = fast_exp2(fmaf(s[4 * nt + 2 * hf], qs[hf], -mb));
          const float p1 = fast_exp2(fmaf(s[4 * nt + 2 * hf + 1], qs[hf], -mb));
          sums[nt] = p0 + p1;
          float2 f = {1.f, 1.f};  // an 8-bit cache scaled per token: its keys' V scales over vref, on P
          if constexpr (!f8k && token_scales)
            f = __half22float2(*reinterpret_cast<const __half2*>(v_factors + st * kN + nt * 8 + 2 * (lane % 4)));
          out[nt / 2][(nt % 2) * 2 + hf] = pack2<MT>(p0 * f.x, p1 * f.y);
        }
        tree<kSt / 2>(sums, [](float a, float c) { return a + c; });
        m[hf] = keep ? top : m[hf];  // a select, not a branch
        l[hf] = keep ? l[hf] * alpha[hf] + sums[0] : l[hf];  // this lane's columns; the row's sum at the end
      }
    };
    auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
      for (int dt = 0; dt < kOt; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[4 * dt + e] *= alpha[e / 2];
    };

    // Turns at the tensor cores: warpgroup w's turn is named barrier 1 + w (both warpgroups count
    // in it: w waits, the other arrives when its own turn is issued); warpgroup 0 goes first. Each
    // takes tiles + 1 turns an item; warpgroup 1 does not arrive after its last (warpgroup 0's
    // next turn is the next item's first, which warpgroup 1's arrival at that item's start opens).
    // The MMAs are issued unconditionally (the compiler serializes wgmma issued under a branch): an
    // item without keys is skipped, and the last turn's S reads a stale stage (which the producer
    // may be refilling for the next item), unused.
    // With two stages (an 8-bit cache's, head_dim 256) tile i + 1's stage is refilled only once
    // both consumers are done with tile i - 1: a consumer issues P V(i), then waits for tile i + 1.
    constexpr bool kLateWait = k8 || L::kStages == 2;
    // The producer loads the next item's Q (a 16-bit cache) once the last turn's MMAs are done
    // (its S, past the last tile, reads Q too).
    auto release_q = [&](int i) {  // turn i's MMAs are done
      if (!k8 && i == tiles - 1) mbar_arrive(L::q_free(base));
    };
    if (wg == 1) named_arrive(1, kConsumers);
    float alpha[2];
    wait_full(0);
    named_sync(mine, kConsumers);
    wgmma_fence();
    issue_s(0);
    wgmma_commit();
    named_arrive(theirs, kConsumers);
    wgmma_wait<0>();
    softmax(0, pa, alpha, true);
    if constexpr (kOverlap) {
      // FlashAttention-3's overlap inside a warpgroup: a turn issues S(i + 1) before P V(i), waits
      // for S alone and runs tile i + 1's softmax while P V(i) is on the tensor cores; O is rescaled
      // once P V(i) is done. Two P buffers: P V(i) reads one while the softmax writes the other.
      static_assert(!kLateWait, "three stages: tile i + 1 waited for before the turn");
      uint32_t pb[kN / 16][4];
      auto turn = [&](int i, uint32_t (&p_now)[kN / 16][4], uint32_t (&p_next)[kN / 16][4]) {
        const int st = (ring + i) % L::kStages;
        const bool next = i + 1 < tiles;
        if (next) wait_full(i + 1);
        named_sync(mine, kConsumers);
        wgmma_fence();
        issue_s(i + 1);
        wgmma_commit();
        const unsigned v_tile = L::kv(base, st, 1);
#pragma unroll
        for (int kk = 0; kk < kN / 16; ++kk) mma_rs<1>(o_op, o, p_now[kk], desc_mn_major<kN>(v_tile, kk), 1);
        wgmma_commit();
        if (wg == 0 || next) named_arrive(theirs, kConsumers);
        wgmma_wait<1>();  // S(i + 1)
        // Unbranched (past the last tile too, on a stale stage, keeping m and l): registers written
        // under a branch while P V is in flight make ptxas serialize the wgmma (C7520).
        softmax(i + 1, p_next, alpha, next);
        wgmma_wait<0>();  // P V(i)
        mbar_arrive(L::empty(base, st));  // this thread is done with tile i
        release_q(i);
        if (next) rescale(alpha);
      };
      for (int i = 0; i < tiles; i += 2) {
        turn(i, pa, pb);
        if (i + 1 < tiles) turn(i + 1, pb, pa);
      }
    } else {
      for (int i = 0; i < tiles; ++i) {
        const int st = (ring + i) % L::kStages;
        const bool next = i + 1 < tiles;
        if (!kLateWait && next) wait_full(i + 1);
        named_sync(mine, kConsumers);
        wgmma_fence();
        const unsigned v_tile = L::kv(base, st, 1);
#pragma unroll
        for (int kk = 0; kk < kN / 16; ++kk) mma_rs<1>(o_op, o, pa[kk], desc_mn_major<kN>(v_tile, kk), 1);
        if constexpr (kLateWait) {  // tile i + 1 lands (or is converted) while P V(i) runs
          wgmma_commit();
          if (next) wait_full(i + 1);
          wgmma_fence();
        }
        issue_s(i + 1);
        wgmma_commit();
        if (wg == 0 || next) named_arrive(theirs, kConsumers);
        wgmma_wait<0>();
        mbar_arrive(L::empty(base, st));  // this thread is done with tile i
        release_q(i);
        if (next) {
          softmax(i + 1, pa, alpha, true);
          rescale(alpha);
        }
      }
    }
    ring += tiles;
    const float m2[2] = {m[0] * qs[0], m[1] * qs[1]};  // the weights are 2^(s qs - m qs)
    write_out(o, l, m2);
  }
#endif
}

// blocks: the persistent blocks (WgItems).
template <class T, class KT = T, int kD = 128>
ffi::Error launch_wgmma(cudaStream_t stream, const AttentionProblem& p, unsigned blocks) {
  constexpr size_t bytes = WgLayout<!std::is_same_v<KT, T>, kFp8K<T, KT>, kD>::kBytes;
  // The items taken in a static order instead of by the counter where JAXKV_PREFILL_STATIC is set
  // (read once; to compare).
  static const bool static_order = std::getenv("JAXKV_PREFILL_STATIC") != nullptr;
  AttentionProblem q = p;
  if (static_order) q.item_counter = nullptr;
  auto launch = [&](auto kernel) {
    allow_shared_memory(kernel, bytes);
    kernel<<<blocks, kWgThreads, bytes, stream>>>(q);
  };
  const bool token_scales = !std::is_same_v<KT, T> && p.scales.k != nullptr;
  if (token_scales && (p.item_counter == nullptr || p.v_maxima == nullptr))
    return invalid("attention.prefill", "an 8-bit cache scaled per token needs a workspace of 1 + B H words");
  // The counter and the V maxima after it (adjacent in the workspace), zeroed at once.
  if (p.item_counter != nullptr)
    cudaMemsetAsync(p.item_counter, 0, sizeof(int) * (1 + (token_scales ? int64_t{p.batch} * p.kv.heads : 0)), stream);
  if constexpr (!std::is_same_v<KT, T>) {
    if (token_scales) {  // scaled per token: the rows' largest V scales first
      const dim3 grid(static_cast<unsigned>(std::max(1, (p.kv.capacity + 255) / 256)), p.kv.heads, p.batch);
      v_max_kernel<<<grid, 256, 0, stream>>>(p);
      launch(prefill_wgmma_kernel<T, KT, true>);
      return cuda_status("attention.prefill");
    }
  }
  if constexpr (std::is_same_v<KT, T> && kD == 128) {
    // The overlap inside a warpgroup (three stages: a 16-bit cache at head_dim 128) pays where the
    // softmax is long, a soft cap's tanh: on an H100, 1.79 against 1.84 ms soft-capped, 1.61 against
    // 1.55 ms without (docs/perf-notes.md item 76). JAXKV_PREFILL_OVERLAP (read once): 0 never,
    // any other value always.
    static const char* const forced = std::getenv("JAXKV_PREFILL_OVERLAP");
    const bool overlap = forced != nullptr ? std::string_view(forced) != "0" : p.soft_cap > 0.f;
    if (overlap) {
      launch(prefill_wgmma_kernel<T, KT, false, kD, true>);
      return cuda_status("attention.prefill");
    }
  }
  launch(prefill_wgmma_kernel<T, KT, false, kD>);
  return cuda_status("attention.prefill");
}

// The device's multiprocessors where the wgmma kernel runs there (compute capability 9.0, the
// sm_90a code built (JAXKV_SM90A) and the shared memory), else 0; once per device.
int wgmma_multiprocessors() {
#if defined(JAXKV_SM90A)
  static const bool disabled = std::getenv("JAXKV_NO_WGMMA") != nullptr;
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices] = {};  // 0 unknown, -1 no, else the multiprocessors
  int device = 0;
  cudaGetDevice(&device);
  int k = known[device % kMaxDevices].load(std::memory_order_relaxed);
  if (k == 0) {  // two threads asking at once both find the same answer
    int major = 0, minor = 0, limit = 0, sms = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    k = major == 9 && minor == 0 && kWgMaxBytes <= static_cast<size_t>(limit) ? std::max(sms, 1) : -1;
    known[device % kMaxDevices].store(k, std::memory_order_relaxed);
  }
  return k > 0 && !disabled ? k : 0;
#else
  return 0;
#endif
}

}  // namespace

bool launch_prefill_wgmma(cudaStream_t stream, const AttentionProblem& p, ffi::Error* status) {
  // head_dim 256 over an 8-bit cache is not built here: the mma.sync kernel serves it.
  const bool head_dim_ok = p.head_dim == 128 || (p.head_dim == 256 && p.kv_type == p.q_type);
  // An int in the kernel, with room for WgItems::at's round past the last (below 3x items).
  const int64_t items = int64_t{WgItems::tiles_of(p)} * p.kv.heads * p.batch;
  if (!head_dim_ok || p.group > kWgRows || items > INT_MAX / 4 || p.batch > 65535 || p.kv.heads > 65535)
    return false;  // (v_max_kernel's grid: heads, rows)
  const int sms = wgmma_multiprocessors();
  if (sms == 0) return false;
  // One block a multiprocessor, at most one an item. JAXKV_PREFILL_BLOCKS=N (read once) launches N
  // instead: few, so that a test's few items still make each block take several; many, a block an
  // item (no block takes a second: to compare).
  static const int forced = [] {
    const char* v = std::getenv("JAXKV_PREFILL_BLOCKS");
    return v != nullptr ? std::max(std::atoi(v), 0) : 0;
  }();
  const auto blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(items, forced > 0 ? forced : sms)));
  bool launched = false;
  with_attention_types(p.q_type, p.kv_type, [&](auto q, auto kv) {
    using T = typename decltype(q)::type;  // a 16-bit q only
    using KT = typename decltype(kv)::type;
    if constexpr (!std::is_same_v<T, float>) {
      if constexpr (std::is_same_v<KT, T>) {
        *status = p.head_dim == 256 ? launch_wgmma<T, KT, 256>(stream, p, blocks) : launch_wgmma<T, KT>(stream, p, blocks);
      } else {
        *status = launch_wgmma<T, KT>(stream, p, blocks);
      }
      launched = true;
    }
  });
  return launched;
}

}  // namespace jaxkv
