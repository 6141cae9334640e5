// Dense d×d rotation of one row vector: y = x·R, and the way back, x = y·Rᵀ.
// R is float32, row-major [d][d] (R[i][j] at R[i * d + j]), orthogonal.
#pragma once

#include <cmath>

#include "oscar/core/config.hpp"

namespace oscar {

// y_j = Σ_i x_i R_ij, accumulated in i order with fma. `y` must not alias `x`.
OSCAR_HOST_DEVICE void rotate_row(const float* x, const float* rotation, int head_dim, float* y) {
  for (int j = 0; j < head_dim; ++j) y[j] = 0.0f;
  for (int i = 0; i < head_dim; ++i) {
    const float xi = x[i];
    const float* row = rotation + static_cast<long>(i) * head_dim;
    for (int j = 0; j < head_dim; ++j) y[j] = fmaf(xi, row[j], y[j]);
  }
}

// x_i = Σ_j y_j R_ij (multiplication by Rᵀ). `x` must not alias `y`.
OSCAR_HOST_DEVICE void unrotate_row(const float* y, const float* rotation, int head_dim,
                                    float* x) {
  for (int i = 0; i < head_dim; ++i) {
    const float* row = rotation + static_cast<long>(i) * head_dim;
    float sum = 0.0f;
    for (int j = 0; j < head_dim; ++j) sum = fmaf(y[j], row[j], sum);
    x[i] = sum;
  }
}

}  // namespace oscar
