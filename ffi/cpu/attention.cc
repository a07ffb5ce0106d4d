// CPU handlers of decode and prefill attention: exact float32 arithmetic, one query at a time
// (scores of every key in its window, soft-capped where asked, then a max-subtracted softmax whose
// denominator takes the head's sink, then the weighted sum of V).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "jaxkv/attention.h"
#include "jaxkv/numerics.h"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

// Every value of a 16- or 8-bit format as float32, by load_float (so the same bits): index by
// the element's bits. Built once per format, on first use.
const float* decode_table(Format f) {
  auto build = [](Format f) {
    std::vector<float> t(f == Format::kF16 ? 65536 : 256);
    for (size_t i = 0; i < t.size(); ++i) {
      const uint16_t bits = static_cast<uint16_t>(i);
      char raw[2];
      std::memcpy(raw, &bits, 2);  // little-endian: byte 0 holds an 8-bit element
      t[i] = load_float(raw, 0, f);
    }
    return t;
  };
  static const std::vector<float> f16 = build(Format::kF16), e4m3 = build(Format::kE4M3),
                                   e5m2 = build(Format::kE5M2), s8 = build(Format::kS8);
  switch (f) {
    case Format::kF16: return f16.data();
    case Format::kE4M3: return e4m3.data();
    case Format::kE5M2: return e5m2.data();
    default: return s8.data();
  }
}

// load_row for a format known at compile time: load_float's switch folds away (a copy or a
// shift an element).
template <Format kF>
void load_row_of(const char* p, int64_t n, float scale, float* out) {
  for (int64_t d = 0; d < n; ++d) out[d] = load_float(p, d, kF) * scale;
}

// n contiguous elements of format f at p, as float32 times `scale` (each exactly load_float's
// value times it): the format decided once a row, not once an element.
void load_row(const char* p, Format f, int64_t n, float scale, float* out) {
  switch (f) {
    case Format::kF32: return load_row_of<Format::kF32>(p, n, scale, out);
    case Format::kBF16: return load_row_of<Format::kBF16>(p, n, scale, out);
    case Format::kF16: {
      const float* t = decode_table(f);
      for (int64_t d = 0; d < n; ++d) {
        uint16_t h;
        std::memcpy(&h, p + 2 * d, 2);
        out[d] = t[h] * scale;
      }
      return;
    }
    default: {
      const float* t = decode_table(f);
      for (int64_t d = 0; d < n; ++d) out[d] = t[static_cast<uint8_t>(p[d])] * scale;
    }
  }
}

// Round to nearest even, as XLA converts.
uint16_t to_bf16(float f) {
  const uint32_t b = float_bits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((b >> 16) | 0x40);
  return static_cast<uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

uint16_t to_f16(float f) {
  const uint32_t b = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000);
  if (std::isnan(f)) return sign | 0x7e00;
  const float a = std::fabs(f);
  if (a >= 65520.f) return sign | 0x7c00;  // rounds to infinity
  if (a < 6.103515625e-05f) {              // subnormal: a multiple of 2^-24, rounded to even
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.f));
  }
  const uint32_t ab = b & 0x7fffffff;
  const uint32_t rounded = ab + 0xfff + ((ab >> 13) & 1);
  return sign | static_cast<uint16_t>((rounded >> 13) - ((127 - 15) << 10));
}

void store(char* p, ffi::DataType t, float f) {
  if (t == ffi::DataType::F32) {
    std::memcpy(p, &f, 4);
  } else {
    const uint16_t h = t == ffi::DataType::BF16 ? to_bf16(f) : to_f16(f);
    std::memcpy(p, &h, 2);
  }
}

// Row b, KV head kvh: its live keys and values are converted to float once (dequantized by their
// scales, an 8-bit cache's), then every query of the row and every q head of the group reads them.
void attend(const AttentionProblem& p) {
  const int64_t qe = p.q_type == ffi::DataType::F32 ? 4 : 2;
  Format kf, qf;
  format_of(p.kv_type, &kf);  // make_attention accepts only formats format_of knows
  format_of(p.q_type, &qf);
  const KVView& sc = p.scales;
  const KVView& c = p.kv;
  const bool layer_ok = p.layer_ok();
  const float k_scale = *p.k_scale, v_scale = *p.v_scale;
  const int64_t D = p.head_dim;
  const int32_t window = *p.window;
  std::vector<float> q(D), acc(D), keys, values, scores;
  std::vector<char> present;
  for (int32_t b = 0; b < p.batch; ++b) {
    // The keys any query of the row sees: [least, most), never a position outside its windows.
    int32_t most = 0, least = INT32_MAX;
    for (int32_t t = 0; t < p.tokens && layer_ok; ++t) {
      if (p.first_key(b, t, window) == p.keys(b, t)) continue;
      most = std::max(most, p.keys(b, t));
      least = std::min(least, p.first_key(b, t, window));
    }
    for (int32_t kvh = 0; kvh < c.heads; ++kvh) {
      keys.assign(most * D, 0.f);
      values.assign(most * D, 0.f);
      present.assign(most, 0);
      for (int32_t s = least; s < most; ++s) {
        const int64_t off = c.offset(*p.layer, b, kvh, s);
        if (off < 0) continue;  // no page: never read
        present[s] = 1;
        float ks = 1.f, vs = 1.f;
        if (sc.k) {
          const int64_t so = sc.offset(*p.layer, b, kvh, s);
          ks = sc.k_float(so), vs = sc.v_float(so);
        }
        load_row(c.k + off, kf, D, ks, &keys[s * D]);
        load_row(c.v + off, kf, D, vs, &values[s * D]);
      }
      for (int32_t t = 0; t < p.tokens; ++t) {
        const int32_t n = layer_ok ? p.keys(b, t) : 0;
        const int32_t first = layer_ok ? p.first_key(b, t, window) : 0;
        for (int32_t h = kvh * p.group; h < (kvh + 1) * p.group; ++h) {
          const int64_t qi = p.q_index(b, t, h);
          load_row(p.q + qi * qe, qf, D, 1.f, q.data());
          scores.assign(n, -INFINITY);
          float m = -INFINITY;
          for (int32_t s = first; s < n; ++s) {
            if (!present[s]) continue;
            float dot = 0.f;
            for (int64_t d = 0; d < D; ++d) dot += q[d] * keys[s * D + d];
            scores[s] = dot * k_scale * p.scale;
            if (p.soft_cap > 0.f) scores[s] = p.soft_cap * std::tanh(scores[s] / p.soft_cap);
            m = std::max(m, scores[s]);
          }
          std::fill(acc.begin(), acc.end(), 0.f);
          float sum = 0.f;
          for (int32_t s = first; s < n; ++s) {
            if (!present[s]) continue;
            const float w = std::exp(scores[s] - m);
            sum += w;
            for (int64_t d = 0; d < D; ++d) acc[d] += w * values[s * D + d];
          }
          // The sink joins the denominator, relative to the larger of it and the maximum.
          float norm = sum != 0.f ? v_scale / sum : 0.f;
          if (p.sinks != nullptr && sum != 0.f) {
            const float top = std::max(m, p.sinks[h]), a = std::exp(m - top);
            norm = v_scale * a / (sum * a + std::exp(p.sinks[h] - top));
          }
          for (int64_t d = 0; d < D; ++d) store(p.out + (qi + d) * qe, p.q_type, acc[d] * norm);
        }
      }
    }
  }
}

ffi::Error attention_cpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> starts,
                         ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                         ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales,
                         ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::F32> sinks,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>>,
                         float scale, float soft_cap, int32_t span, int32_t layout) {
  auto p = make_attention("attention", q, k, v, table, starts, counts, layer, k_scale, v_scale,
                          k_scales, v_scales, window, sinks, out, scale, soft_cap, span, layout);
  if (p.has_error()) return p.error();
  attend(*p);
  return ffi::Error::Success();
}

}  // namespace

// Decode and prefill are one problem on the CPU (the GPU splits their work differently).
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_attention_cpu, NoThrow<attention_cpu>::call, bind_attention(ffi::Ffi::Bind()));
JAXKV_REGISTER_TARGET("jaxkv_attention_decode", "cpu", jaxkv_attention_cpu);
JAXKV_REGISTER_TARGET("jaxkv_attention_prefill", "cpu", jaxkv_attention_cpu);

}  // namespace jaxkv
