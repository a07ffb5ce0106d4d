// Static registration of XLA FFI handlers.
//
// Each op-family file registers its handlers with JAXKV_REGISTER_TARGET; module.cc exposes the
// collected table to Python, which registers every entry with jax.ffi.register_ffi_target. Adding an
// op therefore touches only its own files.
#pragma once

#include <vector>

#include "xla/ffi/api/c_api.h"

namespace jaxkv {

using HandlerFn = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);

struct Target {
  const char* name;      // FFI target name, e.g. "jaxkv_compact"
  const char* platform;  // "cpu" or "CUDA", as jax.ffi.register_ffi_target spells it
  HandlerFn handler;
};

inline std::vector<Target>& targets() {
  static std::vector<Target> table;
  return table;
}

struct Registrar {
  Registrar(const char* name, const char* platform, HandlerFn handler) {
    targets().push_back({name, platform, handler});
  }
};

}  // namespace jaxkv

#define JAXKV_CONCAT_INNER(a, b) a##b
#define JAXKV_CONCAT(a, b) JAXKV_CONCAT_INNER(a, b)
#define JAXKV_REGISTER_TARGET(name, platform, handler) \
  static ::jaxkv::Registrar JAXKV_CONCAT(jaxkv_registrar_, __LINE__)(name, platform, handler)
