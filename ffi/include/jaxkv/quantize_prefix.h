// The quantizing instantiate, shared by the CPU and CUDA handlers: an unquantized saved prefix
// (float32 / bfloat16 / float16 [2, H, T, D] per layer) written into slots of an 8-bit cache
// ([rows, 2, H, S, D] per layer, or a stack of them), each (slot, K/V head, token) vector
// quantized on its way exactly as the cache's append stores it (quantize.h): per token and head,
// its scale written into the scale layers ([rows, H, S] float32); per tensor, the layer's given
// scale. One launch for every layer and slot, no temporary of the 8-bit values. Slots outside
// [0, rows) are never dereferenced.
#pragma once

#include <cstdint>

#include "jaxkv/layers.h"
#include "jaxkv/quantize.h"

namespace jaxkv {

struct QuantPrefixLayer {
  LayerSpan cache;    // [rows, 2H, S, D] bytes of the 8-bit data
  char* k_scales;     // per token and head: [rows, H, S] float32 of K, and of V; else null
  char* v_scales;
  const char* saved;  // [2H, T, D] in `input`
  int32_t tokens;     // T
  Format input, format;
};

struct QuantPrefix {
  QuantPrefixLayer layers[kMaxLayers];
  int64_t first_vector[kMaxLayers + 1];  // vectors of layer l: [first_vector[l], first_vector[l + 1])
  const int32_t* slots;                  // [num_slots]
  const float* given;                    // per tensor: [2, num_layers], K's then V's; else null
  int32_t num_slots, rows, num_layers;
};
static_assert(sizeof(QuantPrefix) <= 32764, "kernel parameters are limited to 32764 bytes");

// Vector i of layer `layer` (token fastest, then K/V head, then slot): where it comes from and
// goes; false for a slot outside [0, rows), which is skipped.
JAXKV_HD bool quant_prefix_target(const QuantPrefix& p, int layer, int64_t i, QuantTarget* t) {
  const QuantPrefixLayer& l = p.layers[layer];
  int32_t tok, hh, s;  // hh: K heads, then V heads
  if (i <= INT32_MAX) {  // 32-bit divisions where the index fits (a 64-bit one is long on a GPU)
    const uint32_t j = static_cast<uint32_t>(i), tokens = static_cast<uint32_t>(l.tokens);
    const uint32_t q = j / tokens, heads = static_cast<uint32_t>(l.cache.heads);
    tok = static_cast<int32_t>(j - q * tokens);
    hh = static_cast<int32_t>(q % heads);
    s = static_cast<int32_t>(q / heads);
  } else {
    tok = static_cast<int32_t>(i % l.tokens);
    i /= l.tokens;
    hh = static_cast<int32_t>(i % l.cache.heads);
    s = static_cast<int32_t>(i / l.cache.heads);
  }
  const int32_t slot = p.slots[s];
  if (slot < 0 || slot >= p.rows) return false;
  const int32_t head_dim = l.cache.token_bytes, heads = l.cache.heads / 2;
  const bool is_v = hh >= heads;
  t->src = l.saved + (int64_t{hh} * l.tokens + tok) * head_dim * format_bytes(l.input);
  t->dst = l.cache.base + slot * l.cache.row_stride + hh * l.cache.head_stride +
           int64_t{tok} * head_dim;
  if (p.given) {
    t->scale = nullptr;
    t->given = p.given[(is_v ? p.num_layers : 0) + layer];
  } else {
    const int64_t at = (int64_t{slot} * heads + hh % heads) * l.cache.capacity + tok;
    t->scale = reinterpret_cast<float*>(is_v ? l.v_scales : l.k_scales) + at;
    t->given = 0.f;
  }
  return true;
}

// Builds the problem. Args: the given scales ([2, n] per tensor, [0] per token), the n saved
// prefixes, then the cache buffers; rets: the cache's data buffers (n layers described), then
// per token its K scale buffers and its V scale buffers (n layers each), aliased to the args.
template <class Args, class Rets>
ffi::Error describe_quant_prefix(ffi::Buffer<ffi::S32>& slots, ffi::Buffer<ffi::F32>& given,
                                 const Args& args, const Rets& rets, int64_t rows, QuantPrefix* p) {
  constexpr const char* op = "quantize_prefix";
  auto ret = [&](size_t i) -> ffi::ErrorOr<ffi::AnyBuffer> {
    auto r = rets.template get<ffi::AnyBuffer>(i);
    if (r.has_error()) return ffi::Unexpected(r.error());
    return **r;
  };
  const bool per_token = given.element_count() == 0;
  // Data buffers, then (per token) as many K and V scale buffers: count the data buffers by
  // their layers against the saved prefixes (args minus the cache buffers).
  if (args.size() < rets.size()) return invalid(op, "missing arguments");
  const size_t num_saved = args.size() - rets.size();
  LayerSpan data[kMaxLayers], k_scales[kMaxLayers], v_scales[kMaxLayers];
  const size_t data_buffers = per_token ? rets.size() / 3 : rets.size();
  if (per_token && data_buffers * 3 != rets.size())
    return invalid(op, "one K and one V scale buffer per data buffer expected");
  auto n = describe_layers(op, ret, data_buffers, true, rows, data);
  if (n.has_error()) return n.error();
  if (static_cast<size_t>(*n) != num_saved || *n == 0)
    return invalid(op, "one saved prefix per layer expected");
  if (!per_token && static_cast<int64_t>(given.element_count()) != 2 * *n)
    return invalid(op, "per-tensor scales must be [2, num_layers]");
  if (per_token) {  // K's scale buffers, then V's: each as many layers as the data (<= 256)
    for (int kv = 0; kv < 2; ++kv) {
      auto from = [&](size_t i) { return ret((1 + kv) * data_buffers + i); };
      for (size_t b = 0; b < data_buffers; ++b) {
        auto x = from(b);
        if (x.has_error()) return x.error();
        if (x->element_type() != ffi::DataType::F32) return invalid(op, "scales must be float32");
      }
      auto m = describe_layers(op, from, data_buffers, true, rows, kv ? v_scales : k_scales);
      if (m.has_error()) return m.error();
      if (*m != *n) return invalid(op, "scale layers do not match the data layers");
    }
  }
  Format format = Format::kS8;
  for (size_t b = 0; b < data_buffers; ++b) {  // every data buffer holds the cache's one dtype
    auto out = ret(b);
    if (out.has_error()) return out.error();
    Format f;
    if (!format_of(out->element_type(), &f) || f < Format::kE4M3 || (b && f != format))
      return invalid(op, "the cache must be float8_e4m3fn, float8_e5m2 or int8");
    format = f;
  }
  for (int i = 0; i < *n; ++i) {
    auto s = args.template get<ffi::AnyBuffer>(i);
    if (s.has_error()) return s.error();
    auto d = s->dimensions();
    const LayerSpan& c = data[i];
    QuantPrefixLayer& l = p->layers[i];
    if (!format_of(s->element_type(), &l.input) || l.input > Format::kF16)
      return invalid(op, "saved prefixes must be float32, bfloat16 or float16");
    l.format = format;
    if (d.size() != 4 || d[0] != 2 || 2 * d[1] != c.heads || d[3] != c.token_bytes ||
        d[2] > c.capacity || c.token_bytes > 256)
      return invalid(op, "saved prefix " + std::to_string(i) + " does not fit its layer");
    l.cache = c;
    l.saved = static_cast<const char*>(s->untyped_data());
    l.tokens = static_cast<int32_t>(d[2]);
    l.k_scales = l.v_scales = nullptr;
    if (per_token) {
      const LayerSpan& ks = k_scales[i];
      const LayerSpan& vs = v_scales[i];
      for (const LayerSpan* x : {&ks, &vs})
        if (x->heads != c.heads / 2 || x->capacity != c.capacity || x->token_bytes != 4 ||
            x->row_stride != int64_t{x->heads} * c.capacity * 4)
          return invalid(op, "scale layer " + std::to_string(i) + " does not fit its layer");
      l.k_scales = ks.base;
      l.v_scales = vs.base;
    }
  }
  p->num_layers = *n;
  p->rows = static_cast<int32_t>(rows);
  p->slots = slots.typed_data();
  p->num_slots = static_cast<int32_t>(slots.element_count());
  p->given = per_token ? nullptr : given.typed_data();
  p->first_vector[0] = 0;
  for (int i = 0; i < *n; ++i)
    p->first_vector[i + 1] = p->first_vector[i] + int64_t{p->num_slots} * p->layers[i].cache.heads *
                                                      p->layers[i].tokens;
  return ffi::Error::Success();
}

// Binding of "jaxkv_quantize_prefix" after the platform's context arguments.
template <class Binding>
auto bind_quantize_prefix(Binding b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()  // slots [] or [n]: cache rows written
      .template Arg<ffi::Buffer<ffi::F32>>()  // per tensor: [2, L] K then V scales; per token: [0]
      .RemainingArgs()                        // saved [2, H, T, D] each, then the cache buffers
      .RemainingRets()                        // data buffers, then K and V scale buffers
      .template Attr<int64_t>("rows");        // max_batch of every cache buffer
}

}  // namespace jaxkv
