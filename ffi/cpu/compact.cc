// CPU handler of the compaction family: compact_tensor_batch and compact_kv_cache.
#include <algorithm>
#include <cstring>
#include <vector>

#include "jaxkv/compact.h"
#include "jaxkv/move_schedule.h"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

constexpr int64_t kChunkBytes = 16 * 1024;  // carried through a chain at a time; fits L1

struct Chunk {
  const char* data;
  int64_t live;  // bytes of this chunk that are live tokens of the row it came from
};

void move_layer(const MoveSchedule& s, const LayerSpan& l, const int32_t* lengths) {
  const int64_t span = l.head_stride;
  auto live_bytes = [&](int32_t row) -> int64_t {
    if (!lengths) return span;
    const int64_t len = std::clamp<int64_t>(lengths[row], 0, l.capacity);
    return len * l.token_bytes;
  };
  alignas(64) static thread_local char carry[2][kChunkBytes];
  for (int32_t h = 0; h < l.heads; ++h) {
    for (int64_t c0 = 0; c0 < span; c0 += kChunkBytes) {
      const int64_t width = std::min(kChunkBytes, span - c0);
      auto at = [&](int32_t row) { return l.base + row * l.row_stride + h * l.head_stride + c0; };
      for (int32_t k = 0; k < *s.num_starts; ++k) {
        int next = 0;
        auto load = [&](int32_t row) {
          const int64_t n = std::clamp<int64_t>(live_bytes(row) - c0, 0, width);
          char* buf = carry[next];
          next ^= 1;
          std::memcpy(buf, at(row), n);
          return Chunk{buf, n};
        };
        auto store = [&](int32_t row, Chunk v, int32_t) { std::memcpy(at(row), v.data, v.live); };
        walk_moves<Chunk>(s, s.starts[k], load, store);
      }
    }
  }
}

ffi::Error compact_cpu(ffi::Buffer<ffi::S32> mapping, ffi::Buffer<ffi::S32> lengths,
                       ffi::RemainingArgs, ffi::Result<ffi::Buffer<ffi::S32>> new_lengths,
                       ffi::RemainingRets layers, bool kv, int64_t rows) {
  std::vector<LayerSpan> spans(kMaxLayers);
  auto args = check_compact(mapping, lengths, new_lengths, layers, kv, rows, spans.data());
  if (args.has_error()) return args.error();
  const int32_t n_old = args->n_old;

  std::vector<int32_t> claim(rows), target(n_old), starts(n_old);
  std::vector<uint8_t> visited(n_old);
  int32_t num_starts = 0;
  MoveSchedule s{mapping.typed_data(), n_old, static_cast<int32_t>(rows), claim.data(),
                 target.data(), starts.data(), &num_starts};
  build_schedule(
      s, visited.data(), 0, 1, [] {}, [](int32_t* p, int32_t v) { *p = std::min(*p, v); },
      [&](int32_t r) { starts[num_starts++] = r; });

  const int32_t* len = args->has_lengths ? lengths.typed_data() : nullptr;
  for (int l = 0; l < args->num_layers; ++l) move_layer(s, spans[l], len);
  if (len) {
    for (int32_t r = 0; r < rows; ++r) new_lengths->typed_data()[r] = schedule_new_length(s, len, r);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxkv_compact_cpu, NoThrow<compact_cpu>::call, bind_compact(ffi::Ffi::Bind()));
JAXKV_REGISTER_TARGET("jaxkv_compact", "cpu", jaxkv_compact_cpu);

}  // namespace jaxkv
