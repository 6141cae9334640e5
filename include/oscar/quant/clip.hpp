// Per-row magnitude clipping: tau = sort(|x|)[k], x <- clamp(x, -tau, tau), with the rank k
// fixed per layer from the clip ratio rho: k = min(floor(rho * d), d - 1).
#pragma once

#include <cmath>
#include <cstdint>

#include "oscar/core/config.hpp"
#include "oscar/core/numeric.hpp"

namespace oscar {

// Rank of the clip threshold among the sorted magnitudes, or -1 when clipping is off
// (rho >= 1, rho <= 0 or NaN). Computed once per layer on the host, in double precision, so
// that every implementation (CPU, GPU, fitting) agrees on k for the same rho.
inline int clip_rank(float rho, int head_dim) {
  if (!(rho > 0.0f && rho < 1.0f)) return -1;
  const auto rank = static_cast<int>(std::floor(static_cast<double>(rho) * head_dim));
  return rank < head_dim - 1 ? rank : head_dim - 1;
}

// The k-th smallest |x_i| (k zero-based), exactly. Magnitudes compare like their IEEE bit
// patterns read as unsigned integers, so a bitwise binary search over the patterns finds the
// smallest v with #{|x_i| <= v} > k, which is the order statistic itself (NaN magnitudes sort
// above Inf). 32 counting passes over the row: no sort, no scratch memory, the same answer as
// std::nth_element, and the same shape as a warp-parallel version (one ballot per pass).
OSCAR_HOST_DEVICE float kth_smallest_magnitude(const float* x, int n, int k) {
  uint32_t answer = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t trial = answer | ((1u << bit) - 1u);  // bit `bit` zero, all lower bits one
    int at_most_trial = 0;
    for (int i = 0; i < n; ++i) at_most_trial += (float_bits(x[i]) & 0x7fffffffu) <= trial;
    if (at_most_trial <= k) answer |= 1u << bit;
  }
  return float_from_bits(answer);
}

OSCAR_HOST_DEVICE float clamp_magnitude(float value, float tau) {
  return value > tau ? tau : (value < -tau ? -tau : value);
}

// Clips a row in place with the rank from clip_rank(); k < 0 leaves it untouched. Returns tau
// (Inf when nothing was clipped).
OSCAR_HOST_DEVICE float clip_row(float* x, int n, int k) {
  if (k < 0) return INFINITY;
  const float tau = kth_smallest_magnitude(x, n, k);
  for (int i = 0; i < n; ++i) x[i] = clamp_magnitude(x[i], tau);
  return tau;
}

}  // namespace oscar
