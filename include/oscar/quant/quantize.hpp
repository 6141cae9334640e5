// Asymmetric 2-bit quantization of one group: levels {mn, mn+s, mn+2s, mn+3s} with
// s = max(mx - mn, eps) / 3, scale and offset rounded to fp16 first and the codes computed
// against the rounded values, so x̂ = offset + code * scale is what every reader reconstructs.
#pragma once

#include <cmath>
#include <cstdint>

#include "oscar/core/config.hpp"
#include "oscar/core/numeric.hpp"
#include "oscar/quant/format.hpp"

namespace oscar {

inline constexpr int kInt2Levels = 4;
inline constexpr uint32_t kInt2MaxCode = 3;

// The quantizer of one group after its metadata is fixed. Keeps the float values of the fp16
// metadata and the reciprocal of the scale so that quantize_code() is one fma and a floor.
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
  q.meta.scale = float_to_fp16(scale);
  q.meta.offset = float_to_fp16(offset);
  q.scale = fp16_to_float(q.meta.scale);
  q.offset = fp16_to_float(q.meta.offset);
#if OSCAR_DEVICE_CODE
  q.inv_scale = __frcp_rn(q.scale);  // correctly rounded, like 1.0f / scale, without the division
#else
  q.inv_scale = 1.0f / q.scale;
#endif
  return q;
}

// Nearest level, ties up: floor((x - offset) / scale + 1/2) through an explicit fma so that
// compilers that contract (nvcc does by default) and those that do not agree bit for bit.
OSCAR_HOST_DEVICE uint32_t quantize_code(float x, const GroupQuantizer& q) {
  if (!q.finite) return 0;
  const float level = floorf(fmaf(x - q.offset, q.inv_scale, 0.5f));
  return level <= 0.0f ? 0u : (level >= 3.0f ? kInt2MaxCode : static_cast<uint32_t>(level));
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
