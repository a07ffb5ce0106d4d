// How handlers see KV-cache layers: a POD description per layer, built once on the host from the
// buffers XLA passes and handed by value to kernels (one launch covers every layer, whatever its
// shape).
#pragma once

#include <cstdint>

#include "jaxkv/common.h"

namespace jaxkv {

// Most layers one launch takes; the Python side checks this at trace time.
constexpr int kMaxLayers = 256;

// One layer laid out as [rows, heads, capacity, token_bytes] bytes. A KV layer
// [max_batch, 2, H, S, D] has heads = 2H (the K and V spans of each head), capacity = S and
// token_bytes = D * element size; a plain [rows, ...] tensor is heads = capacity = 1.
struct LayerSpan {
  char* base;           // row 0, head 0, token 0
  int64_t row_stride;   // bytes between rows
  int64_t head_stride;  // bytes between head spans (capacity * token_bytes)
  int32_t heads;
  int32_t capacity;     // tokens per head span
  int32_t token_bytes;  // bytes of one token of one head
};

// Geometry of a [.., 2, H, S, D] KV layer view starting at `base`.
inline LayerSpan kv_layer_span(char* base, int64_t rows, int64_t h, int64_t s, int64_t d,
                               int64_t elem) {
  (void)rows;
  LayerSpan l;
  l.base = base;
  l.token_bytes = static_cast<int32_t>(d * elem);
  l.capacity = static_cast<int32_t>(s);
  l.heads = static_cast<int32_t>(2 * h);
  l.head_stride = s * d * elem;
  l.row_stride = 2 * h * l.head_stride;
  return l;
}

// Geometry of the scales [.., H, S] of a KV layer starting at `base`: one value per token and head.
inline LayerSpan scale_layer_span(char* base, int64_t h, int64_t s, int64_t elem) {
  LayerSpan l;
  l.base = base;
  l.token_bytes = static_cast<int32_t>(elem);
  l.capacity = static_cast<int32_t>(s);
  l.heads = static_cast<int32_t>(h);
  l.head_stride = s * elem;
  l.row_stride = h * l.head_stride;
  return l;
}

// Describes every layer of a buffer list. Each buffer is one layer [rows, 2, H, S, D], or a stack
// of layers [L, rows, 2, H, S, D] (LinearKVCache), or the per-token scales of an 8-bit cache,
// [rows, H, S] or [L, rows, H, S] (heads = H spans of S one-value tokens, moved with their data);
// or, when `kv` is false, a plain [rows, ...] tensor compacted row by row. Returns the number of
// layers written to `out`.
template <class Buffers>
ffi::ErrorOr<int> describe_layers(const char* op, const Buffers& buffers, size_t count, bool kv,
                                  int64_t rows, LayerSpan* out) {
  int n = 0;
  for (size_t i = 0; i < count; ++i) {
    auto buf = buffers(i);
    if (buf.has_error()) return ffi::Unexpected(buf.error());
    ffi::AnyBuffer b = *buf;
    auto elem = element_bytes(b.element_type(), op);
    if (elem.has_error()) return ffi::Unexpected(elem.error());
    auto dims = b.dimensions();
    char* base = static_cast<char*>(b.untyped_data());
    if (!kv) {
      if (dims.size() < 1 || dims[0] != rows) return ffi::Unexpected(invalid(op, "buffer rows do not match"));
      if (n >= kMaxLayers) return ffi::Unexpected(invalid(op, "too many buffers"));
      const int64_t row_bytes = rows ? static_cast<int64_t>(b.size_bytes()) / rows : 0;
      // The row is one "token" here, and a token's bytes are an int32 (the kernels pick their
      // word width from it): a row of 2 GiB or more is refused, not truncated.
      if (row_bytes > INT32_MAX) return ffi::Unexpected(invalid(op, "a row of a compacted tensor has 2 GiB or more"));
      out[n++] = LayerSpan{base, row_bytes, row_bytes, 1, 1, static_cast<int32_t>(row_bytes)};
      continue;
    }
    const bool scales = dims.size() == 3 || dims.size() == 4;
    const bool stacked = dims.size() == (scales ? 4 : 6);
    if (!scales && !stacked && dims.size() != 5)
      return ffi::Unexpected(invalid(op, "a KV layer must have rank 5 or 6, its scales 3 or 4"));
    const int64_t num = stacked ? dims[0] : 1;
    const int64_t o = stacked ? 1 : 0;
    if (dims[o] != rows || (!scales && dims[o + 1] != 2))
      return ffi::Unexpected(invalid(op, "KV layer shape mismatch"));
    for (int64_t l = 0; l < num; ++l) {
      if (n >= kMaxLayers) return ffi::Unexpected(invalid(op, "too many layers for one launch"));
      LayerSpan s = scales ? scale_layer_span(base, dims[o + 1], dims[o + 2], *elem)
                           : kv_layer_span(base, rows, dims[o + 2], dims[o + 3], dims[o + 4], *elem);
      s.base = base + l * rows * s.row_stride;
      out[n++] = s;
    }
  }
  return n;
}

}  // namespace jaxkv
