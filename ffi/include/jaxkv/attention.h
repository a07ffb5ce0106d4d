// Attention over a KV cache read in place, shared by the CPU and CUDA handlers.
//
// Every cache kind is read through one addressing view (kv_view.h). The kernels get the whole buffer and the layer index: a slice of a stacked buffer handed to a
// custom call would be a copy of the layer on every call.
//
// One generic problem covers decode and prefill: query t < counts[b] of row b, at position
// p = starts[b] + t, attends to the cache tokens (p - window, p], the last `window` of [0, p]
// (decode: one query, starts = kv_length - 1; full attention: window = INT32_MAX); other queries,
// and rows of a layer out of range, return zeros. Each score, after the softmax scale, may be
// soft-capped (soft_cap * tanh(s / soft_cap)); a head's sink logit, where given, enters the
// softmax's denominator only. Positions past the capacity or without a page are never read (the
// Python side reports them through checkify). A dense ring (kv_view.h) gets its positions in a
// frame of two laps and is read only within its last S positions (first_key).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "jaxkv/kv_view.h"

namespace jaxkv {

// Blocks a multiprocessor of the 16-bit tensor-core decode kernel at its shallow ring
// (ffi/cuda/attention_decode.cu's TcShallow); jaxkv/attention.py's split rule reads it from the
// extension (decode_resident_blocks).
constexpr int kDecodeResidentBlocks = 3;

struct AttentionProblem {
  KVView kv;
  const char* q;         // [batch, tokens, q_heads, head_dim], q dtype
  char* out;             // same shape and dtype
  const int32_t* starts;  // [batch]: position of query 0
  const int32_t* counts;  // [batch]: queries of the row (the rest return zeros)
  const int32_t* layer;   // []
  const float* k_scale;   // []: dequantization scale of K (an 8-bit cache's per-tensor scale; else 1)
  const float* v_scale;   // []
  KVView scales;          // an 8-bit cache's scales per token and head (scales.k null: none)
  int* item_counter;      // word 0 of the workspace, or null: the wgmma prefill's items taken
  float* v_maxima;        // [B, H] after it, or null: the wgmma prefill's largest V scales
  const int32_t* window;  // []: keys a query sees, itself included (INT32_MAX: all; <= 0: none)
  const float* sinks;     // [q_heads]: each head's sink logit, or null: no sink
  float scale;            // softmax scale
  float soft_cap;         // > 0: scores after `scale` become soft_cap * tanh(s / soft_cap); 0: none
  int32_t span;           // keys one query sees at most (capacity, a ring's slots, or a static
                          // window's width): the split-KV kernels size their splits by it
  int32_t batch, tokens, q_heads, head_dim;
  int32_t group;          // q heads per KV head
  ffi::DataType q_type, kv_type;

  // Keys query t of row b attends to: [0, keys); 0 for a query past the row's count.
  JAXKV_HD int32_t keys(int32_t b, int32_t t) const {
    if (t >= counts[b]) return 0;
    const int64_t n = int64_t{starts[b]} + t + 1;
    if (n <= 0) return 0;
    return n > kv.capacity ? kv.capacity : static_cast<int32_t>(n);
  }
  // The first key query t of row b sees under `window` (*this->window, read once by the caller):
  // keys [first_key, keys) are its window; first_key == keys when it sees none. Over a dense ring
  // (kv.ring = S slots) also no key below the ring: it holds the row's last S positions, those
  // before the end of the call's newest query, starts[b] + counts[b] (the tokens just appended),
  // so a query never reads a slot that a later position has overwritten (the Python side reports
  // such a read). Non-decreasing in t, as the window's start is.
  JAXKV_HD int32_t first_key(int32_t b, int32_t t, int32_t window_) const {
    const int32_t n = keys(b, t);
    int64_t f = int64_t{starts[b]} + t + 1 - window_;
    if (kv.ring > 0) {
      const int64_t oldest = int64_t{starts[b]} + counts[b] - kv.ring;
      if (f < oldest) f = oldest;
    }
    return f <= 0 ? 0 : (f >= n ? n : static_cast<int32_t>(f));
  }
  JAXKV_HD bool layer_ok() const { return *layer >= 0 && *layer < kv.num_layers; }
  // Element offset of (b, t, q head h, 0) in q and out.
  JAXKV_HD int64_t q_index(int32_t b, int32_t t, int32_t h) const {
    return ((int64_t{b} * tokens + t) * q_heads + h) * head_dim;
  }
};

// Binding of "jaxkv_attention_decode" / "jaxkv_attention_prefill" after the platform's context.
template <class Binding>
auto bind_attention(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()         // q [B, T, Hq, D] (decode: T = 1)
      .template Arg<ffi::AnyBuffer>()         // k: [L, B, 2, H, S, D], [B, 2, H, S, D] or a K pool
      .template Arg<ffi::AnyBuffer>()         // v: the same buffer (dense) or the V pool
      .template Arg<ffi::Buffer<ffi::S32>>()  // page_table [B, max_pages] (dense: [0])
      .template Arg<ffi::Buffer<ffi::S32>>()  // starts [B]: position of query 0
      .template Arg<ffi::Buffer<ffi::S32>>()  // counts [B]: queries per row
      .template Arg<ffi::Buffer<ffi::S32>>()  // layer_idx []
      .template Arg<ffi::Buffer<ffi::F32>>()  // k_scale []
      .template Arg<ffi::Buffer<ffi::F32>>()  // v_scale []
      .template Arg<ffi::AnyBuffer>()         // k_scales per token and head (kv_view.h), or [0]
      .template Arg<ffi::AnyBuffer>()         // v_scales
      .template Arg<ffi::Buffer<ffi::S32>>()  // window []: INT32_MAX for full attention
      .template Arg<ffi::Buffer<ffi::F32>>()  // sinks [Hq], or [0]: none
      .template Ret<ffi::AnyBuffer>()         // out [B, T, Hq, D], q's dtype
      .template Ret<ffi::Buffer<ffi::F32>>()  // workspace [B, T, Hq, splits, D + 2] (splits 1: [0])
      .template Attr<float>("scale")          // softmax scale
      .template Attr<float>("soft_cap")       // 0: none
      .template Attr<int32_t>("span")         // keys a query sees at most (split sizes)
      .template Attr<int32_t>("layout");      // KVLayout
}

// Is (q dtype, cache dtype) a pair the kernels read? q: f32, bf16 or f16; the cache the same
// dtype, or 8-bit (fp8 e4m3fn, e5m2, int8) under a bf16 or f16 q.
inline bool attention_dtypes_ok(ffi::DataType q, ffi::DataType kv) {
  using D = ffi::DataType;
  if (q != D::F32 && q != D::BF16 && q != D::F16) return false;
  if (kv == q) return true;
  return q != D::F32 && (kv == D::F8E4M3FN || kv == D::F8E5M2 || kv == D::S8);
}

inline ffi::ErrorOr<AttentionProblem> make_attention(
    const char* op, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> counts,
    ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
    ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales, ffi::Buffer<ffi::S32> window,
    ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> out, float scale, float soft_cap,
    int32_t span, int32_t layout) {
  auto bad = [op](const std::string& what) { return ffi::Unexpected(invalid(op, what)); };
  if (!attention_dtypes_ok(q.element_type(), k.element_type()) ||
      v.element_type() != k.element_type() || out->element_type() != q.element_type())
    return bad("unsupported dtypes of q / cache / out");
  auto qd = q.dimensions();
  if (qd.size() != 4 || out->dimensions().size() != 4 || out->size_bytes() != q.size_bytes())
    return bad("q and out must be [B, T, Hq, D]");
  if (k.size_bytes() != v.size_bytes() || layer.element_count() != 1 ||
      k_scale.element_count() != 1 || v_scale.element_count() != 1)
    return bad("k/v, layer_idx or scales do not match");
  AttentionProblem p;
  p.batch = static_cast<int32_t>(qd[0]);
  p.tokens = static_cast<int32_t>(qd[1]);
  p.q_heads = static_cast<int32_t>(qd[2]);
  p.head_dim = static_cast<int32_t>(qd[3]);
  if (static_cast<int64_t>(starts.element_count()) != p.batch ||
      static_cast<int64_t>(counts.element_count()) != p.batch)
    return bad("starts and counts must be [B]");
  int64_t d = 0;
  auto view = make_kv_view(op, layout, false, k, v, &table, p.batch, &d);
  if (view.has_error()) return ffi::Unexpected(view.error());
  p.kv = *view;
  const KVView& c = p.kv;
  if (d != p.head_dim) return bad("q's head_dim differs from the cache's");
  if (c.heads <= 0 || p.q_heads % c.heads != 0) return bad("q heads must be a multiple of KV heads");
  p.scales = KVView{};
  p.scales.k = p.scales.v = nullptr;
  p.item_counter = nullptr;
  p.v_maxima = nullptr;
  if (k_scales.element_count() != 0) {
    if (k_scales.element_type() != ffi::DataType::F32) return bad("scales must be float32");
    int64_t one = 0;
    auto s = make_kv_view(op, layout, true, k_scales, v_scales, &table, p.batch, &one);
    if (s.has_error()) return ffi::Unexpected(s.error());
    if (s->heads != c.heads || s->capacity != c.capacity || s->num_layers != c.num_layers ||
        s->num_pages != c.num_pages)
      return bad("scales do not fit the cache");
    p.scales = *s;
  }
  if (window.element_count() != 1) return bad("window must be an int32 scalar");
  if (sinks.element_count() != 0 && static_cast<int64_t>(sinks.element_count()) != p.q_heads)
    return bad("sinks must be [q_heads] or empty");
  if (!(soft_cap >= 0.f) || soft_cap > 3.0e38f) return bad("soft_cap must be finite and >= 0");
  if (span < 0) return bad("span must be >= 0");
  p.window = window.typed_data();
  p.sinks = sinks.element_count() != 0 ? sinks.typed_data() : nullptr;
  p.soft_cap = soft_cap;
  // A query sees at most the capacity's keys, a ring's at most its slots (first_key).
  const int32_t most = c.ring > 0 ? c.ring : c.capacity;
  p.span = span < most ? span : most;
  p.group = p.q_heads / c.heads;
  p.q = static_cast<const char*>(q.untyped_data());
  p.out = static_cast<char*>(out->untyped_data());
  p.starts = starts.typed_data();
  p.counts = counts.typed_data();
  p.layer = layer.typed_data();
  p.k_scale = k_scale.typed_data();
  p.v_scale = v_scale.typed_data();
  p.scale = scale;
  p.q_type = q.element_type();
  p.kv_type = k.element_type();
  return p;
}

}  // namespace jaxkv
