// Synthetic calibration activations with the structure fitting is about: queries, keys and
// values drawn from anisotropic Gaussians (a random basis, geometrically decaying scales, a
// few outlier directions), different per layer and KV head.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <Eigen/Dense>

#include "common/random.hpp"
#include "oscar/fit/accumulators.hpp"

namespace oscar::testing {

struct Activations {
  int64_t tokens = 0;
  std::vector<float> q, k, v;  // [T, Hq, d], [T, Hkv, d], [T, Hkv, d]
};

// Keys also carry a few outlier channels in the original basis (10x), as real post-RoPE keys
// do, so that "no rotation" is measurably bad.
// Rows x = z·diag(scale)·B with z standard normal and B a random orthogonal basis.
class AnisotropicSource {
 public:
  AnisotropicSource(int d, uint64_t basis_seed, uint64_t sample_seed, double decay) : d_(d), rng_(sample_seed) {
    const std::vector<float> b = random_orthogonal(d, basis_seed * 7 + 1);
    basis_ = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(b.data(), d, d)
                 .cast<double>();
    scale_.resize(d);
    for (int i = 0; i < d; ++i) scale_[i] = std::pow(decay, i) * (i < 2 ? 8.0 : 1.0);
  }
  void row(float* out) {
    std::normal_distribution<double> normal;
    Eigen::RowVectorXd z(d_);
    for (int i = 0; i < d_; ++i) z[i] = normal(rng_) * scale_[i];
    const Eigen::RowVectorXd x = z * basis_;
    for (int i = 0; i < d_; ++i) out[i] = static_cast<float>(x[i]);
  }

 private:
  int d_;
  std::mt19937_64 rng_;
  Eigen::MatrixXd basis_;
  std::vector<double> scale_;
};

inline Activations make_activations(const fit::ModelShape& s, int64_t tokens, uint64_t seed) {
  Activations a;
  a.tokens = tokens;
  const int d = s.head_dim;
  a.q.resize(static_cast<size_t>(tokens) * s.num_qo_heads * d);
  a.k.resize(static_cast<size_t>(tokens) * s.num_kv_heads * d);
  a.v.resize(a.k.size());
  std::vector<AnisotropicSource> qs, ks, vs;
  // Query heads of one group share a basis (as real GQA groups share their keys' statistics)
  // but draw their own samples.
  for (int h = 0; h < s.num_qo_heads; ++h) qs.emplace_back(d, seed * 1000 + h / s.group_size(), seed * 3000 + h, 0.95);
  for (int h = 0; h < s.num_kv_heads; ++h) {
    ks.emplace_back(d, seed * 1000 + 500 + h, seed * 3000 + 500 + h, 0.93);
    vs.emplace_back(d, seed * 1000 + 700 + h, seed * 3000 + 700 + h, 0.97);
  }
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h = 0; h < s.num_qo_heads; ++h) qs[h].row(&a.q[(t * s.num_qo_heads + h) * d]);
    for (int h = 0; h < s.num_kv_heads; ++h) {
      float* kr = &a.k[(t * s.num_kv_heads + h) * d];
      ks[h].row(kr);
      kr[3] *= 10.0f;
      kr[d / 2 + 1] *= 10.0f;
      vs[h].row(&a.v[(t * s.num_kv_heads + h) * d]);
    }
  }
  return a;
}

}  // namespace oscar::testing
