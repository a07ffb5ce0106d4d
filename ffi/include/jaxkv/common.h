// Small pieces every handler uses: host/device qualifiers, the one dtype switch, error helpers.
#pragma once

#include <cstdint>
#include <exception>
#include <new>
#include <string>

#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#define JAXKV_HD __host__ __device__ __forceinline__
#else
#define JAXKV_HD inline
#endif

namespace jaxkv {

namespace ffi = xla::ffi;

// Kernels move bytes; the only thing they need from the dtype is its width. This is the one place
// that decides which dtypes are accepted.
inline ffi::ErrorOr<int64_t> element_bytes(ffi::DataType dtype, const char* op) {
  switch (dtype) {
    case ffi::DataType::F32:
    case ffi::DataType::S32:
    case ffi::DataType::U32:
      return int64_t{4};
    case ffi::DataType::BF16:
    case ffi::DataType::F16:
    case ffi::DataType::S16:
    case ffi::DataType::U16:
      return int64_t{2};
    case ffi::DataType::F8E4M3FN:
    case ffi::DataType::F8E5M2:
    case ffi::DataType::S8:
    case ffi::DataType::U8:
      return int64_t{1};
    default:
      return ffi::Unexpected(ffi::Error::InvalidArgument(
          std::string(op) + ": unsupported dtype " + std::to_string(static_cast<int>(dtype))));
  }
}

// n / d by a multiply-high, an add and a shift, for a divisor fixed at launch (d >= 1, n < 2^31):
// a runtime 32-bit division is a ~20-instruction sequence on a GPU, in loops that move 16 bytes.
struct FastDiv {
  uint32_t d = 1, mul = 1, shift = 0;
  FastDiv() = default;
  explicit FastDiv(uint32_t divisor) : d(divisor > 0 ? divisor : 1) {
    while ((uint64_t{1} << shift) < d) ++shift;  // ceil(log2 d)
    mul = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }
  JAXKV_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, mul);
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t{n} * mul) >> 32);
#endif
    return (hi + n) >> shift;
  }
};

inline ffi::Error invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// A handler with no exception crossing the FFI boundary (XLA's handler symbol has no try: an
// exception there is std::terminate): host memory running out in a handler's scratch, or any
// other exception, becomes an error of the call. Every handler is registered through it:
// XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, NoThrow<handler>::call, binding).
template <auto F>
struct NoThrow;
template <class... Args, ffi::Error (*F)(Args...)>
struct NoThrow<F> {
  static ffi::Error call(Args... args) noexcept {
    try {
      return F(args...);
    } catch (const std::bad_alloc&) {
      return ffi::Error::Internal("jaxkv: a handler ran out of host memory");
    } catch (const std::exception& e) {
      return ffi::Error::Internal(std::string("jaxkv: a handler failed: ") + e.what());
    } catch (...) {
      return ffi::Error::Internal("jaxkv: a handler failed");
    }
  }
};

// Largest access width (16, 8, 4, 2 or 1 bytes) that divides every given byte count, so that a
// kernel can use that width for whole tokens whatever the dtype and head_dim.
JAXKV_HD int vector_width(int64_t bytes) {
  int w = 16;
  while (w > 1 && (bytes % w) != 0) w >>= 1;
  return w;
}

}  // namespace jaxkv
