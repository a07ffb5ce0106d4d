// Small pieces every handler uses: host/device qualifiers, the one dtype switch, error helpers.
#pragma once

#include <cstdint>
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

inline ffi::Error invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// Largest access width (16, 8, 4, 2 or 1 bytes) that divides every given byte count, so that a
// kernel can use that width for whole tokens whatever the dtype and head_dim.
JAXKV_HD int vector_width(int64_t bytes) {
  int w = 16;
  while (w > 1 && (bytes % w) != 0) w >>= 1;
  return w;
}

}  // namespace jaxkv
