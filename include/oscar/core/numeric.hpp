// 16-bit float storage types and their conversions, identical on host and device.
//
// The cache stores K/V in bf16 and quantization metadata in fp16. The conversions below are
// written with integer operations only, so the CPU reference and the CUDA kernels round every
// value the same way (round to nearest, ties to even; NaN stays NaN) and the GPU write kernels
// can be checked bit for bit against the reference. `bf16_t` and `fp16_t` have the size and
// bit layout of CUDA's `__nv_bfloat16` and `__half`, so device code may reinterpret them.
#pragma once

#include <cstdint>
#include <cstring>

#include "oscar/core/config.hpp"

namespace oscar {

OSCAR_HOST_DEVICE uint32_t float_bits(float value) {
#if OSCAR_DEVICE_CODE
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}

OSCAR_HOST_DEVICE float float_from_bits(uint32_t bits) {
#if OSCAR_DEVICE_CODE
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

// Exponent all ones: Inf or NaN. Used instead of std::isfinite, which is not a device function.
OSCAR_HOST_DEVICE bool is_finite(float value) {
  return (float_bits(value) & 0x7f800000u) != 0x7f800000u;
}

struct bf16_t {
  uint16_t bits;
};
struct fp16_t {
  uint16_t bits;
};
static_assert(sizeof(bf16_t) == 2 && sizeof(fp16_t) == 2);

OSCAR_HOST_DEVICE bf16_t float_to_bf16(float value) {
  const uint32_t bits = float_bits(value);
  // Every NaN becomes the one canonical quiet NaN: CPUs and GPUs produce NaNs with different
  // sign and payload bits, and stored bytes must not depend on where they were computed.
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16_t{0x7fc0u};
  const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);  // ties to even
  return bf16_t{static_cast<uint16_t>(rounded >> 16)};
}

// float_to_bf16 of two floats, packed: lo in bits 0-15, hi in bits 16-31. On sm_90 and later
// one cvt.rn.bf16x2.f32 (round to nearest, ties to even, subnormals kept: the rounding of
// float_to_bf16, which test_functors_gpu checks against CUDA's on a million floats) and a
// select that turns every NaN into float_to_bf16's canonical 0x7fc0, three instructions where
// the integer steps take about ten per element (the tensor-core rotation's epilogue converts
// 64 accumulators per thread and tile).
OSCAR_HOST_DEVICE uint32_t bf16_pair_bits(float lo, float hi) {
#if OSCAR_DEVICE_CODE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // (bf16x2 set: sm_90)
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));  // a -> upper half, b -> lower
  uint32_t nan;  // 0xffff in each half that is a NaN (unordered with itself)
  asm("set.neu.u32.bf16x2 %0, %1, %1;" : "=r"(nan) : "r"(packed));
  return (packed & ~nan) | (0x7fc07fc0u & nan);
#else
  return uint32_t{float_to_bf16(lo).bits} | uint32_t{float_to_bf16(hi).bits} << 16;
#endif
}

OSCAR_HOST_DEVICE float bf16_to_float(bf16_t value) {
  return float_from_bits(static_cast<uint32_t>(value.bits) << 16);
}

OSCAR_HOST_DEVICE fp16_t float_to_fp16(float value) {
  const uint32_t bits = float_bits(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return fp16_t{0x7e00u};  // canonical quiet NaN, as for bf16
  // 65520 is the midpoint between 65504 (largest fp16) and 65536; ties go to even, i.e. Inf.
  if (magnitude >= 0x477ff000u) return fp16_t{static_cast<uint16_t>(sign | 0x7c00u)};
  if (magnitude < 0x38800000u) {  // below 2^-14: an fp16 subnormal or zero
    if (magnitude <= 0x33000000u) return fp16_t{static_cast<uint16_t>(sign)};  // <= 2^-25
    const uint32_t exponent = magnitude >> 23;
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // value = mantissa * 2^(exponent-150), unit 2^-24
    uint32_t result = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
    return fp16_t{static_cast<uint16_t>(sign | result)};
  }
  const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
  return fp16_t{static_cast<uint16_t>(sign | ((rounded >> 13) - (112u << 10)))};
}

OSCAR_HOST_DEVICE float fp16_to_float(fp16_t value) {
  const uint32_t sign = static_cast<uint32_t>(value.bits & 0x8000u) << 16;
  const uint32_t exponent = (value.bits >> 10) & 0x1fu;
  const uint32_t mantissa = value.bits & 0x3ffu;
  if (exponent == 0x1fu) return float_from_bits(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    // Subnormal or zero: mantissa * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return float_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Round a float through bf16 and back: the value the cache stores for it.
OSCAR_HOST_DEVICE float round_to_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }
OSCAR_HOST_DEVICE float round_to_fp16(float value) { return fp16_to_float(float_to_fp16(value)); }

inline constexpr float kFp16Max = 65504.0f;
inline constexpr float kFp16MinSubnormal = 5.9604644775390625e-8f;  // 2^-24

}  // namespace oscar
