// Appending new tokens to a linear cache, shared by the CPU and CUDA handlers.
//
// The cache is a stack of layers [L, B, 2, H, S, D]; k and v are [B, H, T, D]. For each active row
// b, K/V half kv and head h, the first n = min(T, new_lengths[b]) tokens land at positions
// lengths[b] .. lengths[b] + n - 1. Both sides of that copy are contiguous byte runs, so the whole
// op is a set of (b, kv, h) spans whose offsets and sizes come from device data; positions past S
// are dropped, never written. A ring (kv_view.h: kDenseRing, S slots) puts position p at slot
// p % S and drops nothing: its run may wrap past slot S - 1 to slot 0, so each (b, kv, h) has two
// spans, the second empty unless the run wraps; of more than S tokens it keeps the last S.
#pragma once

#include <cstdint>
#include <utility>

#include "jaxkv/common.h"

namespace jaxkv {

struct AppendParams {
  char* cache;                  // [L, B, 2, H, S, D], or [B, 2, H, S, D] (L = 1)
  const char* k;                // [B, H, T, D]
  const char* v;                // [B, H, T, D]
  const int32_t* lengths;       // [B] write position of each row
  const int32_t* new_lengths;   // [B] tokens to write per row, or null: all T
  const int32_t* active;        // [] rows [0, active) are written
  const int32_t* layer;         // [] layer index into the stack
  int32_t num_layers, batch, heads, capacity, tokens;  // capacity: S, a ring's slots too
  int32_t token_bytes;          // head_dim * element size
  bool ring;                    // a ring of `capacity` slots (lengths: positions, any >= 0)

  // (b, kv, h) triples, and a ring's second run of each: its wrapped part.
  JAXKV_HD int64_t spans() const { return int64_t{batch} * 2 * heads * (ring ? 2 : 1); }
};

// Where span `i` = (part, b, kv, h) copies from and to, and how many bytes; bytes == 0 when
// nothing is written (inactive row, out-of-range layer, full row, a ring's run that does not wrap).
struct AppendSpan {
  const char* src;
  char* dst;
  int64_t bytes;
};

JAXKV_HD AppendSpan append_span(const AppendParams& p, int64_t i) {
  const int64_t triples = int64_t{p.batch} * 2 * p.heads;
  const int64_t part = i / triples;  // a ring's run: 0 from its first slot, 1 wrapped to slot 0
  i %= triples;
  const int64_t b = i / (2 * p.heads);
  const int64_t kvh = i % (2 * p.heads);
  const int64_t kv = kvh / p.heads, h = kvh % p.heads;
  AppendSpan s{nullptr, nullptr, 0};
  const int32_t layer = *p.layer;
  if (b >= *p.active || layer < 0 || layer >= p.num_layers) return s;
  const int64_t pos = p.lengths[b];
  int64_t n = p.new_lengths ? p.new_lengths[b] : p.tokens;
  if (n > p.tokens) n = p.tokens;
  if (pos < 0 || n <= 0) return s;
  int64_t first = 0, slot = pos;  // the first token copied, and its slot
  if (p.ring) {
    if (n > p.capacity) {  // a ring keeps the last S
      first = n - p.capacity;
      n = p.capacity;
    }
    slot = (pos + first) % p.capacity;
    const int64_t before_end = p.capacity - slot;  // tokens of the run before it wraps
    if (part == 0) {
      if (n > before_end) n = before_end;
    } else {
      if (n <= before_end) return s;
      first += before_end;
      n -= before_end;
      slot = 0;
    }
  } else {
    if (pos >= p.capacity) return s;
    if (n > p.capacity - pos) n = p.capacity - pos;  // tokens past max_seq_len are dropped
  }
  const int64_t tb = p.token_bytes;
  const int64_t head_stride = int64_t{p.capacity} * tb;
  const int64_t row_stride = 2 * p.heads * head_stride;
  s.dst = p.cache + (int64_t{layer} * p.batch + b) * row_stride + kvh * head_stride + slot * tb;
  s.src = (kv ? p.v : p.k) + ((b * p.heads + h) * int64_t{p.tokens} + first) * tb;
  s.bytes = n * tb;
  return s;
}

// Binding of the "jaxkv_append" target after the platform's context arguments.
template <class Binding>
auto bind_append(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // k [B, H, T, D]
      .template Arg<ffi::AnyBuffer>()          // v [B, H, T, D]
      .template Arg<ffi::Buffer<ffi::S32>>()   // lengths [B]: first position written
      .template Arg<ffi::Buffer<ffi::S32>>()   // new_lengths [B], or [0]: all T tokens
      .template Arg<ffi::Buffer<ffi::S32>>()   // active_batch_size []
      .template Arg<ffi::Buffer<ffi::S32>>()   // layer_idx []
      .template Arg<ffi::AnyBuffer>()          // cache [L, B, 2, H, S, D] / [B, 2, H, S, D] (aliased)
      .template Ret<ffi::AnyBuffer>()          // cache, aliased to the input
      .template Attr<bool>("ring");            // a ring of S slots: position p at slot p % S
}

// Fills AppendParams from the buffers (shapes were validated in Python; re-checked here).
inline ffi::ErrorOr<AppendParams> make_append_params(
    ffi::AnyBuffer& k, ffi::AnyBuffer& v, ffi::Buffer<ffi::S32>& lengths,
    ffi::Buffer<ffi::S32>& new_lengths, ffi::Buffer<ffi::S32>& active,
    ffi::Buffer<ffi::S32>& layer, ffi::Result<ffi::AnyBuffer>& cache, bool ring) {
  constexpr const char* op = "append";
  auto elem = element_bytes(cache->element_type(), op);
  if (elem.has_error()) return ffi::Unexpected(elem.error());
  auto dims = cache->dimensions();
  auto kd = k.dimensions();
  // A rank-5 cache [B, 2, H, S, D] is one layer (KVCacheManager: a reshape would cost a copy).
  if ((dims.size() != 6 && dims.size() != 5) || kd.size() != 4)
    return ffi::Unexpected(invalid(op, "bad ranks"));
  const size_t o = dims.size() - 5;  // 1 for a stack of layers, 0 for one layer
  const int64_t cd[6] = {o ? dims[0] : 1, dims[o],     dims[o + 1],
                         dims[o + 2],     dims[o + 3], dims[o + 4]};
  if (cd[2] != 2) return ffi::Unexpected(invalid(op, "bad ranks"));
  if (k.element_type() != cache->element_type() || v.element_type() != cache->element_type())
    return ffi::Unexpected(invalid(op, "k/v dtype differs from the cache"));
  if (kd[0] != cd[1] || kd[1] != cd[3] || kd[3] != cd[5] || v.size_bytes() != k.size_bytes())
    return ffi::Unexpected(invalid(op, "k/v shape does not match the cache"));
  if (static_cast<int64_t>(lengths.element_count()) != cd[1] ||
      (new_lengths.element_count() != 0 &&
       static_cast<int64_t>(new_lengths.element_count()) != cd[1]))
    return ffi::Unexpected(invalid(op, "lengths must have one entry per row"));
  if (active.element_count() != 1 || layer.element_count() != 1)
    return ffi::Unexpected(invalid(op, "active_batch_size and layer_idx must be scalars"));
  AppendParams p;
  p.cache = static_cast<char*>(cache->untyped_data());
  p.k = static_cast<const char*>(k.untyped_data());
  p.v = static_cast<const char*>(v.untyped_data());
  p.lengths = lengths.typed_data();
  p.new_lengths = new_lengths.element_count() ? new_lengths.typed_data() : nullptr;
  p.active = active.typed_data();
  p.layer = layer.typed_data();
  p.num_layers = static_cast<int32_t>(cd[0]);
  p.batch = static_cast<int32_t>(cd[1]);
  p.heads = static_cast<int32_t>(cd[3]);
  p.capacity = static_cast<int32_t>(cd[4]);
  p.tokens = static_cast<int32_t>(kd[2]);
  p.token_bytes = static_cast<int32_t>(cd[5] * *elem);
  p.ring = ring;
  if (ring && p.capacity < 1) return ffi::Unexpected(invalid(op, "a ring needs a slot"));
  return p;
}

}  // namespace jaxkv
