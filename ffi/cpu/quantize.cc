// CPU handlers of the quantizing appends (dense and paged) and of the quantizing instantiate: one
// vector at a time.
#include <cmath>
#include <memory>

#include "jaxkv/quantize.h"
#include "jaxkv/quantize_prefix.h"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

void quantize_all(const QuantAppend& p) {
  for (int64_t i = 0; i < p.vectors(); ++i) {
    QuantTarget t;
    const VectorIndex at = vector_index(p, i);
    if (quant_target(p, at, row_facts(p, at.b), &t)) quantize_vector(t, p.head_dim, p.input, p.format);
  }
}

ffi::Error append_quantized_cpu(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                                ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> active,
                                ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer, ffi::AnyBuffer,
                                ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> cache,
                                ffi::Result<ffi::AnyBuffer> k_scales,
                                ffi::Result<ffi::AnyBuffer> v_scales, bool per_token,
                                bool ring) {
  const int32_t layout = static_cast<int32_t>(ring ? KVLayout::kDenseRing : KVLayout::kDense);
  auto p = make_quant_append("append_quantized", layout, k, v, nullptr, lengths, counts, &active,
                             layer, *cache, *cache, *k_scales, *v_scales, per_token);
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

ffi::Error quantize_prefix_cpu(ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> given,
                               ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t rows) {
  auto p = std::make_unique<QuantPrefix>();
  if (auto e = describe_quant_prefix(slots, given, args, rets, rows, p.get()); e.failure()) return e;
  for (int layer = 0; layer < p->num_layers; ++layer) {
    const QuantPrefixLayer& l = p->layers[layer];
    for (int64_t i = 0; i < p->first_vector[layer + 1] - p->first_vector[layer]; ++i) {
      QuantTarget t;
      if (quant_prefix_target(*p, layer, i, &t)) quantize_vector(t, l.cache.token_bytes, l.input, l.format);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_quantize_prefix_cpu, NoThrow<quantize_prefix_cpu>::call,
                              bind_quantize_prefix(ffi::Ffi::Bind()));
JAXKV_REGISTER_TARGET("jaxkv_quantize_prefix", "cpu", jaxkv_quantize_prefix_cpu);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_append_quantized_cpu, NoThrow<append_quantized_cpu>::call,
                              bind_append_quantized(ffi::Ffi::Bind()));
JAXKV_REGISTER_TARGET("jaxkv_append_quantized", "cpu", jaxkv_append_quantized_cpu);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_paged_append_quantized_cpu, NoThrow<paged_append_quantized_cpu>::call,
                              bind_paged_append_quantized(ffi::Ffi::Bind()));
JAXKV_REGISTER_TARGET("jaxkv_paged_append_quantized", "cpu", jaxkv_paged_append_quantized_cpu);

}  // namespace jaxkv
