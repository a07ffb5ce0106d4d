// The compaction move schedule, shared by the CPU and CUDA handlers.
//
// A batch mapping sends old row i to new row mapping[i] (or -1: evicted). Moving rows in place for
// an arbitrary injective mapping means following each chain i -> mapping[i] -> mapping[mapping[i]]
// and each cycle, carrying one value at a time: read the next row before overwriting it. Every byte
// offset of a row is independent, so each thread (or CPU chunk) walks every chain for its own
// offsets: no scratch rows and no ordering between threads.
//
// Building the schedule is a few passes over the mapping; each pass is a per-element function so
// that the CPU runs it in a loop and the GPU runs it with one thread per element and a barrier
// between passes.
#pragma once

#include <cstdint>

#include "jaxkv/common.h"

namespace jaxkv {

constexpr int32_t kUnclaimed = INT32_MAX;

// Views of the schedule arrays; the storage belongs to the caller (stack, heap or shared memory).
struct MoveSchedule {
  const int32_t* mapping;  // [n_old] as given
  int32_t n_old;           // rows the mapping covers
  int32_t rows;            // rows in the buffer; valid targets are [0, rows)
  int32_t* claim;          // [rows] lowest old row that targets this row, or kUnclaimed
  int32_t* target;         // [n_old] sanitized target of each old row, -1 if evicted or a loser
  int32_t* starts;         // [n_old] rows where a chain or cycle walk begins
  int32_t* num_starts;     // [1]

  JAXKV_HD int32_t raw_target(int32_t i) const {
    const int32_t t = mapping[i];
    return (t >= 0 && t < rows) ? t : -1;  // out-of-range entries count as evicted
  }
  // A mover is a survivor that changes row.
  JAXKV_HD bool is_mover(int32_t i) const {
    return i < n_old && target[i] >= 0 && target[i] != i;
  }
};

// Pass 1, per row r < rows.
JAXKV_HD void schedule_clear(MoveSchedule& s, int32_t r) { s.claim[r] = kUnclaimed; }

// Pass 2, per old row i < n_old: claim the target row; the lowest old row wins a contested target.
// `atomic_min(int32_t*, int32_t)` is the platform's atomic minimum.
template <class AtomicMin>
JAXKV_HD void schedule_claim(MoveSchedule& s, int32_t i, AtomicMin atomic_min) {
  const int32_t t = s.raw_target(i);
  if (t >= 0) atomic_min(&s.claim[t], i);
}

// Pass 3, per old row i: keep the target only if this row won it.
JAXKV_HD void schedule_resolve(MoveSchedule& s, int32_t i) {
  const int32_t t = s.raw_target(i);
  s.target[i] = (t >= 0 && s.claim[t] == i) ? t : -1;
}

// Pass 4, per old row i: a mover whose row no other mover targets heads a chain.
// `push(int32_t)` appends to starts.
template <class Push>
JAXKV_HD void schedule_chain_heads(const MoveSchedule& s, int32_t i, Push push) {
  if (!s.is_mover(i)) return;
  const int32_t src = s.claim[i];
  const bool fed = src != kUnclaimed && s.is_mover(src);
  if (!fed) push(i);
}

// Pass 5, one thread: every mover not on a chain lies on a cycle; its smallest row starts it.
// `on_chain` marks rows reached from chain heads, computed here with `visited` scratch [n_old].
JAXKV_HD void schedule_cycles(MoveSchedule& s, uint8_t* visited) {
  for (int32_t i = 0; i < s.n_old; ++i) visited[i] = 0;
  const int32_t heads = *s.num_starts;
  for (int32_t k = 0; k < heads; ++k) {
    for (int32_t r = s.starts[k]; r < s.n_old && s.is_mover(r) && !visited[r]; r = s.target[r]) {
      visited[r] = 1;
    }
  }
  for (int32_t i = 0; i < s.n_old; ++i) {
    if (!s.is_mover(i) || visited[i]) continue;
    s.starts[(*s.num_starts)++] = i;
    for (int32_t r = i; !visited[r]; r = s.target[r]) visited[r] = 1;
  }
}

// Runs every pass: CPU with (tid 0, 1 thread, no-op barrier), a CUDA block with its threads and
// __syncthreads. The platform supplies its atomic minimum and atomic push onto `starts`.
template <class Barrier, class AtomicMin, class Push>
JAXKV_HD void build_schedule(MoveSchedule& s, uint8_t* visited, int tid, int nthreads,
                             Barrier barrier, AtomicMin atomic_min, Push push) {
  for (int32_t r = tid; r < s.rows; r += nthreads) schedule_clear(s, r);
  if (tid == 0) *s.num_starts = 0;
  barrier();
  for (int32_t i = tid; i < s.n_old; i += nthreads) schedule_claim(s, i, atomic_min);
  barrier();
  for (int32_t i = tid; i < s.n_old; i += nthreads) schedule_resolve(s, i);
  barrier();
  for (int32_t i = tid; i < s.n_old; i += nthreads) schedule_chain_heads(s, i, push);
  barrier();
  if (tid == 0) schedule_cycles(s, visited);
  barrier();
}

// New length of row r < rows: the length of the survivor that lands there, 0 if none does.
JAXKV_HD int32_t schedule_new_length(const MoveSchedule& s, const int32_t* lengths, int32_t r) {
  const int32_t src = s.claim[r];
  if (src == kUnclaimed || s.target[src] != r) return 0;
  return lengths[src];
}

// Walks the chain or cycle that begins at `start`, calling
//   load(row)               : read this row's value into a fresh register (returns it),
//   store(row, value, from) : write the value that came from row `from` into `row`.
// A chain ends at a row that is not a mover; a cycle ends where it began.
template <class Value, class Load, class Store>
JAXKV_HD void walk_moves(const MoveSchedule& s, int32_t start, Load load, Store store) {
  Value carry = load(start);
  int32_t from = start;
  int32_t row = s.target[start];
  while (true) {
    const bool more = row != start && s.is_mover(row);
    Value next{};
    if (more) next = load(row);
    store(row, carry, from);
    if (!more) break;
    carry = next;
    from = row;
    row = s.target[row];
  }
}

}  // namespace jaxkv
