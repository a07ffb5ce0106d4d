// Division by a scale's reciprocal, exactly as the division rounds: the quantizing kernels'
// quotients (quantize.cu) and the check of every float that they hold
// (tools/scale_quotient_check.cu). Device code only, no FFI.
#pragma once

namespace jaxkv {

// x / s rounded to nearest even, from r, s's reciprocal refined as div.rn.f32 refines it (one
// Newton step from the hardware's approximation): the quotient and one correction by the exact
// residual, which is the compiler's own fast path of the division, without its per-value range
// check (FCHK) and branch. The caller takes this path for a vector's own scale in [2^-64, 2^64]
// only, so |x| / s <= QMAX and the check could only fail for quotients below 2^-62, which every
// format stores as a signed zero. The residual is taken as q s - x and subtracted, not x - q s
// added: the same value, but a zero x keeps its sign (-0 / s is -0, where -0 + (+0) is +0),
// without a copysign a value. A scale given per tensor bounds nothing (x / s may overflow,
// which the residual would turn into NaN): it divides.
constexpr float kQuotientMin = 0x1p-64f, kQuotientMax = 0x1p64f;  // the scales it takes
__device__ __forceinline__ float reciprocal(float s) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
  return __fmaf_rn(r, __fmaf_rn(r, -s, 1.f), r);
}
__device__ __forceinline__ float quotient(float x, float s, float r) {
  const float q = __fmul_rn(x, r);
  return __fmaf_rn(-r, __fmaf_rn(q, s, -x), q);
}

// max |x| / qmax (448, 57344 or 127) by the same quotient, from qmax's reciprocal rounded at
// compile time: the division's own fast path without its range check (FCHK) and branch. Equal
// to the division wherever the result lies in [kQuotientMin, kQuotientMax], which
// tools/scale_quotient_check.cu checks for every float; callers divide wherever it does not.
template <int kQmax>
__device__ __forceinline__ float scale_quotient(float amax) {
  constexpr float q = static_cast<float>(kQmax);
  return quotient(amax, q, 1.f / q);
}

}  // namespace jaxkv
