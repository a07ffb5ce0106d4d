// CUDA handlers of decode and prefill attention: the problem checked, then the tensor-core prefill
// (attention_prefill_wgmma.cu on Hopper, else attention_prefill.cu) where it applies, else the
// split-KV kernels (attention_decode.cu).
#include "attention_device.cuh"
#include "jaxkv/registry.h"

namespace jaxkv {
namespace {

template <bool kPrefill>
ffi::Error attention_cuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> starts,
                          ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                          ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales,
                          ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::F32> sinks,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> work,
                          float scale, float soft_cap, int32_t span, int32_t layout) {
  auto p = make_attention("attention", q, k, v, table, starts, counts, layer, k_scale, v_scale,
                          k_scales, v_scales, window, sinks, out, scale, soft_cap, span, layout);
  if (p.has_error()) return p.error();
  if (p->batch == 0 || p->tokens == 0 || p->q_heads == 0) return ffi::Error::Success();
  auto wd = work->dimensions();
  int splits = 1;
  if (wd.size() == 5) {
    splits = static_cast<int>(wd[3]);
    if (wd[0] != p->batch || wd[1] != p->tokens || wd[2] != p->q_heads || wd[4] != p->head_dim + 2)
      return invalid("attention", "workspace must be [B, T, Hq, splits, D + 2]");
  }
  // The split-KV grid's x: rows x KV heads x head blocks, at most rows x q heads.
  if (splits < 1 || splits > 65535 || int64_t{p->batch} * p->tokens * p->q_heads > 0x7fffffff)
    return invalid("attention", "too many query rows, heads or splits for one launch");
  float* w = work->typed_data();
  // The wgmma prefill's words (the split-KV kernels' workspace, when there is one, holds them).
  const auto words = static_cast<int64_t>(work->element_count());
  if (words >= 1) p->item_counter = reinterpret_cast<int*>(w);
  if (words >= 1 + int64_t{p->batch} * p->kv.heads) p->v_maxima = w + 1;
  if (kPrefill) {
    ffi::Error status = ffi::Error::Success();
    if (launch_prefill_tc(stream, *p, &status)) return status;
  }
  return launch_split_kv(stream, *p, splits, w);
}

}  // namespace

// Decode: the split-KV kernels. Prefill: the tensor-core kernel where it applies (a bf16 / f16 q
// over its dtype or an 8-bit cache, head dims 64, 128, 256, groups up to its row tile), else the
// split-KV kernels, a query row per token.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxkv_attention_decode_cuda, NoThrow<attention_cuda<false>>::call,
    bind_attention(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JAXKV_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxkv_attention_prefill_cuda, NoThrow<attention_cuda<true>>::call,
    bind_attention(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()), JAXKV_CUDA_TRAITS);
JAXKV_REGISTER_TARGET("jaxkv_attention_decode", "CUDA", jaxkv_attention_decode_cuda);
JAXKV_REGISTER_TARGET("jaxkv_attention_prefill", "CUDA", jaxkv_attention_prefill_cuda);

}  // namespace jaxkv

