// Prompt KV reuse, shared by the CPU and CUDA handlers: copying the first T tokens of cache rows
// to or from saved tensors, every layer in one call.
//
// A cache layer is [rows, 2, H, S, D] (or a stack of them); its saved prefix is [2, H, T, D]. The
// per-token scales of an 8-bit cache, [rows, H, S], are layers too; their saved prefix is [H, T]. For
// each (layer, slot, K/V head) the copy is one contiguous run of T * token_bytes bytes on both
// sides, so the whole op is a set of spans. save reads one slot into fresh saved tensors;
// instantiate writes the same saved tensors into every slot of a list. Slots outside [0, rows)
// are never dereferenced: instantiate skips them, save fills the saved tensors with zeros.
#pragma once

#include <numeric>
#include <utility>

#include "jaxkv/layers.h"

namespace jaxkv {

struct PrefixLayer {
  LayerSpan cache;     // [rows, 2H, S, token_bytes]
  char* saved;         // [2H, T, token_bytes]
  int64_t span_bytes;  // T * token_bytes: one head's run, the same on both sides
  int32_t width;       // access width (bytes) that divides every offset and size of this layer
};

// One run to copy; src == nullptr means "fill dst with zeros" (save from an invalid slot).
struct PrefixSpan {
  const char* src;
  char* dst;
  int64_t bytes;
};

JAXKV_HD PrefixSpan prefix_span(const PrefixLayer& l, int32_t slot, int32_t rows, bool to_cache,
                                int64_t head) {
  const bool valid = slot >= 0 && slot < rows;
  char* saved = l.saved + head * l.span_bytes;
  if (!valid) {
    return to_cache ? PrefixSpan{nullptr, nullptr, 0} : PrefixSpan{nullptr, saved, l.span_bytes};
  }
  char* cache = l.cache.base + slot * l.cache.row_stride + head * l.cache.head_stride;
  return to_cache ? PrefixSpan{saved, cache, l.span_bytes} : PrefixSpan{cache, saved, l.span_bytes};
}

// Binding of the "jaxkv_copy_prefix" target after the platform's context arguments.
// save (to_cache = false): args are the cache buffers, rets the saved tensors (fresh).
// instantiate (to_cache = true): args are the saved tensors then the cache buffers, rets the cache
// buffers (aliased to the inputs).
template <class Binding>
auto bind_copy_prefix(Binding b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()  // slots [] or [n]: cache rows read / written
      .RemainingArgs()                        // save: layers; instantiate: saved..., layers...
      .RemainingRets()                        // save: saved [2, H, T, D] each; instantiate: layers
      .template Attr<bool>("to_cache")        // true: instantiate, false: save
      .template Attr<int64_t>("rows");        // max_batch of every cache buffer
}

struct PrefixArgs {
  int num_layers;
  const int32_t* slots;
  int32_t num_slots;
};

// Describes every (cache layer, saved tensor) pair and checks that each saved tensor fits its
// layer (Python validated this; a last line of defence, since a handler must not fail after
// donation).
template <class Args, class Rets>
ffi::ErrorOr<PrefixArgs> describe_prefix(ffi::Buffer<ffi::S32>& slots, const Args& args,
                                         const Rets& rets, bool to_cache, int64_t rows,
                                         PrefixLayer* out) {
  constexpr const char* op = "copy_prefix";
  auto arg = [&](size_t i) -> ffi::ErrorOr<ffi::AnyBuffer> {
    return args.template get<ffi::AnyBuffer>(i);
  };
  auto ret = [&](size_t i) -> ffi::ErrorOr<ffi::AnyBuffer> {
    auto r = rets.template get<ffi::AnyBuffer>(i);
    if (r.has_error()) return ffi::Unexpected(r.error());
    return **r;
  };
  if (to_cache && args.size() < rets.size())
    return ffi::Unexpected(invalid(op, "missing arguments"));
  const size_t num_caches = to_cache ? rets.size() : args.size();
  const size_t num_saved = to_cache ? args.size() - rets.size() : rets.size();
  LayerSpan spans[kMaxLayers];
  auto caches = [&](size_t i) { return to_cache ? ret(i) : arg(i); };
  auto num = describe_layers(op, caches, num_caches, true, rows, spans);
  if (num.has_error()) return ffi::Unexpected(num.error());
  if (static_cast<size_t>(*num) != num_saved)
    return ffi::Unexpected(invalid(op, "one saved tensor per layer expected"));
  for (int i = 0; i < *num; ++i) {
    auto s = to_cache ? arg(i) : ret(i);
    if (s.has_error()) return ffi::Unexpected(s.error());
    auto elem = element_bytes(s->element_type(), op);
    if (elem.has_error()) return ffi::Unexpected(elem.error());
    auto d = s->dimensions();
    const LayerSpan& c = spans[i];
    // A KV layer's saved prefix is [2, H, T, D]; its scales' is [H, T].
    const bool kv = d.size() == 4;
    const int64_t heads = kv ? 2 * d[1] : (d.size() == 2 ? d[0] : -1);
    const int64_t tokens = kv ? d[2] : d[d.size() - 1];
    const int64_t token_bytes = kv ? d[3] * *elem : *elem;
    if ((kv && d[0] != 2) || heads != c.heads || token_bytes != c.token_bytes ||
        tokens > c.capacity)
      return ffi::Unexpected(
          invalid(op, "saved tensor " + std::to_string(i) + " does not fit its layer"));
    PrefixLayer& l = out[i];
    l.cache = c;
    l.saved = static_cast<char*>(s->untyped_data());
    l.span_bytes = tokens * c.token_bytes;
    l.width = vector_width(std::gcd(c.head_stride, l.span_bytes));
  }
  return PrefixArgs{*num, slots.typed_data(), static_cast<int32_t>(slots.element_count())};
}

}  // namespace jaxkv
