// Asymmetric 2-bit quantization of one group: levels {mn, mn+s, mn+2s, mn+3s} with
// s = max(mx - mn, eps) / 3, scale and offset rounded to fp16 first and the codes computed
// against the rounded values, so x̂ = offset + code * scale is what every reader reconstructs.
#pragma once

#include <cmath>
#include <cstdint>

#include "oscar/core/config.hpp"
#include "oscar/core/numeric.hpp"
#include "oscar/quant/format.hpp"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace oscar {

inline constexpr int kInt2Levels = 4;

// The quantizer of one group after its metadata is fixed. Keeps the float values of the fp16
// metadata and the reciprocal of the scale so that quantize_code() is one fma and three
// comparisons.
struct GroupQuantizer {
  QuantMeta meta;
  float offset;
  float scale;
  float inv_scale;
  bool finite;  // false: the group held NaN/Inf; meta is NaN and every code is 0
};

// Metadata from the group's extremes. Scale and offset saturate at the fp16 range (a finite
// input never produces Inf metadata); the scale never drops below the smallest fp16
// subnormal, so a constant group reconstructs exactly with all codes 0.
OSCAR_HOST_DEVICE GroupQuantizer make_group_quantizer(float mn, float mx, bool finite) {
  GroupQuantizer q{};
  q.finite = finite;
  if (!finite) {
    q.meta.scale = fp16_t{0x7e00};
    q.meta.offset = fp16_t{0x7e00};
    q.scale = q.offset = q.inv_scale = fp16_to_float(q.meta.scale);
    return q;
  }
  float scale = (mx - mn) / 3.0f;
  scale = scale < kFp16MinSubnormal ? kFp16MinSubnormal : (scale > kFp16Max ? kFp16Max : scale);
  // + 0.0f turns -0 into +0: the extremes of a group may be found in any order (a warp
  // reduction on the GPU, a loop here), and both must store the same bits.
  const float offset = (mn < -kFp16Max ? -kFp16Max : (mn > kFp16Max ? kFp16Max : mn)) + 0.0f;
#if OSCAR_DEVICE_CODE
  // The conversion instructions round to nearest even, as float_to_fp16 does, and both
  // operands are finite here (the two differ only in the NaN they produce): the same bits
  // in 4 instructions instead of ~50.
  const __half scale16 = __float2half_rn(scale), offset16 = __float2half_rn(offset);
  q.meta.scale = fp16_t{__half_as_ushort(scale16)};
  q.meta.offset = fp16_t{__half_as_ushort(offset16)};
  q.scale = __half2float(scale16);
  q.offset = __half2float(offset16);
  q.inv_scale = __frcp_rn(q.scale);  // correctly rounded, like 1.0f / scale, without the division
#else
  q.meta.scale = float_to_fp16(scale);
  q.meta.offset = float_to_fp16(offset);
  q.scale = fp16_to_float(q.meta.scale);
  q.offset = fp16_to_float(q.meta.offset);
  q.inv_scale = 1.0f / q.scale;
#endif
  return q;
}

// t = (x - offset) / scale + 1/2 as every quantizer computes it, from the difference x - offset
// rounded to float, through an explicit fma so that compilers that contract (nvcc does by
// default) and those that do not agree bit for bit. The bf16x2 quantizers' level thresholds
// (row_bf16x2.hpp) are exact because they evaluate this same function.
OSCAR_HOST_DEVICE float level_position_of_difference(float difference, const GroupQuantizer& q) {
  return fmaf(difference, q.inv_scale, 0.5f);
}

// Nearest level, ties up: floor(t) clamped to 0..3. floor(t) >= c exactly when t >= c, so the
// clamped floor is three comparisons (no float-to-int conversion, a quarter-rate instruction
// on the GPU).
OSCAR_HOST_DEVICE uint32_t quantize_code(float x, const GroupQuantizer& q) {
  if (!q.finite) return 0;
  const float t = level_position_of_difference(x - q.offset, q);
  return uint32_t{t >= 1.0f} + uint32_t{t >= 2.0f} + uint32_t{t >= 3.0f};
}

OSCAR_HOST_DEVICE float dequantize_code(uint32_t code, float scale, float offset) {
  return fmaf(static_cast<float>(code), scale, offset);
}
OSCAR_HOST_DEVICE float dequantize_code(uint32_t code, const QuantMeta& meta) {
  return dequantize_code(code, fp16_to_float(meta.scale), fp16_to_float(meta.offset));
}

// Extremes and finiteness of a group in one pass.
struct GroupRange {
  float mn;
  float mx;
  bool finite;
};
OSCAR_HOST_DEVICE GroupRange group_range(const float* x, int n) {
  GroupRange range{INFINITY, -INFINITY, true};
  for (int i = 0; i < n; ++i) {
    range.finite = range.finite && is_finite(x[i]);
    range.mn = x[i] < range.mn ? x[i] : range.mn;
    range.mx = x[i] > range.mx ? x[i] : range.mx;
  }
  return range;
}

}  // namespace oscar
