// Quantizing K/V on their way into an 8-bit cache (fp8 e4m3 / e5m2, int8), shared by the CPU and
// CUDA handlers of the dense and the paged append.
//
// Each (layer, row, K/V, head, token) vector of head_dim values becomes head_dim bytes. Scaled per
// token and head, its scale is s = max|x| / QMAX (float32), written beside the data, and the bytes
// are x / s clipped to [-QMAX, QMAX] and rounded to nearest even (a vector of zeros: scale 0 and
// zeros). Scaled per tensor, s is the layer's given scale and nothing but the data is written. The
// source is float32, bfloat16 or float16 [n, B, H, T, D]; data and scales go in one launch. A dense
// ring (kv_view.h) takes its rows' lengths in [0, S) (positions less a multiple of S) and writes
// each row's last S tokens at their slots.
#pragma once

#include <cstdint>
#include <string>

#include "jaxkv/kv_view.h"
#include "jaxkv/numerics.h"

namespace jaxkv {

struct QuantAppend {
  KVView cache;                 // the 8-bit data
  KVView scales;                // per token and head: where the scales go
  const float* tensor_k_scale;  // per tensor: the [L] scales of K and of V; else null
  const float* tensor_v_scale;
  const char* k;                // [n, B, H, T, D] in `input`
  const char* v;
  Format input, format;
  const int32_t* lengths;       // [B]: position of token 0 of each row
  const int32_t* counts;        // [B]: tokens of each row to write, or null: all T
  const int32_t* active;        // []: rows [0, active) are written, or null: every row
  const int32_t* layer;         // []: the cache layer of source layer 0
  int32_t layers, batch, heads, tokens, head_dim;

  JAXKV_HD int64_t vectors() const { return int64_t{layers} * batch * 2 * heads * tokens; }
};

// Where vector i = (n, b, K/V, h, t) (t fastest) comes from and goes.
struct QuantTarget {
  const char* src;  // its first value
  char* dst;        // its first byte
  float* scale;     // where its scale goes (null per tensor)
  float given;      // per tensor: the scale to use
};

// The five coordinates of vector i (t fastest), with 32-bit divisions by FastDiv where the
// vectors fit int32 (a 64-bit division is a long instruction sequence on a GPU).
struct VectorIndex {
  int32_t n, b, h, t;
  bool is_v;
};

JAXKV_HD VectorIndex vector_index(const QuantAppend& p, int64_t i) {
  VectorIndex v;
  v.t = static_cast<int32_t>(i % p.tokens);
  i /= p.tokens;
  v.h = static_cast<int32_t>(i % p.heads);
  i /= p.heads;
  v.is_v = i % 2;
  i /= 2;
  v.b = static_cast<int32_t>(i % p.batch);
  v.n = static_cast<int32_t>(i / p.batch);
  return v;
}

struct VectorDivs {  // FastDiv by tokens, heads and batch: vectors < 2^31 only
  FastDiv tokens, heads, batch;
};

// kWithKV false: i counts (n, b, h, t) with no K/V step (a lane's K and V together), is_v false.
template <bool kWithKV = true>
JAXKV_HD VectorIndex vector_index(const VectorDivs& d, uint32_t i) {
  VectorIndex v;
  uint32_t q = d.tokens.div(i);
  v.t = static_cast<int32_t>(i - q * d.tokens.d);
  i = q;
  q = d.heads.div(i);
  v.h = static_cast<int32_t>(i - q * d.heads.d);
  i = q;
  v.is_v = kWithKV && (i & 1);
  if (kWithKV) i >>= 1;
  q = d.batch.div(i);
  v.b = static_cast<int32_t>(i - q * d.batch.d);
  v.n = static_cast<int32_t>(q);
  return v;
}

// Where vector `at` is read from: its first value (an address that needs no load, so a kernel
// can start reading the values before it knows where they go).
JAXKV_HD const char* quant_source(const QuantAppend& p, const VectorIndex& at) {
  const int64_t i = ((int64_t{at.n} * p.batch + at.b) * p.heads + at.h) * p.tokens + at.t;
  return (at.is_v ? p.v : p.k) + i * p.head_dim * format_bytes(p.input);
}

// The metadata of a vector's row, loaded by the caller (all at once, none waiting on another).
struct RowFacts {
  int32_t layer;   // *p.layer
  int32_t length;  // p.lengths[b]
  int32_t count;   // p.counts[b], or p.tokens
  int32_t active;  // *p.active, or p.batch
};

JAXKV_HD RowFacts row_facts(const QuantAppend& p, int32_t b) {
  return RowFacts{*p.layer, p.lengths[b], p.counts ? p.counts[b] : p.tokens,
                  p.active ? *p.active : p.batch};
}

// Whether vector `at` is written at all (the checks of quant_target that need no page): an
// active row, a layer in range, a token within the row's count, a length not negative, a
// position within the capacity; in a ring (kv_view.h) any position, of the row's last S tokens
// (of more than S, the earlier would share their slots with the later).
JAXKV_HD bool quant_writes(const QuantAppend& p, const VectorIndex& at, const RowFacts& row) {
  const int64_t layer = int64_t{row.layer} + at.n;
  const int64_t count = row.count < p.tokens ? row.count : p.tokens;
  const bool kept = p.cache.ring > 0 ? int64_t{at.t} + p.cache.ring >= count
                                     : int64_t{row.length} + at.t < p.cache.capacity;
  return at.b < row.active && layer >= 0 && layer < p.cache.num_layers && at.t < row.count &&
         row.length >= 0 && kept;
}

// quant_target in two steps, for a kernel that has work to do while the page entry is loaded:
// first the entry's load and everything that needs no page (the checks of quant_writes, the
// places were the vector on page 0: an offset is linear in the page, the scale given per tensor),
// then the entry's check and one multiply-add a pointer.
struct QuantSlot {
  int32_t entry;      // the page-table entry (dense: the row), unchecked
  bool writes;        // quant_writes
  float given;        // per tensor: the scale to use (0 where nothing is written)
  const char* src;    // the vector's first value
  char* dst;          // its first byte, were it on page 0
  char* scale;        // where its scale goes, were it on page 0 (null per tensor)
};

JAXKV_HD QuantSlot quant_slot(const QuantAppend& p, const VectorIndex& at, const RowFacts& row) {
  const int64_t layer = int64_t{row.layer} + at.n;
  const int64_t at_pos = int64_t{row.length} + at.t;
  int32_t pos = at_pos >= 0 && at_pos < p.cache.capacity ? static_cast<int32_t>(at_pos) : 0;
  // A ring's position past its frame (lengths given as positions, not reduced into [0, S) as
  // jaxkv/_lifecycle.py gives them): its slot by a 64-bit remainder.
  if (p.cache.ring > 0 && at_pos >= p.cache.capacity)
    pos = static_cast<int32_t>(at_pos % p.cache.ring);
  const int32_t slot = p.cache.slot(pos);
  const bool writes = quant_writes(p, at, row);
  QuantSlot s{p.cache.entry(at.b, pos), writes, 0.f, quant_source(p, at),
              (at.is_v ? p.cache.v : p.cache.k) + p.cache.at_slot(layer, 0, at.h, slot), nullptr};
  if (p.tensor_k_scale) {
    if (writes) s.given = (at.is_v ? p.tensor_v_scale : p.tensor_k_scale)[layer];
  } else {
    s.scale = (at.is_v ? p.scales.v : p.scales.k) + p.scales.at_slot(layer, 0, at.h, slot);
  }
  return s;
}

JAXKV_HD bool quant_target(const QuantAppend& p, const QuantSlot& s, QuantTarget* t) {
  if (!s.writes || !p.cache.holds(s.entry)) return false;
  t->src = s.src;
  t->dst = s.dst + s.entry * p.cache.page_stride;
  t->scale = s.scale ? reinterpret_cast<float*>(s.scale + s.entry * p.scales.page_stride) : nullptr;
  t->given = s.given;
  return true;
}

// Where vector `at` goes; false when nothing is written (quant_writes false, or no page holds
// its position): the two steps at once.
JAXKV_HD bool quant_target(const QuantAppend& p, const VectorIndex& at, const RowFacts& row,
                           QuantTarget* t) {
  return quant_target(p, quant_slot(p, at, row), t);
}

// The V vector of the (layer, row, head, token) whose K vector goes to `k` (quant_target with
// is_v false): the same offsets in V's source, data and scales.
JAXKV_HD QuantTarget v_target(const QuantAppend& p, const QuantTarget& k, int64_t layer) {
  QuantTarget t;
  t.src = p.v + (k.src - p.k);
  t.dst = p.cache.v + (k.dst - p.cache.k);
  t.scale = k.scale ? reinterpret_cast<float*>(p.scales.v + (reinterpret_cast<char*>(k.scale) -
                                                              p.scales.k))
                    : nullptr;
  t.given = p.tensor_v_scale ? p.tensor_v_scale[layer] : 0.f;
  return t;
}

// The stored bits of value x under scale s (jaxkv.reference.quantize).
JAXKV_HD uint8_t quantize_value(float x, float s, Format f) {
  return encode(s > 0.f ? x / s : 0.f, f);
}

// One vector, serially (the CPU handlers): its scale (per token and head: max|x| / QMAX, written
// to t.scale; per tensor t.given) and its head_dim bytes.
inline void quantize_vector(const QuantTarget& t, int32_t head_dim, Format input, Format format) {
  float s = t.given;
  if (t.scale) {
    float amax = 0.f;
    for (int32_t d = 0; d < head_dim; ++d) amax = fmaxf(amax, fabsf(load_float(t.src, d, input)));
    s = amax / format_max(format);
    *t.scale = s;
  }
  for (int32_t d = 0; d < head_dim; ++d)
    t.dst[d] = static_cast<char>(quantize_value(load_float(t.src, d, input), s, format));
}

// Builds the problem from the buffers; `table`: null for a dense cache, `active`: null for every
// row; `k_scales` / `v_scales` [L] per tensor.
inline ffi::ErrorOr<QuantAppend> make_quant_append(
    const char* op, int32_t layout, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::Buffer<ffi::S32>* table, ffi::Buffer<ffi::S32>& lengths, ffi::Buffer<ffi::S32>& counts,
    ffi::Buffer<ffi::S32>* active, ffi::Buffer<ffi::S32>& layer, ffi::AnyBuffer k_cache,
    ffi::AnyBuffer v_cache, ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales, bool per_token) {
  auto bad = [op](const std::string& what) { return ffi::Unexpected(invalid(op, what)); };
  QuantAppend p;
  if (!format_of(k.element_type(), &p.input) || p.input > Format::kF16 ||
      v.element_type() != k.element_type())
    return bad("k and v must be float32, bfloat16 or float16");
  if (!format_of(k_cache.element_type(), &p.format) || p.format < Format::kE4M3)
    return bad("the cache must be float8_e4m3fn, float8_e5m2 or int8");
  if (k_scales.element_type() != ffi::DataType::F32 ||
      v_scales.element_type() != ffi::DataType::F32)
    return bad("scales must be float32");
  auto kd = k.dimensions();
  if ((kd.size() != 4 && kd.size() != 5) || k.size_bytes() != v.size_bytes())
    return bad("k and v must be [(L,) B, H, T, D]");
  const size_t o = kd.size() - 4;
  p.layers = o ? static_cast<int32_t>(kd[0]) : 1;
  p.batch = static_cast<int32_t>(kd[o]);
  p.heads = static_cast<int32_t>(kd[o + 1]);
  p.tokens = static_cast<int32_t>(kd[o + 2]);
  p.head_dim = static_cast<int32_t>(kd[o + 3]);
  int64_t d = 0;
  auto cache = make_kv_view(op, layout, false, k_cache, v_cache, table, p.batch, &d);
  if (cache.has_error()) return ffi::Unexpected(cache.error());
  p.cache = *cache;
  if (d != p.head_dim || p.cache.heads != p.heads) return bad("k and v do not fit the cache");
  if (per_token) {
    int64_t one = 0;
    auto scales = make_kv_view(op, layout, true, k_scales, v_scales, table, p.batch, &one);
    if (scales.has_error()) return ffi::Unexpected(scales.error());
    p.scales = *scales;
    if (p.scales.heads != p.heads || p.scales.capacity != p.cache.capacity ||
        p.scales.num_layers != p.cache.num_layers)
      return bad("scales do not fit the cache");
    p.tensor_k_scale = p.tensor_v_scale = nullptr;
  } else {
    if (static_cast<int64_t>(k_scales.element_count()) != p.cache.num_layers ||
        v_scales.element_count() != k_scales.element_count())
      return bad("per-tensor scales must be [num_layers]");
    p.scales = p.cache;
    p.tensor_k_scale = static_cast<const float*>(k_scales.untyped_data());
    p.tensor_v_scale = static_cast<const float*>(v_scales.untyped_data());
  }
  if (static_cast<int64_t>(lengths.element_count()) != p.batch ||
      (counts.element_count() != 0 && static_cast<int64_t>(counts.element_count()) != p.batch) ||
      layer.element_count() != 1 || (active && active->element_count() != 1))
    return bad("lengths / counts must be [B], layer_idx []");
  p.k = static_cast<const char*>(k.untyped_data());
  p.v = static_cast<const char*>(v.untyped_data());
  p.lengths = lengths.typed_data();
  p.counts = counts.element_count() ? counts.typed_data() : nullptr;
  p.active = active ? active->typed_data() : nullptr;
  p.layer = layer.typed_data();
  return p;
}

// Bindings after the platform's context. Dense: the cache [(L,) B, 2, H, S, D] holds K and V (a
// ring of S slots with `ring`: kv_view.h's kDenseRing).
template <class Binding>
auto bind_append_quantized(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // k [B, H, T, D], float
      .template Arg<ffi::AnyBuffer>()          // v
      .template Arg<ffi::Buffer<ffi::S32>>()   // lengths [B]
      .template Arg<ffi::Buffer<ffi::S32>>()   // counts [B], or [0]: all T
      .template Arg<ffi::Buffer<ffi::S32>>()   // active_batch_size []
      .template Arg<ffi::Buffer<ffi::S32>>()   // layer_idx []
      .template Arg<ffi::AnyBuffer>()          // cache (aliased)
      .template Arg<ffi::AnyBuffer>()          // k_scales [(L,) B, H, S], or [L] per tensor (aliased)
      .template Arg<ffi::AnyBuffer>()          // v_scales (aliased)
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<bool>("per_token")
      .template Attr<bool>("ring");            // a ring: position p at slot p % S
}

template <class Binding>
auto bind_paged_append_quantized(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // k [(L,) B, H, T, D], float
      .template Arg<ffi::AnyBuffer>()          // v
      .template Arg<ffi::Buffer<ffi::S32>>()   // page_table [B, max_pages]
      .template Arg<ffi::Buffer<ffi::S32>>()   // lengths [B]
      .template Arg<ffi::Buffer<ffi::S32>>()   // counts [B], or [0]: all T
      .template Arg<ffi::Buffer<ffi::S32>>()   // layer_idx []
      .template Arg<ffi::AnyBuffer>()          // k_pages (aliased)
      .template Arg<ffi::AnyBuffer>()          // v_pages (aliased)
      .template Arg<ffi::AnyBuffer>()          // k_scales: the pools without D, or [L] (aliased)
      .template Arg<ffi::AnyBuffer>()          // v_scales (aliased)
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<bool>("per_token")
      .template Attr<bool>("nhd");
}

}  // namespace jaxkv
