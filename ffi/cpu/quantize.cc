// CPU handlers of the quantizing appends (dense and paged): one vector at a time.
#include <cmath>

#include "jaxkv/quantize.h"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

void quantize_all(const QuantAppend& p) {
  for (int64_t i = 0; i < p.vectors(); ++i) {
    QuantTarget t;
    const VectorIndex at = vector_index(p, i);
    if (!quant_target(p, at, row_facts(p, at.b), &t)) continue;
    float s = t.given;
    if (t.scale) {
      float amax = 0.f;
      for (int32_t d = 0; d < p.head_dim; ++d) amax = fmaxf(amax, fabsf(load_float(t.src, d, p.input)));
      s = amax / format_max(p.format);
      *t.scale = s;
    }
    for (int32_t d = 0; d < p.head_dim; ++d)
      t.dst[d] = static_cast<char>(quantize_value(load_float(t.src, d, p.input), s, p.format));
  }
}

ffi::Error append_quantized_cpu(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                                ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> active,
                                ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer, ffi::AnyBuffer,
                                ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> cache,
                                ffi::Result<ffi::AnyBuffer> k_scales,
                                ffi::Result<ffi::AnyBuffer> v_scales, bool per_token) {
  auto p = make_quant_append("append_quantized", 0, k, v, nullptr, lengths, counts, &active, layer,
                             *cache, *cache, *k_scales, *v_scales, per_token);
  if (p.has_error()) return p.error();
  quantize_all(*p);
  return ffi::Error::Success();
}

ffi::Error paged_append_quantized_cpu(
    ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
    ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer, ffi::AnyBuffer,
    ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> k_pages,
    ffi::Result<ffi::AnyBuffer> v_pages, ffi::Result<ffi::AnyBuffer> k_scales,
    ffi::Result<ffi::AnyBuffer> v_scales, bool per_token, bool nhd) {
  auto p = make_quant_append("paged_append_quantized", nhd ? 2 : 1, k, v, &table, lengths, counts,
                             nullptr, layer, *k_pages, *v_pages, *k_scales, *v_scales, per_token);
  if (p.has_error()) return p.error();
  quantize_all(*p);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_append_quantized_cpu, append_quantized_cpu,
                              bind_append_quantized(ffi::Ffi::Bind()));
JAXKV_REGISTER_TARGET("jaxkv_append_quantized", "cpu", jaxkv_append_quantized_cpu);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_paged_append_quantized_cpu, paged_append_quantized_cpu,
                              bind_paged_append_quantized(ffi::Ffi::Bind()));
JAXKV_REGISTER_TARGET("jaxkv_paged_append_quantized", "cpu", jaxkv_paged_append_quantized_cpu);

}  // namespace jaxkv
