// One view of a cache for every kernel that addresses tokens: append, attention, dense and paged,
// data and per-token scales.
//
// Token `pos` of (layer, row, head) lives at
//   layer * layer_stride + head * head_stride + page * page_stride + (pos % page_size) * token_stride
// with page = page_table[row, pos / page_size] for a paged pool and page = row for a dense buffer
// (page_size = capacity, page_stride = the row stride):
//   linear stacked [L, B, 2, H, S, D] and a manager layer [B, 2, H, S, D]: V = K + H * S * D bytes;
//   paged HND [L, H, P, S, D] and NHD [L, P, S, H, D]: separate K and V pools.
// Scales (one float per token and head) are the same shapes without D, dense ones without the
// K/V axis (separate K and V buffers): [(L,) B, H, S], HND [L, H, P, S], NHD [L, P, S, H].
//
// A dense ring (kDenseRing: a sliding-window layer of S slots, TensorRT-LLM's cyclic cache) keeps
// each row's last S tokens, token `pos` at slot pos % S (page_size = ring = S). Its positions
// count on past S; the kernels address them in a frame of two laps, [0, capacity = 2S): the caller
// subtracts a multiple of S from a row's positions first (jaxkv/attention.py, jaxkv/_lifecycle.py),
// which keeps every slot, bounds every loop and grid by 2S, and leaves the window rule, which only
// looks at differences of positions, as it was. Attention clamps each query's first key to the
// ring (AttentionProblem::first_key): a position that has left the ring is never read.
#pragma once

#include <cstdint>
#include <string>

#include "jaxkv/common.h"

namespace jaxkv {

enum class KVLayout : int32_t { kDense = 0, kPagedHND = 1, kPagedNHD = 2, kDenseRing = 3 };

// The most slots of a ring: its frame of two laps, 2S positions, fits int32 (FastDiv: n < 2^31).
constexpr int32_t kMaxRingSlots = (int32_t{1} << 30) - 1;

struct KVView {
  char* k;                    // K of token 0 of layer 0, row/page 0, head 0
  char* v;                    // the same for V
  const int32_t* page_table;  // [batch, max_pages], or null (dense)
  int64_t layer_stride, head_stride, page_stride, token_stride;  // bytes
  int32_t num_layers, heads, num_pages, page_size, max_pages, capacity;
  int32_t ring;      // a dense ring's slots S (= page_size; capacity 2S, the frame), or 0: no ring
  FastDiv page_div;  // by page_size: a multiply-high, where a division is ~20 instructions

  // Position pos in [0, capacity) as (page-table column, slot in that page).
  JAXKV_HD int32_t column(int32_t pos) const {
    return static_cast<int32_t>(page_div.div(static_cast<uint32_t>(pos)));
  }
  JAXKV_HD int32_t slot(int32_t pos) const { return pos - column(pos) * page_size; }
  // The page-table entry of token pos of row (dense: the row itself), unchecked; pos in
  // [0, capacity). Kernels load it a stage ahead and check it with holds() when they use it.
  JAXKV_HD int32_t entry(int32_t row, int32_t pos) const {
    return page_table ? page_table[int64_t{row} * max_pages + column(pos)] : row;
  }
  JAXKV_HD bool holds(int32_t page) const { return page >= 0 && page < num_pages; }
  // The page holding token pos of row, or -1: no page of this pool does.
  JAXKV_HD int32_t page(int32_t row, int32_t pos) const {
    if (pos < 0 || pos >= capacity) return -1;
    const int32_t p = entry(row, pos);
    return holds(p) ? p : -1;
  }
  // Byte offset (from k or v) of token pos of (layer, head) on a page from page().
  JAXKV_HD int64_t at(int64_t layer, int32_t page, int32_t head, int32_t pos) const {
    return at_slot(layer, page, head, slot(pos));
  }
  // The same from the token's slot in its page.
  JAXKV_HD int64_t at_slot(int64_t layer, int32_t page, int32_t head, int32_t slot) const {
    return layer * layer_stride + head * head_stride + page * page_stride + int64_t{slot} * token_stride;
  }
  // The float at byte offset `off` of K (or V): a scale.
  JAXKV_HD float k_float(int64_t off) const { return *reinterpret_cast<const float*>(k + off); }
  JAXKV_HD float v_float(int64_t off) const { return *reinterpret_cast<const float*>(v + off); }
  // Byte offset of token pos of (layer, row, head), or -1: no page holds it.
  JAXKV_HD int64_t offset(int64_t layer, int32_t row, int32_t head, int32_t pos) const {
    const int32_t p = page(row, pos);
    return p < 0 ? -1 : at(layer, p, head, pos);
  }
};

// The view of a cache (scales: of its scales) from the K buffer's shape; `head_dim` gets D (1 for
// scales). Dense data reads V from the K buffer; every other kind reads the v buffer. `table`:
// the page table of a paged cache (a dense one has none).
inline ffi::ErrorOr<KVView> make_kv_view(const char* op, int32_t layout, bool scales,
                                         ffi::AnyBuffer k, ffi::AnyBuffer v,
                                         ffi::Buffer<ffi::S32>* table, int64_t batch,
                                         int64_t* head_dim) {
  auto bad = [op](const std::string& what) { return ffi::Unexpected(invalid(op, what)); };
  auto elem = element_bytes(k.element_type(), op);
  if (elem.has_error()) return ffi::Unexpected(elem.error());
  if (k.size_bytes() != v.size_bytes()) return bad("K and V buffers differ");
  auto kd = k.dimensions();
  const size_t rank = kd.size() + (scales ? 1 : 0);  // scales: a trailing D of 1
  if (rank > 6) return bad("cache rank");
  int64_t d[6] = {0, 0, 0, 0, 0, 0};
  for (size_t i = 0; i < kd.size(); ++i) d[i] = kd[i];
  if (scales) d[kd.size()] = 1;
  KVView c;
  c.k = static_cast<char*>(k.untyped_data());
  c.v = static_cast<char*>(v.untyped_data());
  const bool ring = layout == static_cast<int32_t>(KVLayout::kDenseRing);
  c.ring = 0;
  if (layout == static_cast<int32_t>(KVLayout::kDense) || ring) {
    const size_t full = scales ? 5 : 6;  // with a layer axis
    const bool stacked = rank == full;
    if (!stacked && rank != full - 1) return bad("a dense cache must be [(L,) B, 2, H, S, D]");
    const size_t o = stacked ? 1 : 0;
    const size_t kv = scales ? 0 : 1;  // the K/V axis of dense data
    if (d[o] != batch || (kv && d[o + 1] != 2)) return bad("cache rows do not match");
    const int64_t slots = d[o + kv + 2];
    if (ring && (slots < 1 || slots > kMaxRingSlots))
      return bad("a ring holds 1 to 2^30 - 1 slots");
    c.num_layers = stacked ? static_cast<int32_t>(d[0]) : 1;
    c.heads = static_cast<int32_t>(d[o + kv + 1]);
    c.page_size = static_cast<int32_t>(slots);
    c.capacity = static_cast<int32_t>(ring ? 2 * slots : slots);  // a ring: its frame
    c.ring = ring ? c.page_size : 0;
    *head_dim = scales ? 1 : d[o + kv + 3];
    c.token_stride = *head_dim * *elem;
    c.head_stride = slots * c.token_stride;
    c.page_stride = (kv + 1) * c.heads * c.head_stride;  // a row
    c.layer_stride = batch * c.page_stride;
    if (!scales) c.v = c.k + c.heads * c.head_stride;
    c.page_table = nullptr;
    c.num_pages = static_cast<int32_t>(batch);
    c.max_pages = 1;
  } else if (layout == static_cast<int32_t>(KVLayout::kPagedHND) ||
             layout == static_cast<int32_t>(KVLayout::kPagedNHD)) {
    const bool nhd = layout == static_cast<int32_t>(KVLayout::kPagedNHD);
    if (rank != 5 || table == nullptr) return bad("pools must have rank 5, with a page table");
    auto td = table->dimensions();
    if (td.size() != 2 || td[0] != batch) return bad("page_table must be [B, max_pages]");
    c.num_layers = static_cast<int32_t>(d[0]);
    c.heads = static_cast<int32_t>(nhd ? d[3] : d[1]);
    c.num_pages = static_cast<int32_t>(nhd ? d[1] : d[2]);
    c.page_size = static_cast<int32_t>(nhd ? d[2] : d[3]);
    *head_dim = d[4];
    c.max_pages = static_cast<int32_t>(td[1]);
    c.capacity = c.max_pages * c.page_size;
    c.page_table = table->typed_data();
    const int64_t tb = *head_dim * *elem;
    if (nhd) {
      c.token_stride = c.heads * tb;
      c.head_stride = tb;
      c.page_stride = c.page_size * c.token_stride;
      c.layer_stride = c.num_pages * c.page_stride;
    } else {
      c.token_stride = tb;
      c.page_stride = c.page_size * tb;
      c.head_stride = c.num_pages * c.page_stride;
      c.layer_stride = c.heads * c.head_stride;
    }
  } else {
    return bad("unknown layout " + std::to_string(layout));
  }
  c.page_div = FastDiv(static_cast<uint32_t>(c.page_size));
  return c;
}

}  // namespace jaxkv
