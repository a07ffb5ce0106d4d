// Element conversions shared by the CPU and CUDA handlers: reading float32 / bfloat16 / float16
// inputs as float32, and the 8-bit cache formats both ways. Written once, in integer and float
// operations that are exact on both sides, so CPU and GPU quantize bit for bit alike (and like
// jaxkv.reference.quantize, which is XLA's rounding: to nearest, ties to even).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "jaxkv/common.h"

namespace jaxkv {

// A new format needs its case in every switch on Format: several end in a `default:` that is
// the last format of their list (int8 in load_float, encode, quantize.cu's with_format and
// cpu/attention.cc; float16 in with_formats), which is right only because format_of and the
// handlers' views refuse every other dtype first.
enum class Format : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kE4M3 = 3, kE5M2 = 4, kS8 = 5 };

inline bool format_of(ffi::DataType t, Format* f) {
  switch (t) {
    case ffi::DataType::F32: *f = Format::kF32; return true;
    case ffi::DataType::BF16: *f = Format::kBF16; return true;
    case ffi::DataType::F16: *f = Format::kF16; return true;
    case ffi::DataType::F8E4M3FN: *f = Format::kE4M3; return true;
    case ffi::DataType::F8E5M2: *f = Format::kE5M2; return true;
    case ffi::DataType::S8: *f = Format::kS8; return true;
    default: return false;
  }
}

JAXKV_HD int format_bytes(Format f) {
  return f == Format::kF32 ? 4 : (f == Format::kBF16 || f == Format::kF16) ? 2 : 1;
}

JAXKV_HD float bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, 4);
  return f;
#endif
}

JAXKV_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
#endif
}

// 2^e for the exponents used here (normal floats).
JAXKV_HD float pow2(int e) { return bits_float(static_cast<uint32_t>(127 + e) << 23); }

// A minifloat code (sign, `ebits` exponent, `mbits` mantissa, `bias`) as float32, exactly.
// ieee: the top exponent is inf / NaN (e5m2, f16); else only all-ones is NaN (e4m3fn).
JAXKV_HD float decode_minifloat(uint32_t x, int ebits, int mbits, int bias, bool ieee) {
  const uint32_t sign = (x >> (ebits + mbits)) & 1;
  const uint32_t e = (x >> mbits) & ((1u << ebits) - 1);
  const uint32_t m = x & ((1u << mbits) - 1);
  float v;
  if (ieee && e == (1u << ebits) - 1) {
    v = bits_float(m ? 0x7fc00000u : 0x7f800000u);
  } else if (!ieee && e == (1u << ebits) - 1 && m == (1u << mbits) - 1) {
    v = bits_float(0x7fc00000u);
  } else if (e == 0) {
    v = static_cast<float>(m) * pow2(1 - bias - mbits);
  } else {
    v = static_cast<float>(m | (1u << mbits)) * pow2(static_cast<int>(e) - bias - mbits);
  }
  return sign ? -v : v;
}

// Element i of an array of format f, as float32 (exact for every format).
JAXKV_HD float load_float(const char* base, int64_t i, Format f) {
  switch (f) {
    case Format::kF32: {
      float x;
      memcpy(&x, base + 4 * i, 4);
      return x;
    }
    case Format::kBF16: {
      uint16_t h;
      memcpy(&h, base + 2 * i, 2);
      return bits_float(uint32_t{h} << 16);
    }
    case Format::kF16: {
      uint16_t h;
      memcpy(&h, base + 2 * i, 2);
      return decode_minifloat(h, 5, 10, 15, true);
    }
    case Format::kE4M3: return decode_minifloat(static_cast<uint8_t>(base[i]), 4, 3, 7, false);
    case Format::kE5M2: return decode_minifloat(static_cast<uint8_t>(base[i]), 5, 2, 15, true);
    default: return static_cast<float>(static_cast<int8_t>(base[i]));
  }
}

// The largest magnitude of an 8-bit format: what a scale maps a vector's max |x| to.
JAXKV_HD constexpr float format_max(Format f) {
  return f == Format::kE4M3 ? 448.f : f == Format::kE5M2 ? 57344.f : 127.f;
}

// float32 -> minifloat code, rounded to nearest even; |v| must not exceed the format's max (the
// callers clip first), so no value rounds past it.
JAXKV_HD uint8_t encode_minifloat(float v, int mbits, int bias, uint8_t nan_code) {
  const uint32_t b = float_bits(v);
  const uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80);
  const float a = fabsf(v);
  if (a != a) return sign | nan_code;
  if (a == 0.f) return sign;
  const int min_exp = 1 - bias;
  const int e = static_cast<int>((b >> 23) & 0xff) - 127;
  int qe = e < min_exp ? min_exp : e;  // the exponent whose quantum the value is rounded to
  // a * 2^(mbits - qe) is exact (a power-of-two scaling of a float), then rounded: rintf is
  // round-to-nearest-even on both the host and the device.
  int m = static_cast<int>(rintf(a * pow2(mbits - qe)));
  if (e < min_exp) return sign | static_cast<uint8_t>(m);  // subnormal (m = 2^mbits: the least normal)
  if (m == (1 << (mbits + 1))) {  // rounded up to the next binade
    m >>= 1;
    ++qe;
  }
  return sign | static_cast<uint8_t>(((qe + bias) << mbits) | (m - (1 << mbits)));
}

// v (already divided by its scale) clipped to the format's range and rounded into it: the bits
// stored. NaN stays NaN for the float formats and becomes 0 for int8.
JAXKV_HD uint8_t encode(float v, Format f) {
  const float q = format_max(f);
  v = v < -q ? -q : (v > q ? q : v);  // comparisons: a NaN passes through, as jnp.clip keeps it
  switch (f) {
    case Format::kE4M3: return encode_minifloat(v, 3, 7, 0x7f);
    case Format::kE5M2: return encode_minifloat(v, 2, 15, 0x7e);
    default: return v != v ? 0 : static_cast<uint8_t>(static_cast<int8_t>(rintf(v)));
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// encode() of a pair holding a NaN, out of line: inlined, encode()'s software path (about 60
// instructions a pair) doubled the fp8 append kernels' code (2072 instructions against int8's
// 992), and each pair's common case jumped over it. (A template: no copy where it is unused.)
template <Format f>
__device__ __noinline__ uint16_t encode_pair_nan(float lo, float hi) {
  return static_cast<uint16_t>(encode(lo, f) | (encode(hi, f) << 8));
}
#endif

// encode() of two values, lo in the low byte. On sm_89 and later the fp8 formats take one
// cvt.rn.satfinite instruction per pair (round to nearest even, saturating: the same bits as
// clipping first, since the clip bound is the format's largest finite value); a NaN keeps
// encode()'s code and sign. int8 takes one conversion a value (rint, then the clip: the same for
// integer bounds) where encode() takes a clip, a rounding, a conversion and a NaN test.
JAXKV_HD uint16_t encode_pair(float lo, float hi, Format f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (f == Format::kE4M3 || f == Format::kE5M2) {
    if (lo != lo || hi != hi)
      return f == Format::kE4M3 ? encode_pair_nan<Format::kE4M3>(lo, hi)
                                : encode_pair_nan<Format::kE5M2>(lo, hi);
    uint16_t r;
    if (f == Format::kE4M3)
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    else
      asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
  }
#endif
#if defined(__CUDA_ARCH__)
  if (f == Format::kS8) {  // cvt.rni: nearest even, NaN to 0, saturating; then the clip to +-127
    const int32_t a = min(max(__float2int_rn(lo), -127), 127);
    const int32_t b = min(max(__float2int_rn(hi), -127), 127);
    return static_cast<uint16_t>((a & 0xff) | ((b & 0xff) << 8));
  }
#endif
  return static_cast<uint16_t>(encode(lo, f) | (encode(hi, f) << 8));
}

}  // namespace jaxkv
