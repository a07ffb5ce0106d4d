// Page transfers between the device pools and the host pool on CPU, where both are ordinary
// memory: the same view as the CUDA handlers, one memcpy per run, and nothing to overlap.
#include <cstring>

#include "jaxkv/host_pages.h"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

ffi::Error transfer(const ffi::ErrorOr<HostTransfer>& t) {
  if (t.has_error()) return t.error();
  int64_t n = t->pairs;
  while (n > 0 && !t->live(n - 1)) --n;  // the padding after the last live pair
  for (int64_t u = 0; u < t->units_of(n); ++u) {
    char *device, *host;
    if (!t->unit(u, &device, &host)) continue;
    if (t->to_host) std::memcpy(host, device, t->inner_bytes);
    else std::memcpy(device, host, t->inner_bytes);
  }
  return ffi::Error::Success();
}

ffi::Error pages_to_host_cpu(ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                             ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer,
                             ffi::Result<ffi::AnyBuffer> host, int64_t axis, bool) {
  return transfer(make_host_transfer("pages_to_host", src, dst, k, v, *host, axis, true));
}

ffi::Error pages_from_host_cpu(ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                               ffi::AnyBuffer host, ffi::AnyBuffer, ffi::AnyBuffer,
                               ffi::Result<ffi::AnyBuffer> k, ffi::Result<ffi::AnyBuffer> v,
                               int64_t axis, bool) {
  return transfer(make_host_transfer("pages_from_host", src, dst, *k, *v, host, axis, false));
}

// Transfers are done when they return: the fence only passes its operands through.
ffi::Error host_fence_cpu(ffi::RemainingArgs, ffi::RemainingRets) {
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_pages_to_host_cpu, NoThrow<pages_to_host_cpu>::call,
                              bind_pages_to_host(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_pages_from_host_cpu, NoThrow<pages_from_host_cpu>::call,
                              bind_pages_from_host(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_host_fence_cpu, NoThrow<host_fence_cpu>::call,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());
JAXKV_REGISTER_TARGET("jaxkv_pages_to_host", "cpu", jaxkv_pages_to_host_cpu);
JAXKV_REGISTER_TARGET("jaxkv_pages_from_host", "cpu", jaxkv_pages_from_host_cpu);
JAXKV_REGISTER_TARGET("jaxkv_host_fence", "cpu", jaxkv_host_fence_cpu);

}  // namespace jaxkv
