// Page transfers between a paged cache's device pools and its host pool: the view both platforms'
// handlers of "jaxkv_pages_to_host" and "jaxkv_pages_from_host" share.
//
// A device pool has its page dimension at `axis`: [outer..., P, inner...]. A host page holds one
// page of K and then of V, every layer, contiguous: [2, outer..., inner...]. So pair i moves, for
// K and V and each of `outer` runs of `inner_bytes`, device run (o * P + src[i]) to host run
// ((dst[i] * 2 + kv) * outer + o) (or back). A pair naming a page out of range is skipped: the
// caller pads its pairs with such, so that their count stays on the device. The padding is the
// tail of the pairs (a call's static size, most of it unused in a small swap or an eviction's
// spill), so the handlers stop after the last live pair rather than test every unit past it.
#pragma once

#include <cstdint>

#include "jaxkv/common.h"

namespace jaxkv {

struct HostTransfer {
  char* k = nullptr;     // device pool of K
  char* v = nullptr;     // device pool of V
  char* host = nullptr;  // host pool (pinned host memory; unified addressing on a GPU)
  const int32_t* src = nullptr;
  const int32_t* dst = nullptr;
  int32_t pairs = 0;
  int64_t outer = 0;        // runs per page and pool: the dimensions before the page axis
  int64_t device_pages = 0;  // P
  int64_t host_pages = 0;
  int64_t inner_bytes = 0;  // one run
  bool to_host = true;

  JAXKV_HD int64_t units() const { return int64_t{pairs} * 2 * outer; }
  // The units of pairs [0, n).
  JAXKV_HD int64_t units_of(int64_t n) const { return n * 2 * outer; }

  // Does pair i name a page of each pool?
  JAXKV_HD bool live(int64_t i) const {
    const int64_t d = to_host ? src[i] : dst[i];
    const int64_t h = to_host ? dst[i] : src[i];
    return d >= 0 && d < device_pages && h >= 0 && h < host_pages;
  }

  // Unit u (pair, K or V, run): false when its pair names a page out of range; else the run's
  // device and host addresses.
  JAXKV_HD bool unit(int64_t u, char** device, char** host_run) const {
    const int64_t o = u % outer;
    const int64_t kv = (u / outer) % 2;
    const int64_t i = u / (2 * outer);
    if (!live(i)) return false;
    const int64_t d = to_host ? src[i] : dst[i];
    const int64_t h = to_host ? dst[i] : src[i];
    *device = (kv ? v : k) + (o * device_pages + d) * inner_bytes;
    *host_run = host + ((h * 2 + kv) * outer + o) * inner_bytes;
    return true;
  }
};

// Binding of "jaxkv_pages_to_host" after the platform's context arguments.
template <class Binding>
auto bind_pages_to_host(Binding b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()  // src: device pages [n]
      .template Arg<ffi::Buffer<ffi::S32>>()  // dst: host pages [n]
      .template Arg<ffi::AnyBuffer>()         // k_pool (device)
      .template Arg<ffi::AnyBuffer>()         // v_pool (device)
      .template Arg<ffi::AnyBuffer>()         // host pool (used through the alias)
      .template Ret<ffi::AnyBuffer>()         // host pool, aliased
      .template Attr<int64_t>("axis")         // the device pools' page axis
      .template Attr<bool>("overlap");        // on a side stream, beside compute (CUDA)
}

// Binding of "jaxkv_pages_from_host" after the platform's context arguments.
template <class Binding>
auto bind_pages_from_host(Binding b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()  // src: host pages [n]
      .template Arg<ffi::Buffer<ffi::S32>>()  // dst: device pages [n]
      .template Arg<ffi::AnyBuffer>()         // host pool
      .template Arg<ffi::AnyBuffer>()         // k_pool (used through the alias)
      .template Arg<ffi::AnyBuffer>()         // v_pool (used through the alias)
      .template Ret<ffi::AnyBuffer>()         // k_pool, aliased
      .template Ret<ffi::AnyBuffer>()         // v_pool, aliased
      .template Attr<int64_t>("axis")
      .template Attr<bool>("overlap");
}

// The transfer's view, its shapes checked: the pools agree with each other and the host pool is
// [N, 2, pool shape without its page axis] of the same dtype.
inline ffi::ErrorOr<HostTransfer> make_host_transfer(const char* op, ffi::Buffer<ffi::S32> src,
                                                     ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer k,
                                                     ffi::AnyBuffer v, ffi::AnyBuffer host,
                                                     int64_t axis, bool to_host) {
  if (src.element_count() != dst.element_count())
    return ffi::Unexpected(invalid(op, "src and dst differ in length"));
  if (k.element_type() != v.element_type() || k.element_type() != host.element_type())
    return ffi::Unexpected(invalid(op, "the pools' dtypes differ"));
  auto kd = k.dimensions(), vd = v.dimensions(), hd = host.dimensions();
  const int64_t rank = static_cast<int64_t>(kd.size());
  if (axis < 0 || axis >= rank) return ffi::Unexpected(invalid(op, "axis out of range"));
  if (vd.size() != kd.size() || static_cast<int64_t>(hd.size()) != rank + 1 || hd[1] != 2)
    return ffi::Unexpected(invalid(op, "pool ranks do not match"));
  auto elem = element_bytes(k.element_type(), op);
  if (elem.has_error()) return ffi::Unexpected(elem.error());
  HostTransfer t;
  t.outer = 1;
  t.inner_bytes = *elem;
  for (int64_t a = 0; a < rank; ++a) {
    if (kd[a] != vd[a]) return ffi::Unexpected(invalid(op, "K and V pools differ in shape"));
    if (a == axis) continue;
    if (hd[2 + a - (a > axis)] != kd[a])
      return ffi::Unexpected(invalid(op, "the host pool's page does not match the device pools'"));
    (a < axis ? t.outer : t.inner_bytes) *= kd[a];
  }
  t.k = static_cast<char*>(k.untyped_data());
  t.v = static_cast<char*>(v.untyped_data());
  t.host = static_cast<char*>(host.untyped_data());
  t.src = src.typed_data();
  t.dst = dst.typed_data();
  t.pairs = static_cast<int32_t>(src.element_count());
  t.device_pages = kd[axis];
  t.host_pages = hd[0];
  t.to_host = to_host;
  return t;
}

}  // namespace jaxkv
