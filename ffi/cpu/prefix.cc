// CPU handler of prompt KV reuse (save_kv_cache / instantiate_kv_cache): one memcpy per span.
#include <cstring>
#include <vector>

#include "jaxkv/prefix.h"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

ffi::Error copy_prefix_cpu(ffi::Buffer<ffi::S32> slots, ffi::RemainingArgs args,
                           ffi::RemainingRets rets, bool to_cache, int64_t rows) {
  std::vector<PrefixLayer> layers(kMaxLayers);
  auto a = describe_prefix(slots, args, rets, to_cache, rows, layers.data());
  if (a.has_error()) return a.error();
  for (int i = 0; i < a->num_layers; ++i) {
    const PrefixLayer& l = layers[i];
    for (int32_t k = 0; k < a->num_slots; ++k) {
      for (int64_t h = 0; h < l.cache.heads; ++h) {
        const PrefixSpan s = prefix_span(l, a->slots[k], static_cast<int32_t>(rows), to_cache, h);
        if (s.bytes == 0) continue;
        if (s.src) std::memcpy(s.dst, s.src, s.bytes);
        else std::memset(s.dst, 0, s.bytes);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_copy_prefix_cpu, NoThrow<copy_prefix_cpu>::call,
                              bind_copy_prefix(ffi::Ffi::Bind()));
JAXKV_REGISTER_TARGET("jaxkv_copy_prefix", "cpu", jaxkv_copy_prefix_cpu);

}  // namespace jaxkv
