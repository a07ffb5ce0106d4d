// CUDA handlers of the paged cache: append, gather and copy_pages.
//
// append / gather: a group of `lanes` threads moves a chunk of tokens of one (layer, row, head)
// span, K and V together; each lane carries kUnroll words of each in flight (16-byte words whenever
// head_dim allows). Lanes cover consecutive words of consecutive tokens, so the dense side is read
// or written as one contiguous run and the paged side in whole-token runs. A block holds
// `spans_per_block` groups, the consecutive heads of one row: a decode step's chunk is one token
// (16 words at D 128 in bf16), and one group per block left most of each block idle and the grid
// 8x larger than the work needed. A token whose page is unassigned is skipped (append) or
// zero-filled (gather), never dereferenced.
// copy_pages: block (pair, layer, run) copies one contiguous run of a page, K and V.
#include <algorithm>

#include "jaxkv/cuda_launch.h"
#include "jaxkv/paged.h"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kMaxGridY = 65535;

// Threads for a block moving `words` words: enough for kUnroll each, whole warps, at most kThreads.
int threads_for(int64_t words) {
  const int64_t per_thread = (words + kUnroll - 1) / kUnroll;
  return static_cast<int>(std::min<int64_t>(kThreads, std::max<int64_t>(32, (per_thread + 31) / 32 * 32)));
}

// Moves words [0, words) of the chunk of span s that starts at token t0; this thread moves words
// lane, lane + lanes, ... In gather the source is the pool and the destination the dense tensor; in
// append the other way round. Append loads its (dense) source before looking up the pages, so the
// page-table reads overlap the data reads. Word i is word w of token t; both advance by a fixed
// step per i += lanes, so the loop divides nothing (divisions and 64-bit index arithmetic were
// most of the instructions of a decode step's append: 3.5x FlashInfer's count, H200 ncu).
template <int kBytes, bool kGather, int kU>
__device__ __forceinline__ void move_chunk(const TokenMove& m, const SpanRef& s, int64_t t0,
                                           int32_t words, int32_t lane, int32_t lanes) {
  using W = typename Word<kBytes>::type;
  const int32_t wpt = m.cache.token_bytes / kBytes;
  const int32_t step_t = lanes / wpt, step_w = lanes - step_t * wpt;
  int32_t t = lane / wpt, w = lane - t * wpt;  // token (from t0) and word of word `lane`
  const char* src_k = kGather ? m.cache.k : m.dense_k;
  const char* src_v = kGather ? m.cache.v : m.dense_v;
  char* dst_k = kGather ? m.dense_k : m.cache.k;
  char* dst_v = kGather ? m.dense_v : m.cache.v;
  for (int32_t base = lane; base < words; base += lanes * kU) {
    W k[kU], v[kU];
    int64_t paged[kU], dense[kU];  // byte offsets; paged < 0: no page (or past count)
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const bool in = base + u * lanes < words;
      const int64_t tok = t0 + t;
      const bool moves = in && tok < s.count;
      dense[u] = in ? s.dense + tok * m.cache.token_bytes + w * kBytes : -1;
      k[u] = W{};
      v[u] = W{};
      if (!kGather && moves) {
        k[u] = load_word(reinterpret_cast<const W*>(src_k + dense[u]));
        v[u] = load_word(reinterpret_cast<const W*>(src_v + dense[u]));
      }
      paged[u] = moves ? paged_offset(m, s, tok) : -1;
      if (paged[u] >= 0) paged[u] += w * kBytes;
      if (kGather && paged[u] >= 0) {
        k[u] = load_word(reinterpret_cast<const W*>(src_k + paged[u]));
        v[u] = load_word(reinterpret_cast<const W*>(src_v + paged[u]));
      }
      t += step_t;
      w += step_w;
      if (w >= wpt) w -= wpt, ++t;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      // Gather writes every dense word (zeros where no page holds the token); append writes
      // only tokens that have a page.
      const int64_t to = kGather ? dense[u] : paged[u];
      if (to < 0) continue;
      store_word(reinterpret_cast<W*>(dst_k + to), k[u]);
      store_word(reinterpret_cast<W*>(dst_v + to), v[u]);
    }
  }
}

// How a move is cut into blocks: `lanes` threads per (span, chunk), `spans_per_block` spans per
// block, `chunk_tokens` tokens per chunk (grid.y walks the chunks).
struct MoveGeometry {
  int32_t lanes, spans_per_block, chunk_tokens;
  int64_t chunks;
};

template <int kBytes, bool kGather>
__global__ void __launch_bounds__(kThreads)
    move_kernel(const TokenMove m, MoveGeometry g) {
  const int32_t group = threadIdx.x / g.lanes;
  const int64_t span = int64_t{blockIdx.x} * g.spans_per_block + group;
  if (span >= m.spans()) return;  // no barrier below: a group may leave
  const SpanRef s = span_ref(m, span);
  const int32_t wpt = m.cache.token_bytes / kBytes, lane = threadIdx.x - group * g.lanes;
  for (int64_t c = blockIdx.y; c < g.chunks; c += gridDim.y) {
    const int64_t t0 = c * g.chunk_tokens;
    if (!kGather && t0 >= s.count) return;  // append: nothing left to write in this span
    const int32_t words = static_cast<int32_t>(min(int64_t{g.chunk_tokens}, m.tokens - t0) * wpt);
    // A decode step's chunk is one or two words per lane: no unrolled iterations that do nothing.
    if (words <= g.lanes)
      move_chunk<kBytes, kGather, 1>(m, s, t0, words, lane, g.lanes);
    else if (words <= 2 * g.lanes)
      move_chunk<kBytes, kGather, 2>(m, s, t0, words, lane, g.lanes);
    else
      move_chunk<kBytes, kGather, kUnroll>(m, s, t0, words, lane, g.lanes);
  }
}

// Append, one thread per word of the dense K/V [n, B, H, T, D], in their order: the word's index
// is its dense offset, and splits into (layer, row, head, token, word) by multiply-highs. No
// per-span setup, no loop: on a decode step's append (one token per row) the span kernel above
// executed ~500 instructions per warp against ~90 for FlashInfer's (H200, ncu). kOneToken (T = 1):
// the data loads do not wait for the row's count (the word is in the dense input either way).
struct WordSplit {
  FastDiv words_per_token, tokens, heads, batch;
};

template <int kBytes, bool kOneToken>
__global__ void __launch_bounds__(kThreads)
    append_word_kernel(const TokenMove m, WordSplit d, uint32_t words) {
  using W = typename Word<kBytes>::type;
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= words) return;
  const uint32_t token = d.words_per_token.div(i), span = d.tokens.div(token);
  const uint32_t rows = d.heads.div(span), l = d.batch.div(rows);
  const uint32_t w = i - token * d.words_per_token.d, t = token - span * d.tokens.d;
  SpanRef s;
  s.h = span - rows * d.heads.d;
  s.b = rows - l * d.batch.d;
  s.layer = int64_t{*m.layer} + l;
  s.length = m.lengths[s.b];
  const int32_t count = m.counts ? m.counts[s.b] : m.tokens;
  W k{}, v{};
  if (kOneToken) {
    k = load_word(reinterpret_cast<const W*>(m.dense_k) + i);
    v = load_word(reinterpret_cast<const W*>(m.dense_v) + i);
  }
  if (static_cast<int32_t>(t) >= count || s.layer < 0 || s.layer >= m.cache.num_layers) return;
  if (!kOneToken) {
    k = load_word(reinterpret_cast<const W*>(m.dense_k) + i);
    v = load_word(reinterpret_cast<const W*>(m.dense_v) + i);
  }
  s.paged = m.cache.base(s.layer, s.h);
  const int64_t to = paged_offset(m, s, t);
  if (to < 0) return;
  store_word(reinterpret_cast<W*>(m.cache.k + to + w * kBytes), k);
  store_word(reinterpret_cast<W*>(m.cache.v + to + w * kBytes), v);
}

template <int kBytes>
void launch_append_words(cudaStream_t stream, const TokenMove& m, uint32_t words) {
  const WordSplit d{FastDiv(m.cache.token_bytes / kBytes), FastDiv(m.tokens),
                    FastDiv(m.cache.heads), FastDiv(m.cache.batch)};
  const unsigned blocks = (words + kThreads - 1) / kThreads;
  if (m.tokens == 1)
    append_word_kernel<kBytes, true><<<blocks, kThreads, 0, stream>>>(m, d, words);
  else
    append_word_kernel<kBytes, false><<<blocks, kThreads, 0, stream>>>(m, d, words);
}

// Whether append_word_kernel takes this append: word indices must fit 31 bits.
bool append_by_words(const TokenMove& m, int64_t wpt) {
  return !m.gather && m.spans() * m.tokens * wpt < (int64_t{1} << 31);
}

// The default cut (tools/probes/paged_append_probe.cu, H200): chunks of two passes of kUnroll words per
// lane, kThreads lanes (a 5000-token prefill: 10.4 us against 11.9 at one pass); a chunk smaller
// than a block (a decode step's one token) takes two words per lane, and the block is filled with
// the row's other heads (1024 rows: 4.6 us against 9.2 at one span of 32 threads per block).
MoveGeometry move_geometry(const TokenMove& m, int64_t wpt) {
  MoveGeometry g;
  g.chunk_tokens = static_cast<int32_t>(
      std::min<int64_t>(m.tokens, std::max<int64_t>(1, 2 * kThreads * kUnroll / wpt)));
  g.chunks = (m.tokens + g.chunk_tokens - 1) / g.chunk_tokens;
  const int64_t words = g.chunk_tokens * wpt;
  if (words >= kThreads) {
    g.lanes = threads_for(words);
    g.spans_per_block = 1;
  } else {
    g.lanes = 1;
    while (g.lanes * 2 < words) g.lanes *= 2;
    g.spans_per_block = std::max(1, std::min(kThreads / g.lanes, m.cache.heads));
  }
  return g;
}

template <bool kGather>
void launch_move_kernel(int width, dim3 grid, int threads, cudaStream_t stream, const TokenMove& m,
                        const MoveGeometry& g) {
  switch (width) {
    case 16: move_kernel<16, kGather><<<grid, threads, 0, stream>>>(m, g); break;
    case 8: move_kernel<8, kGather><<<grid, threads, 0, stream>>>(m, g); break;
    case 4: move_kernel<4, kGather><<<grid, threads, 0, stream>>>(m, g); break;
    case 2: move_kernel<2, kGather><<<grid, threads, 0, stream>>>(m, g); break;
    default: move_kernel<1, kGather><<<grid, threads, 0, stream>>>(m, g); break;
  }
}

// `forced`: a geometry to use instead of the default (tools/probes/paged_append_probe.cu).
ffi::Error launch_move(cudaStream_t stream, const TokenMove& m, const char* op,
                       const MoveGeometry* forced = nullptr) {
  const int width = vector_width(m.cache.token_bytes);
  const int64_t wpt = m.cache.token_bytes / width;
  if (m.spans() == 0 || m.tokens == 0 || wpt == 0) return ffi::Error::Success();
  if (!forced && append_by_words(m, wpt)) {
    const auto words = static_cast<uint32_t>(m.spans() * m.tokens * wpt);
    switch (width) {
      case 16: launch_append_words<16>(stream, m, words); break;
      case 8: launch_append_words<8>(stream, m, words); break;
      case 4: launch_append_words<4>(stream, m, words); break;
      case 2: launch_append_words<2>(stream, m, words); break;
      default: launch_append_words<1>(stream, m, words); break;
    }
    return cuda_status(op);
  }
  const MoveGeometry g = forced ? *forced : move_geometry(m, wpt);
  if (m.spans() > 0x7fffffff || g.chunk_tokens * wpt > 0x7fffffff)
    return invalid(op, "too many (layer, row, head) spans for one launch");
  const int64_t blocks = (m.spans() + g.spans_per_block - 1) / g.spans_per_block;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(std::min(g.chunks, kMaxGridY)));
  const int threads = g.lanes * g.spans_per_block;
  if (m.gather)
    launch_move_kernel<true>(width, grid, threads, stream, m, g);
  else
    launch_move_kernel<false>(width, grid, threads, stream, m, g);
  return cuda_status(op);
}

template <int kBytes>
__device__ __forceinline__ void copy_run(char* k, char* v, int64_t from, int64_t to, int64_t first,
                                         int64_t words) {
  using W = typename Word<kBytes>::type;
  const W* sk = reinterpret_cast<const W*>(k + from);
  const W* sv = reinterpret_cast<const W*>(v + from);
  W* dk = reinterpret_cast<W*>(k + to);
  W* dv = reinterpret_cast<W*>(v + to);
  W bk[kUnroll], bv[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = first + u * blockDim.x;
    if (i < words) bk[u] = sk[i], bv[u] = sv[i];
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = first + u * blockDim.x;
    if (i < words) store_word(dk + i, bk[u]), store_word(dv + i, bv[u]);
  }
}

template <int kBytes>
__global__ void __launch_bounds__(kThreads) copy_kernel(const PageCopy p, int64_t chunks) {
  int64_t from, to;
  if (!p.unit(blockIdx.x, &from, &to)) return;
  const int64_t words = p.cache.run_bytes() / kBytes;
  for (int64_t c = blockIdx.y; c < chunks; c += gridDim.y)
    copy_run<kBytes>(p.cache.k, p.cache.v, from, to, c * blockDim.x * kUnroll + threadIdx.x, words);
}

ffi::Error paged_append_cuda(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
                             ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> layer,
                             ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> k_pages,
                             ffi::Result<ffi::AnyBuffer> v_pages, bool nhd) {
  auto m = make_append(k, v, table, lengths, counts, layer, k_pages, v_pages, nhd);
  if (m.has_error()) return m.error();
  return launch_move(stream, *m, "paged_append");
}

ffi::Error paged_gather_cuda(cudaStream_t stream, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                             ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
                             ffi::Buffer<ffi::S32> layer, ffi::RemainingRets outs, bool nhd) {
  auto m = make_gather(k_pages, v_pages, table, lengths, layer, outs, nhd);
  if (m.has_error()) return m.error();
  return launch_move(stream, *m, "paged_gather");
}

ffi::Error paged_copy_cuda(cudaStream_t stream, ffi::Buffer<ffi::S32> src,
                           ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer, ffi::AnyBuffer,
                           ffi::Result<ffi::AnyBuffer> k_pages,
                           ffi::Result<ffi::AnyBuffer> v_pages, bool nhd) {
  auto p = make_copy(src, dst, k_pages, v_pages, nhd);
  if (p.has_error()) return p.error();
  const int width = vector_width(p->cache.run_bytes());
  const int64_t words = p->cache.run_bytes() / width;
  if (p->units() == 0 || words == 0) return ffi::Error::Success();
  if (p->units() > 0x7fffffff) return invalid("copy_pages", "too many pages for one launch");
  const int threads = threads_for(words);
  const int64_t chunks = (words + int64_t{threads} * kUnroll - 1) / (int64_t{threads} * kUnroll);
  const dim3 grid(static_cast<unsigned>(p->units()), static_cast<unsigned>(std::min(chunks, kMaxGridY)));
  switch (width) {
    case 16: copy_kernel<16><<<grid, threads, 0, stream>>>(*p, chunks); break;
    case 8: copy_kernel<8><<<grid, threads, 0, stream>>>(*p, chunks); break;
    case 4: copy_kernel<4><<<grid, threads, 0, stream>>>(*p, chunks); break;
    case 2: copy_kernel<2><<<grid, threads, 0, stream>>>(*p, chunks); break;
    default: copy_kernel<1><<<grid, threads, 0, stream>>>(*p, chunks); break;
  }
  return cuda_status("copy_pages");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxkv_paged_append_cuda, NoThrow<paged_append_cuda>::call,
    bind_paged_append(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    JAXKV_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxkv_paged_gather_cuda, NoThrow<paged_gather_cuda>::call,
    bind_paged_gather(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    JAXKV_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxkv_paged_copy_cuda, NoThrow<paged_copy_cuda>::call,
    bind_paged_copy(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    JAXKV_CUDA_TRAITS);
JAXKV_REGISTER_TARGET("jaxkv_paged_append", "CUDA", jaxkv_paged_append_cuda);
JAXKV_REGISTER_TARGET("jaxkv_paged_gather", "CUDA", jaxkv_paged_gather_cuda);
JAXKV_REGISTER_TARGET("jaxkv_paged_copy", "CUDA", jaxkv_paged_copy_cuda);

}  // namespace jaxkv
