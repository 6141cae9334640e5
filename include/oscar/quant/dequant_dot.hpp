// Attention arithmetic straight from packed codes, with scale and offset applied outside the
// inner product (the shape the tensor-core kernels use):
//   q · x̂ = Σ_g [ scale_g · Σ_{i∈g} q_i c_i + offset_g · Σ_{i∈g} q_i ]
//   acc  += p · x̂  =  p·scale_g · c_i + p·offset_g   per element
#pragma once

#include <cstdint>

#include "oscar/core/config.hpp"
#include "oscar/core/numeric.hpp"
#include "oscar/quant/format.hpp"

namespace oscar {

// Σ q_i over each quantization group: computed once per query row, reused for every token.
OSCAR_HOST_DEVICE void query_group_sums(const float* q, int head_dim, int quant_group_size,
                                        float* sums) {
  for (int start = 0, g = 0; start < head_dim; start += quant_group_size, ++g) {
    float sum = 0.0f;
    for (int i = 0; i < quant_group_size; ++i) sum += q[start + i];
    sums[g] = sum;
  }
}

OSCAR_HOST_DEVICE float dequant_dot(const float* q, const float* q_group_sums,
                                    const uint8_t* packed, const QuantMeta* meta, int head_dim,
                                    int quant_group_size) {
  const int quarter = quant_group_size / 4;
  float result = 0.0f;
  for (int start = 0, g = 0; start < head_dim; start += quant_group_size, ++g) {
    const uint8_t* bytes = packed + start / 4;
    const float* qg = q + start;
    float q_dot_codes = 0.0f;
    for (int j = 0; j < quarter; ++j) {
      const uint32_t byte = bytes[j];
      q_dot_codes += qg[j] * static_cast<float>(byte & 3u) +
                     qg[quarter + j] * static_cast<float>((byte >> 2) & 3u) +
                     qg[2 * quarter + j] * static_cast<float>((byte >> 4) & 3u) +
                     qg[3 * quarter + j] * static_cast<float>(byte >> 6);
    }
    result += fp16_to_float(meta[g].scale) * q_dot_codes +
              fp16_to_float(meta[g].offset) * q_group_sums[g];
  }
  return result;
}

OSCAR_HOST_DEVICE void dequant_axpy(float p, const uint8_t* packed, const QuantMeta* meta,
                                    int head_dim, int quant_group_size, float* acc) {
  const int quarter = quant_group_size / 4;
  for (int start = 0, g = 0; start < head_dim; start += quant_group_size, ++g) {
    const float p_scale = p * fp16_to_float(meta[g].scale);
    const float p_offset = p * fp16_to_float(meta[g].offset);
    const uint8_t* bytes = packed + start / 4;
    float* out = acc + start;
    for (int j = 0; j < quarter; ++j) {
      const uint32_t byte = bytes[j];
      out[j] += p_scale * static_cast<float>(byte & 3u) + p_offset;
      out[quarter + j] += p_scale * static_cast<float>((byte >> 2) & 3u) + p_offset;
      out[2 * quarter + j] += p_scale * static_cast<float>((byte >> 4) & 3u) + p_offset;
      out[3 * quarter + j] += p_scale * static_cast<float>(byte >> 6) + p_offset;
    }
  }
}

}  // namespace oscar
