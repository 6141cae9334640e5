// Per-layer clip ratios by grid search on held-out calibration tokens (method.md §2):
//
//   J_K(R, rho) = Σ_h mean_t e_{h,t} (RᵀA_hR) e_{h,t}ᵀ    = ‖Q(K − K̂)ᵀ‖² per query and key
//   J_V(R, rho) = Σ_h mean_t m_{h,t} ‖e_{h,t}‖²           (m normalized to mean 1 per head)
//
// e is the residual in the rotated basis: the exact x·R minus what the cache reconstructs.
// The reconstruction goes through the runtime's own functors, the way PagedCache::write does
// it: the input row rounded to bf16 (the cache receives bf16), rotate_row with the float32
// plan matrix, round_to_bf16, quantize_row, dequantize_row. So the ratio is chosen for the
// bytes the cache will actually hold. The trace identity ‖Q Eᵀ‖² = tr(RᵀC_QR · EᵀE) is what
// lets J_K use the calibration's A_h instead of held-out queries (tested).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <Eigen/Dense>

#include "oscar/core/numeric.hpp"
#include "oscar/core/status.hpp"
#include "oscar/quant/clip.hpp"
#include "oscar/quant/format.hpp"
#include "oscar/quant/row.hpp"
#include "oscar/rotate/dense.hpp"

namespace oscar::fit {

using RowMatrixXd = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// The authors' fixed ratios.
inline constexpr float kAuthorsKeyClipRatio = 0.96f;
inline constexpr float kAuthorsValueClipRatio = 0.92f;

// {1.00, 0.99, ..., 0.85}.
inline std::vector<float> default_clip_grid() {
  std::vector<float> grid;
  for (int i = 100; i >= 85; --i) grid.push_back(static_cast<float>(i) / 100.0f);
  return grid;
}

// Held-out rows of one tensor (K or V) of one layer, rotated once and reused for every grid
// point. Rows are ordered token-major: row t*num_heads + h.
struct RotatedRows {
  int32_t num_heads = 0;
  int32_t head_dim = 0;
  int64_t tokens = 0;
  std::vector<float> cache_rows;  // [tokens*num_heads, head_dim]: what quantize_row receives
  RowMatrixXd exact;              // the same rows, x·R in float64
};

namespace detail {
// rotate_row with the same fmaf sequence, compiled for hardware FMA where the CPU has it.
// fmaf is exactly specified (one rounding), so the bytes equal rotate_row's on any machine;
// only speed differs: without -mfma every fmaf is a libm call, which made rotation half of
// the fitting time at Qwen3-8B scale.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("fma"))) inline void rotate_row_fma(const float* x, const float* rotation, int head_dim,
                                                          float* y) {
  for (int j = 0; j < head_dim; ++j) y[j] = 0.0f;
  for (int i = 0; i < head_dim; ++i) {
    const float xi = x[i];
    const float* row = rotation + static_cast<long>(i) * head_dim;
    for (int j = 0; j < head_dim; ++j) y[j] = __builtin_fmaf(xi, row[j], y[j]);
  }
}
inline void rotate_row_fast(const float* x, const float* rotation, int head_dim, float* y) {
  static const bool has_fma = __builtin_cpu_supports("fma");
  if (has_fma) {
    rotate_row_fma(x, rotation, head_dim, y);
  } else {
    rotate_row(x, rotation, head_dim, y);
  }
}
#else
inline void rotate_row_fast(const float* x, const float* rotation, int head_dim, float* y) {
  rotate_row(x, rotation, head_dim, y);
}
#endif
}  // namespace detail

// x: float32 [tokens, num_heads, head_dim]; rotation: float32 [d, d] row-major (empty = identity).
inline Result<RotatedRows> rotate_rows(const float* x, int64_t tokens, int32_t num_heads, int32_t head_dim,
                                       const std::vector<float>& rotation) {
  if (head_dim <= 0 || head_dim > kMaxHeadDim || num_heads <= 0 || tokens < 0 || (tokens > 0 && !x)) {
    return invalid_argument("rotate_rows: bad shape or null rows");
  }
  if (!rotation.empty() && rotation.size() != static_cast<size_t>(head_dim) * head_dim) {
    return invalid_argument("rotate_rows: rotation has " + std::to_string(rotation.size()) + " entries");
  }
  RotatedRows out;
  out.num_heads = num_heads;
  out.head_dim = head_dim;
  out.tokens = tokens;
  const int64_t rows = tokens * num_heads;
  const int d = head_dim;
  out.cache_rows.resize(static_cast<size_t>(rows) * d);
  RowMatrixXd input(rows, d);
  std::vector<float> row(d);
  for (int64_t r = 0; r < rows; ++r) {
    for (int i = 0; i < d; ++i) {
      row[i] = round_to_bf16(x[r * d + i]);
      input(r, i) = row[i];
    }
    float* dst = out.cache_rows.data() + r * d;
    if (rotation.empty()) {
      for (int i = 0; i < d; ++i) dst[i] = row[i];
    } else {
      detail::rotate_row_fast(row.data(), rotation.data(), d, dst);
    }
    for (int i = 0; i < d; ++i) dst[i] = round_to_bf16(dst[i]);
  }
  if (rotation.empty()) {
    out.exact = std::move(input);
  } else {
    const Eigen::MatrixXd r =
        Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(rotation.data(), d, d)
            .cast<double>();
    out.exact.noalias() = input * r;
  }
  return Result<RotatedRows>(std::move(out));
}

// E = exact − dequantize(quantize(cache_rows)) for clip rank `clip_k` (from clip_rank()).
inline RowMatrixXd quantization_residual(const RotatedRows& rows, int quant_group_size, int clip_k) {
  const int d = rows.head_dim;
  const int g = quant_group_size == 0 ? d : quant_group_size;
  const int64_t n = rows.tokens * rows.num_heads;
  RowMatrixXd e(n, d);
  uint8_t packed[kMaxHeadDim / 4];
  QuantMeta meta[kMaxHeadDim / 32];
  float out[kMaxHeadDim];
  for (int64_t r = 0; r < n; ++r) {
    quantize_row(rows.cache_rows.data() + r * d, d, g, clip_k, packed, meta);
    dequantize_row(packed, meta, d, g, out);
    for (int i = 0; i < d; ++i) e(r, i) = rows.exact(r, i) - out[i];
  }
  return e;
}

// The rows of head h of a token-major residual.
inline auto head_rows(const RowMatrixXd& e, int32_t num_heads, int32_t h) {
  using Stride = Eigen::OuterStride<>;
  return Eigen::Map<const RowMatrixXd, 0, Stride>(e.data() + static_cast<int64_t>(h) * e.cols(),
                                                  e.rows() / num_heads, e.cols(), Stride(num_heads * e.cols()));
}

// J_K for a residual; metric[h] = RᵀA_hR (d×d). Through the trace identity,
// Σ_t e M eᵀ = tr(M · EᵀE): one SYRK per head (n·d²/2 multiply-adds) instead of forming E·M
// (n·d²), which halves the dominant cost of the clip search.
inline double key_objective(const RowMatrixXd& e, const std::vector<Eigen::MatrixXd>& metric) {
  const int32_t heads = static_cast<int32_t>(metric.size());
  const int64_t d = e.cols();
  double j = 0.0;
  Eigen::MatrixXd gram(d, d);
  for (int32_t h = 0; h < heads; ++h) {
    gram.setZero();
    gram.selfadjointView<Eigen::Lower>().rankUpdate(head_rows(e, heads, h).transpose());
    // tr(M G) for symmetric M, G from G's lower triangle: diagonal once, off-diagonal twice.
    const Eigen::MatrixXd& m = metric[h];
    for (int64_t c = 0; c < d; ++c) {
      j += m(c, c) * gram(c, c);
      for (int64_t r = c + 1; r < d; ++r) j += 2.0 * m(r, c) * gram(r, c);
    }
  }
  return j / static_cast<double>(e.rows() / heads);
}

// J_V for a residual; weights: [tokens, heads] token-major, each head's column mean 1.
inline double value_objective(const RowMatrixXd& e, const Eigen::VectorXd& weights, int32_t num_heads) {
  return weights.dot(e.rowwise().squaredNorm()) / static_cast<double>(e.rows() / num_heads);
}

struct ClipChoice {
  float ratio = 1.0f;
  double objective = 0.0;
  std::vector<double> curve;  // objective per grid entry
};

// Evaluates every grid ratio (ratios with the same clip rank are quantized once) and returns
// the minimizer; ties go to the larger ratio (less clipping). `objective` maps a residual to J.
template <class Objective>
Result<ClipChoice> search_clip_ratio(const RotatedRows& rows, int quant_group_size, const std::vector<float>& grid,
                                     Objective&& objective) {
  if (grid.empty()) return invalid_argument("clip search: the grid is empty");
  for (float rho : grid) {
    if (!(rho > 0.0f && rho <= 1.0f)) {
      return invalid_argument("clip search: grid ratio " + std::to_string(rho) + " outside (0, 1]");
    }
  }
  if (rows.tokens == 0) return invalid_argument("clip search: no held-out tokens");
  if (!is_supported_head_dim(rows.head_dim) ||
      (quant_group_size != 0 && !is_supported_quant_group(rows.head_dim, quant_group_size))) {
    return invalid_argument("clip search: head_dim " + std::to_string(rows.head_dim) + " with quant_group_size " +
                            std::to_string(quant_group_size) + " is not a supported shape");
  }
  ClipChoice choice;
  std::vector<int> ranks;
  std::vector<double> values;
  bool have = false;
  for (float rho : grid) {
    const int k = clip_rank(rho, rows.head_dim);
    double j = 0.0;
    bool found = false;
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i] == k) {
        j = values[i];
        found = true;
      }
    }
    if (!found) {
      j = objective(quantization_residual(rows, quant_group_size, k));
      // NaN compares false with everything: the minimum below would silently be grid[0].
      if (!std::isfinite(j)) {
        return invalid_argument("clip search: the objective at ratio " + std::to_string(rho) +
                                " is not finite (NaN or Inf in the held-out rows or weights)");
      }
      ranks.push_back(k);
      values.push_back(j);
    }
    choice.curve.push_back(j);
    if (!have || j < choice.objective || (j == choice.objective && rho > choice.ratio)) {
      choice.ratio = rho;
      choice.objective = j;
      have = true;
    }
  }
  return Result<ClipChoice>(std::move(choice));
}

// The authors' proxy weights on held-out keys, w_t = k A_h kᵀ, normalized to mean 1 per head.
// k: float32 [tokens, heads, d]; returns [tokens*heads] token-major.
inline Eigen::VectorXd proxy_value_weights(const float* k, int64_t tokens, const std::vector<Eigen::MatrixXd>& a) {
  const int32_t heads = static_cast<int32_t>(a.size());
  const int d = static_cast<int>(a[0].rows());
  Eigen::VectorXd w(tokens * heads);
  using Stride = Eigen::OuterStride<>;
  for (int32_t h = 0; h < heads; ++h) {
    const RowMatrixXd kh =
        Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, 0, Stride>(
            k + static_cast<int64_t>(h) * d, tokens, d, Stride(static_cast<int64_t>(heads) * d))
            .cast<double>();
    const Eigen::VectorXd wh = ((kh * a[h]).cwiseProduct(kh)).rowwise().sum().cwiseMax(0.0);
    const double mean = wh.mean();
    for (int64_t t = 0; t < tokens; ++t) w[t * heads + h] = mean > 0 ? wh[t] / mean : 1.0;
  }
  return w;
}

// Normalizes engine-provided attention masses [tokens, heads] to mean 1 per head.
inline Eigen::VectorXd normalized_weights(const float* m, int64_t tokens, int32_t heads) {
  Eigen::VectorXd w(tokens * heads);
  for (int32_t h = 0; h < heads; ++h) {
    double sum = 0;
    for (int64_t t = 0; t < tokens; ++t) sum += std::max(0.0f, m[t * heads + h]);
    for (int64_t t = 0; t < tokens; ++t) {
      w[t * heads + h] = sum > 0 ? std::max(0.0f, m[t * heads + h]) * static_cast<double>(tokens) / sum : 1.0;
    }
  }
  return w;
}

}  // namespace oscar::fit
