// The normalized Walsh-Hadamard transform (Sylvester order): y = x·H with H = H_d / sqrt(d),
// H_d[i][j] = (-1)^popcount(i & j). H is symmetric and orthogonal, so it is its own inverse.
// d·log2(d) additions instead of d² multiply-adds: the data-oblivious baseline (QuaRot) and the
// mixing factor inside OSCAR's U·H.
#pragma once

#include <cmath>

#include "oscar/core/config.hpp"

namespace oscar {

// In place. Returns false, and leaves x as it was, where n is not a positive power of two
// (the butterflies would step past x[n - 1]).
OSCAR_HOST_DEVICE bool hadamard_transform(float* x, int n) {
  if (n <= 0 || (n & (n - 1)) != 0) return false;
  for (int half = 1; half < n; half *= 2) {
    for (int block = 0; block < n; block += 2 * half) {
      for (int i = block; i < block + half; ++i) {
        const float a = x[i];
        const float b = x[i + half];
        x[i] = a + b;
        x[i + half] = a - b;
      }
    }
  }
  const float norm = 1.0f / sqrtf(static_cast<float>(n));
  for (int i = 0; i < n; ++i) x[i] *= norm;
  return true;
}

// Entry (i, j) of the normalized matrix, for building dense rotations (U·H) on the host.
OSCAR_HOST_DEVICE float hadamard_entry(int i, int j, int n) {
  int parity = 0;
  for (unsigned bits = static_cast<unsigned>(i & j); bits != 0; bits &= bits - 1) parity ^= 1;
  const float norm = 1.0f / sqrtf(static_cast<float>(n));
  return parity ? -norm : norm;
}

}  // namespace oscar
