// What the CPU and CUDA compaction handlers share: the binding and the argument checks.
#pragma once

#include <utility>

#include "jaxkv/layers.h"

namespace jaxkv {

// Most rows a compaction schedules; the schedule lives in GPU shared memory. Checked in Python.
constexpr int64_t kMaxCompactRows = 8192;

// Binding of the "jaxkv_compact" target after the platform's context arguments (none on CPU, the
// stream on CUDA).
template <class Binding>
auto bind_compact(Binding b) {
  return std::move(b).template Arg<ffi::Buffer<ffi::S32>>()  // batch_mapping [n_old]
      .template Arg<ffi::Buffer<ffi::S32>>()      // lengths [rows], or [0] when every byte is live
      .RemainingArgs()                            // layers (used through their aliases below)
      .template Ret<ffi::Buffer<ffi::S32>>()      // new lengths [rows], or [0]
      .RemainingRets()                            // layers, aliased to the inputs
      .template Attr<bool>("kv")                  // KV layers [rows, 2, H, S, D] / [L, rows, ...]
      .template Attr<int64_t>("rows");            // max_batch (rows of every buffer)
}

struct CompactArgs {
  int32_t n_old;
  int32_t rows;
  bool has_lengths;
  int num_layers;
};

// Checks what Python already validated (a handler must never fail after donation, so these are a
// last line of defence) and describes the layers.
inline ffi::ErrorOr<CompactArgs> check_compact(ffi::Buffer<ffi::S32>& mapping,
                                               ffi::Buffer<ffi::S32>& lengths,
                                               ffi::Result<ffi::Buffer<ffi::S32>>& new_lengths,
                                               ffi::RemainingRets& layers, bool kv, int64_t rows,
                                               LayerSpan* spans) {
  constexpr const char* op = "compact";
  CompactArgs a;
  a.n_old = static_cast<int32_t>(mapping.element_count());
  a.rows = static_cast<int32_t>(rows);
  a.has_lengths = lengths.element_count() > 0;
  if (rows > kMaxCompactRows) return ffi::Unexpected(invalid(op, "too many rows"));
  if (a.n_old > rows) return ffi::Unexpected(invalid(op, "batch_mapping is longer than the batch"));
  if (a.has_lengths && (static_cast<int64_t>(lengths.element_count()) != rows ||
                        static_cast<int64_t>(new_lengths->element_count()) != rows))
    return ffi::Unexpected(invalid(op, "lengths must have one entry per row"));
  auto get = [&](size_t i) -> ffi::ErrorOr<ffi::AnyBuffer> {
    auto r = layers.get<ffi::AnyBuffer>(i);
    if (r.has_error()) return ffi::Unexpected(r.error());
    return **r;
  };
  auto num = describe_layers(op, get, layers.size(), kv, rows, spans);
  if (num.has_error()) return ffi::Unexpected(num.error());
  a.num_layers = *num;
  return a;
}

}  // namespace jaxkv
