// The one nanobind module: hands the registered FFI handlers to Python.
#include <nanobind/nanobind.h>

#include "jaxkv/attention.h"
#include "jaxkv/registry.h"

namespace nb = nanobind;

NB_MODULE(_jaxkv, m) {
  m.doc() = "jaxkv XLA FFI handlers";
  // {platform: {target name: PyCapsule of the handler}}
  m.def("registrations", []() {
    nb::dict by_platform;
    for (const jaxkv::Target& t : jaxkv::targets()) {
      if (!by_platform.contains(t.platform)) by_platform[t.platform] = nb::dict();
      nb::dict d = by_platform[t.platform];
      d[t.name] = nb::capsule(reinterpret_cast<void*>(t.handler));
    }
    return by_platform;
  });
  // The FFI API minor version of the headers it was built against (0.N): jaxkv/_ffi.py refuses
  // to register handlers newer than the running jaxlib, which would take the backend down.
  m.attr("ffi_api_minor") = JAXKV_FFI_API_MINOR;
#ifdef JAXKV_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  // Whether Hopper's own kernels (sm_90a: the wgmma prefill) were built: jaxkv/attention.py
  // picks the default prefill by it.
#ifdef JAXKV_SM90A
  m.attr("with_sm90a") = true;
#else
  m.attr("with_sm90a") = false;
#endif
  // The decode kernel's blocks a multiprocessor, for the split rule of jaxkv/attention.py.
  m.attr("decode_resident_blocks") = jaxkv::kDecodeResidentBlocks;
}
