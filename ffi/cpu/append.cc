// CPU handler of the linear-cache append.
#include <cstring>

#include "jaxkv/append.h"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

ffi::Error append_cpu(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                      ffi::Buffer<ffi::S32> new_lengths, ffi::Buffer<ffi::S32> active,
                      ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer,
                      ffi::Result<ffi::AnyBuffer> cache, bool ring) {
  auto p = make_append_params(k, v, lengths, new_lengths, active, layer, cache, ring);
  if (p.has_error()) return p.error();
  for (int64_t i = 0; i < p->spans(); ++i) {
    const AppendSpan s = append_span(*p, i);
    if (s.bytes > 0) std::memcpy(s.dst, s.src, s.bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_append_cpu, NoThrow<append_cpu>::call, bind_append(ffi::Ffi::Bind()));
JAXKV_REGISTER_TARGET("jaxkv_append", "cpu", jaxkv_append_cpu);

}  // namespace jaxkv
