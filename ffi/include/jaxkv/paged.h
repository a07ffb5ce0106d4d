// Paged KV addressing, shared by the CPU and CUDA handlers of the paged cache.
//
// A pool holds every layer's pages of K (or V): "HND" [L, H, P, S, D] (JAX's Pallas paged_attention
// reads pool[l] as is) or "NHD" [L, P, S, H, D] (vLLM / FlashInfer / MAX). The page table
// [B, max_pages] maps (row, logical page) to a physical page; anything outside [0, P) is the
// sentinel or garbage and is never dereferenced. All offsets are 64-bit.
//
// The ops move whole tokens of one head (token_bytes = D * element size) between a pool and a dense
// tensor [n, B, H, T, D]: append (dense -> pages at lengths[b] + t), gather (pages -> dense,
// zeros past the length), and copy_pages (whole pages -> pages, every layer).
#pragma once

#include <cstdint>
#include <utility>

#include "jaxkv/common.h"

namespace jaxkv {

// The two pools and the page table.
struct PagedView {
  char* k;                    // K pool [L, H, P, S, D] (HND) or [L, P, S, H, D] (NHD)
  char* v;                    // V pool, same shape
  const int32_t* page_table;  // [batch, max_pages]
  int32_t num_layers, heads, num_pages, page_size, batch, max_pages;
  int32_t token_bytes;        // D * element size
  bool nhd;
  FastDiv page_div;           // / page_size

  // Bytes between pages, and between the slots of a page, of one (layer, head).
  JAXKV_HD int64_t page_stride() const {
    return int64_t{page_size} * token_bytes * (nhd ? heads : 1);
  }
  JAXKV_HD int64_t slot_stride() const { return int64_t{token_bytes} * (nhd ? heads : 1); }

  // Physical page of (row, logical page), or -1: unassigned, out of range, never read.
  JAXKV_HD int32_t page(int64_t row, int64_t logical) const {
    if (row < 0 || row >= batch || logical < 0 || logical >= max_pages) return -1;
    const int32_t p = page_table[row * max_pages + logical];
    return (p >= 0 && p < num_pages) ? p : -1;
  }

  // Byte offset of token `slot` of head `head` in page `page` of layer `layer`.
  JAXKV_HD int64_t offset(int64_t layer, int64_t head, int64_t page, int64_t slot) const {
    return base(layer, head) + page * page_stride() + slot * slot_stride();
  }
  // Byte offset of (layer, head) in page 0, slot 0.
  JAXKV_HD int64_t base(int64_t layer, int64_t head) const {
    const int64_t token = nhd ? layer * num_pages * page_size * heads + head
                              : (layer * heads + head) * num_pages * page_size;
    return token * token_bytes;
  }

  // Bytes of one page that are contiguous (a head's page in HND, all heads' in NHD), and how many
  // such runs one page has per layer.
  JAXKV_HD int64_t run_bytes() const {
    return int64_t{page_size} * token_bytes * (nhd ? heads : 1);
  }
  JAXKV_HD int32_t runs_per_page() const { return nhd ? 1 : heads; }
};

// Moving tokens between the pools and a dense [n, B, H, T, D] pair (append's k/v or gather's out).
struct TokenMove {
  PagedView cache;
  char* dense_k;              // dense K (append: source; gather: destination)
  char* dense_v;              // dense V
  int64_t dense_layer_stride; // bytes between the n layers of the dense tensors
  int64_t dense_row_stride;   // bytes between rows b
  int64_t dense_head_stride;  // bytes between heads (T * token_bytes)
  const int32_t* lengths;     // [B]: append writes from here; gather reads below it
  const int32_t* counts;      // [B] tokens to append per row, or null: all T (append only)
  const int32_t* layer;       // []: the pool layer of dense layer 0
  int32_t layers;             // n: dense layers in this call (1, or L for an all-layer append)
  int32_t tokens;             // T
  bool gather;                // pages -> dense (else dense -> pages)

  JAXKV_HD int64_t spans() const { return int64_t{layers} * cache.batch * cache.heads; }
};

// One token of one head: byte offsets of its K (and, the same, V) in the dense tensors and in the
// pools. kSkip: write nothing; kZero: write zeros to the dense side (a gather past the length).
enum class TokenAction { kSkip, kCopy, kZero };
struct TokenRef {
  int64_t dense;
  int64_t paged;
};

// What every token of span (dense layer l, row b, head h) shares; computed once per span.
struct SpanRef {
  int64_t b, h, layer;
  int64_t dense;   // byte offset of token 0 in the dense tensors
  int64_t length;  // lengths[b]
  int64_t count;   // tokens moved: append: min(counts[b], T); gather: min(lengths[b], T)
  int64_t paged;   // byte offset of (layer, head) in the pools: PagedView::base
};

JAXKV_HD SpanRef span_ref(const TokenMove& m, int64_t span) {
  const PagedView& c = m.cache;
  SpanRef s;
  int64_t l;
  if (span <= 0x7fffffff) {  // always on the GPU (checked at launch): 32-bit divisions are cheaper
    const uint32_t sp = static_cast<uint32_t>(span), heads = c.heads, rows = sp / heads;
    s.h = sp % heads;
    s.b = rows % static_cast<uint32_t>(c.batch);
    l = rows / static_cast<uint32_t>(c.batch);
  } else {
    s.h = span % c.heads;
    s.b = (span / c.heads) % c.batch;
    l = span / (int64_t{c.heads} * c.batch);
  }
  s.dense = l * m.dense_layer_stride + s.b * m.dense_row_stride + s.h * m.dense_head_stride;
  s.layer = int64_t{*m.layer} + l;
  s.length = m.lengths[s.b];
  s.count = m.gather ? s.length : (m.counts ? m.counts[s.b] : m.tokens);
  if (s.count > m.tokens) s.count = m.tokens;
  if (s.layer < 0 || s.layer >= c.num_layers) s.count = 0;  // a bad layer moves nothing
  s.paged = c.base(s.layer, s.h);
  return s;
}

// Byte offset in the pools of token t (< s.count) of span s, or -1: no page holds it.
JAXKV_HD int64_t paged_offset(const TokenMove& m, const SpanRef& s, int64_t t) {
  const PagedView& c = m.cache;
  const int64_t pos = m.gather ? t : s.length + t;
  if (pos < 0 || pos >= int64_t{c.max_pages} * c.page_size) return -1;
  // A position in a row fits 31 bits: a multiply-high divides it (this runs once per moved word).
  const uint32_t pos32 = static_cast<uint32_t>(pos), logical = c.page_div.div(pos32);
  const int32_t page = c.page(s.b, logical);
  if (page < 0) return -1;
  return s.paged + page * c.page_stride() + (pos32 - logical * c.page_size) * c.slot_stride();
}

// Token t of span s.
JAXKV_HD TokenAction token_ref(const TokenMove& m, const SpanRef& s, int64_t t, TokenRef* r) {
  r->dense = s.dense + t * m.cache.token_bytes;
  r->paged = t < s.count ? paged_offset(m, s, t) : -1;
  if (r->paged >= 0) return TokenAction::kCopy;
  return m.gather ? TokenAction::kZero : TokenAction::kSkip;
}

// copy_pages: pair i copies physical page src[i] to dst[i], every layer, K and V. Work unit u =
// (pair, layer, run) is one contiguous run of run_bytes(); pairs with an invalid page are skipped.
struct PageCopy {
  PagedView cache;
  const int32_t* src;  // [n]
  const int32_t* dst;  // [n]
  int32_t pairs;

  JAXKV_HD int64_t units() const {
    return int64_t{pairs} * cache.num_layers * cache.runs_per_page();
  }
  // Byte offsets (within a pool) of unit u's source and destination runs; false: skip.
  JAXKV_HD bool unit(int64_t u, int64_t* from, int64_t* to) const {
    const int64_t runs = cache.runs_per_page();
    const int64_t run = u % runs;
    const int64_t layer = (u / runs) % cache.num_layers;
    const int64_t i = u / (runs * cache.num_layers);
    const int32_t s = src[i], d = dst[i];
    if (s < 0 || s >= cache.num_pages || d < 0 || d >= cache.num_pages || s == d) return false;
    *from = cache.offset(layer, run, s, 0);
    *to = cache.offset(layer, run, d, 0);
    return true;
  }
};

// Geometry of the pools from their dimensions ([L, H, P, S, D] or [L, P, S, H, D]).
inline ffi::ErrorOr<PagedView> make_view(const char* op, ffi::AnyBuffer k_pages,
                                         ffi::AnyBuffer v_pages, const int32_t* page_table,
                                         int64_t table_elements, int64_t batch, bool nhd) {
  auto elem = element_bytes(k_pages.element_type(), op);
  if (elem.has_error()) return ffi::Unexpected(elem.error());
  auto d = k_pages.dimensions();
  // Rank 4: pools of one value a token (an 8-bit cache's per-token scales), head_dim 1.
  if (d.size() != 5 && d.size() != 4)
    return ffi::Unexpected(invalid(op, "pools must have rank 5 (or 4: one value a token)"));
  if (v_pages.element_type() != k_pages.element_type() || v_pages.size_bytes() != k_pages.size_bytes())
    return ffi::Unexpected(invalid(op, "K and V pools differ"));
  // Zero rows is a valid (empty) call: the table is then [0, max_pages_per_seq].
  if (batch < 0 || (batch == 0 ? table_elements != 0 : table_elements % batch != 0))
    return ffi::Unexpected(invalid(op, "page_table must be [max_batch, max_pages_per_seq]"));
  PagedView c;
  c.k = static_cast<char*>(k_pages.untyped_data());
  c.v = static_cast<char*>(v_pages.untyped_data());
  c.page_table = page_table;
  c.num_layers = static_cast<int32_t>(d[0]);
  c.heads = static_cast<int32_t>(nhd ? d[3] : d[1]);
  c.num_pages = static_cast<int32_t>(nhd ? d[1] : d[2]);
  c.page_size = static_cast<int32_t>(nhd ? d[2] : d[3]);
  c.batch = static_cast<int32_t>(batch);
  c.max_pages = batch ? static_cast<int32_t>(table_elements / batch) : 0;
  c.token_bytes = static_cast<int32_t>((d.size() == 5 ? d[4] : 1) * *elem);
  c.nhd = nhd;
  c.page_div = FastDiv(static_cast<uint32_t>(c.page_size));
  return c;
}

// Binding of "jaxkv_paged_append" after the platform's context arguments.
template <class Binding>
auto bind_paged_append(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()         // k [B, H, T, D], or [L, B, H, T, D]: every layer
      .template Arg<ffi::AnyBuffer>()         // v, same shape
      .template Arg<ffi::Buffer<ffi::S32>>()  // page_table [B, max_pages]
      .template Arg<ffi::Buffer<ffi::S32>>()  // lengths [B]: first position written
      .template Arg<ffi::Buffer<ffi::S32>>()  // counts [B] tokens per row, or [0]: all T
      .template Arg<ffi::Buffer<ffi::S32>>()  // layer_idx []: pool layer of k[0] (rank 5: 0)
      .template Arg<ffi::AnyBuffer>()         // k_pages (used through the alias)
      .template Arg<ffi::AnyBuffer>()         // v_pages (used through the alias)
      .template Ret<ffi::AnyBuffer>()         // k_pages, aliased
      .template Ret<ffi::AnyBuffer>()         // v_pages, aliased
      .template Attr<bool>("nhd");            // layout: NHD (else HND)
}

inline ffi::ErrorOr<TokenMove> make_append(ffi::AnyBuffer k, ffi::AnyBuffer v,
                                           ffi::Buffer<ffi::S32> table,
                                           ffi::Buffer<ffi::S32> lengths,
                                           ffi::Buffer<ffi::S32> counts,
                                           ffi::Buffer<ffi::S32> layer,
                                           ffi::Result<ffi::AnyBuffer> k_pages,
                                           ffi::Result<ffi::AnyBuffer> v_pages, bool nhd) {
  constexpr const char* op = "paged_append";
  if (layer.element_count() != 1) return ffi::Unexpected(invalid(op, "layer_idx must be a scalar"));
  const int64_t batch = static_cast<int64_t>(lengths.element_count());
  auto c = make_view(op, *k_pages, *v_pages, table.typed_data(),
                     static_cast<int64_t>(table.element_count()), batch, nhd);
  if (c.has_error()) return ffi::Unexpected(c.error());
  auto kd = k.dimensions();
  const size_t o = kd.size() == 5 ? 1 : 0;
  if (kd.size() != 4 + o || k.element_type() != k_pages->element_type() ||
      v.element_type() != k.element_type() || v.size_bytes() != k.size_bytes())
    return ffi::Unexpected(invalid(op, "k/v do not match the pools"));
  // The element size from the dtype (token_bytes / head_dim would divide by zero at head_dim 0).
  auto elem_or = element_bytes(k_pages->element_type(), op);
  if (elem_or.has_error()) return ffi::Unexpected(elem_or.error());
  const int64_t elem = *elem_or;
  if (kd[o] != batch || kd[o + 1] != c->heads || kd[o + 3] * elem != c->token_bytes ||
      (o && kd[0] != c->num_layers))
    return ffi::Unexpected(invalid(op, "k/v shape does not match the cache"));
  if (counts.element_count() != 0 && static_cast<int64_t>(counts.element_count()) != batch)
    return ffi::Unexpected(invalid(op, "counts must have one entry per row"));
  TokenMove m;
  m.cache = *c;
  m.dense_k = static_cast<char*>(k.untyped_data());
  m.dense_v = static_cast<char*>(v.untyped_data());
  m.tokens = static_cast<int32_t>(kd[o + 2]);
  m.dense_head_stride = int64_t{m.tokens} * c->token_bytes;
  m.dense_row_stride = c->heads * m.dense_head_stride;
  m.dense_layer_stride = batch * m.dense_row_stride;
  m.lengths = lengths.typed_data();
  m.counts = counts.element_count() ? counts.typed_data() : nullptr;
  m.layer = layer.typed_data();
  m.layers = o ? c->num_layers : 1;
  m.gather = false;
  return m;
}

// Binding of "jaxkv_paged_gather" after the platform's context arguments.
template <class Binding>
auto bind_paged_gather(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()         // k_pages
      .template Arg<ffi::AnyBuffer>()         // v_pages
      .template Arg<ffi::Buffer<ffi::S32>>()  // page_table [B, max_pages]
      .template Arg<ffi::Buffer<ffi::S32>>()  // lengths [B]: tokens read per row
      .template Arg<ffi::Buffer<ffi::S32>>()  // layer_idx []
      .RemainingRets()                        // [B, 2, H, T, D], or K and V [B, H, T, D] each
      .template Attr<bool>("nhd");            // layout: NHD (else HND)
}

inline ffi::ErrorOr<TokenMove> make_gather(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                           ffi::Buffer<ffi::S32> table,
                                           ffi::Buffer<ffi::S32> lengths,
                                           ffi::Buffer<ffi::S32> layer, ffi::RemainingRets outs,
                                           bool nhd) {
  constexpr const char* op = "paged_gather";
  if (layer.element_count() != 1) return ffi::Unexpected(invalid(op, "layer_idx must be a scalar"));
  const int64_t batch = static_cast<int64_t>(lengths.element_count());
  auto c = make_view(op, k_pages, v_pages, table.typed_data(),
                     static_cast<int64_t>(table.element_count()), batch, nhd);
  if (c.has_error()) return ffi::Unexpected(c.error());
  if (outs.size() != 1 && outs.size() != 2) return ffi::Unexpected(invalid(op, "one or two outputs"));
  const bool split = outs.size() == 2;
  auto first = outs.get<ffi::AnyBuffer>(0);
  if (first.has_error()) return ffi::Unexpected(first.error());
  ffi::AnyBuffer out = **first;
  auto od = out.dimensions();
  if (od.size() != (split ? 4u : 5u) || out.element_type() != k_pages.element_type() ||
      od[0] != batch)
    return ffi::Unexpected(invalid(op, "output does not match the cache"));
  TokenMove m;
  m.cache = *c;
  m.tokens = static_cast<int32_t>(od[od.size() - 2]);
  m.dense_head_stride = int64_t{m.tokens} * c->token_bytes;
  if (static_cast<int64_t>(out.size_bytes()) != batch * (split ? 1 : 2) * c->heads * m.dense_head_stride)
    return ffi::Unexpected(invalid(op, "output does not match the cache"));
  m.dense_k = static_cast<char*>(out.untyped_data());
  if (split) {
    auto second = outs.get<ffi::AnyBuffer>(1);
    if (second.has_error()) return ffi::Unexpected(second.error());
    if ((*second)->size_bytes() != out.size_bytes())
      return ffi::Unexpected(invalid(op, "K and V outputs differ"));
    m.dense_v = static_cast<char*>((*second)->untyped_data());
    m.dense_row_stride = c->heads * m.dense_head_stride;
  } else {
    m.dense_v = m.dense_k + c->heads * m.dense_head_stride;
    m.dense_row_stride = 2 * c->heads * m.dense_head_stride;
  }
  m.dense_layer_stride = 0;
  m.lengths = lengths.typed_data();
  m.counts = nullptr;
  m.layer = layer.typed_data();
  m.layers = 1;
  m.gather = true;
  return m;
}

// Binding of "jaxkv_paged_copy" after the platform's context arguments.
template <class Binding>
auto bind_paged_copy(Binding b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()  // src_pages [n]
      .template Arg<ffi::Buffer<ffi::S32>>()  // dst_pages [n]
      .template Arg<ffi::AnyBuffer>()         // k_pages (used through the alias)
      .template Arg<ffi::AnyBuffer>()         // v_pages (used through the alias)
      .template Ret<ffi::AnyBuffer>()         // k_pages, aliased
      .template Ret<ffi::AnyBuffer>()         // v_pages, aliased
      .template Attr<bool>("nhd");            // layout: NHD (else HND)
}

inline ffi::ErrorOr<PageCopy> make_copy(ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                        ffi::Result<ffi::AnyBuffer> k_pages,
                                        ffi::Result<ffi::AnyBuffer> v_pages, bool nhd) {
  constexpr const char* op = "copy_pages";
  if (src.element_count() != dst.element_count())
    return ffi::Unexpected(invalid(op, "src_pages and dst_pages differ in length"));
  auto c = make_view(op, *k_pages, *v_pages, nullptr, 0, 1, nhd);
  if (c.has_error()) return ffi::Unexpected(c.error());
  PageCopy p;
  p.cache = *c;
  p.src = src.typed_data();
  p.dst = dst.typed_data();
  p.pairs = static_cast<int32_t>(src.element_count());
  return p;
}

}  // namespace jaxkv
