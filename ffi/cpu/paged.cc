// CPU handlers of the paged cache: append, gather and copy_pages, token by token.
#include <cstring>

#include "jaxkv/paged.h"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

void move_tokens(const TokenMove& m) {
  const int64_t bytes = m.cache.token_bytes;
  const PagedView& c = m.cache;
  for (int64_t span = 0; span < m.spans(); ++span) {
    const SpanRef s = span_ref(m, span);
    for (int64_t t = 0; t < m.tokens; ++t) {
      TokenRef r;
      const TokenAction a = token_ref(m, s, t, &r);
      if (a == TokenAction::kZero) {
        std::memset(m.dense_k + r.dense, 0, bytes);
        std::memset(m.dense_v + r.dense, 0, bytes);
      } else if (a == TokenAction::kCopy && m.gather) {
        std::memcpy(m.dense_k + r.dense, c.k + r.paged, bytes);
        std::memcpy(m.dense_v + r.dense, c.v + r.paged, bytes);
      } else if (a == TokenAction::kCopy) {
        std::memcpy(c.k + r.paged, m.dense_k + r.dense, bytes);
        std::memcpy(c.v + r.paged, m.dense_v + r.dense, bytes);
      }
    }
  }
}

ffi::Error paged_append_cpu(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> table,
                            ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> counts,
                            ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer, ffi::AnyBuffer,
                            ffi::Result<ffi::AnyBuffer> k_pages,
                            ffi::Result<ffi::AnyBuffer> v_pages, bool nhd) {
  auto m = make_append(k, v, table, lengths, counts, layer, k_pages, v_pages, nhd);
  if (m.has_error()) return m.error();
  move_tokens(*m);
  return ffi::Error::Success();
}

ffi::Error paged_gather_cpu(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                            ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
                            ffi::Buffer<ffi::S32> layer, ffi::RemainingRets outs, bool nhd) {
  auto m = make_gather(k_pages, v_pages, table, lengths, layer, outs, nhd);
  if (m.has_error()) return m.error();
  move_tokens(*m);
  return ffi::Error::Success();
}

ffi::Error paged_copy_cpu(ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer,
                          ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> k_pages,
                          ffi::Result<ffi::AnyBuffer> v_pages, bool nhd) {
  auto p = make_copy(src, dst, k_pages, v_pages, nhd);
  if (p.has_error()) return p.error();
  const int64_t bytes = p->cache.run_bytes();
  for (int64_t u = 0; u < p->units(); ++u) {
    int64_t from, to;
    if (!p->unit(u, &from, &to)) continue;
    std::memcpy(p->cache.k + to, p->cache.k + from, bytes);
    std::memcpy(p->cache.v + to, p->cache.v + from, bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_paged_append_cpu, NoThrow<paged_append_cpu>::call,
                              bind_paged_append(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_paged_gather_cpu, NoThrow<paged_gather_cpu>::call,
                              bind_paged_gather(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_paged_copy_cpu, NoThrow<paged_copy_cpu>::call,
                              bind_paged_copy(ffi::Ffi::Bind()));
JAXKV_REGISTER_TARGET("jaxkv_paged_append", "cpu", jaxkv_paged_append_cpu);
JAXKV_REGISTER_TARGET("jaxkv_paged_gather", "cpu", jaxkv_paged_gather_cpu);
JAXKV_REGISTER_TARGET("jaxkv_paged_copy", "cpu", jaxkv_paged_copy_cpu);

}  // namespace jaxkv
