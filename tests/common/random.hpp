// Seeded random inputs shaped like real K/V: Gaussian rows with a few outlier channels,
// values representable in bf16 (so float64 oracles see exactly what the cache sees).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "oscar/core/numeric.hpp"

namespace oscar::testing {

class RowGenerator {
 public:
  explicit RowGenerator(uint64_t seed, int head_dim, int num_outliers = 4, float outlier_scale = 12.0f)
      : rng_(seed), head_dim_(head_dim), channel_scale_(head_dim, 1.0f) {
    std::uniform_int_distribution<int> channel(0, head_dim - 1);
    for (int i = 0; i < num_outliers; ++i) channel_scale_[channel(rng_)] = outlier_scale;
  }

  // One row of bf16 values (as float, exactly representable).
  std::vector<float> row() {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> r(head_dim_);
    for (int i = 0; i < head_dim_; ++i) r[i] = round_to_bf16(normal(rng_) * channel_scale_[i]);
    return r;
  }
  void fill_bf16(bf16_t* out, size_t rows) {
    for (size_t r = 0; r < rows; ++r) {
      const std::vector<float> v = row();
      for (int i = 0; i < head_dim_; ++i) out[r * head_dim_ + i] = float_to_bf16(v[i]);
    }
  }
  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
  int head_dim_;
  std::vector<float> channel_scale_;
};

// A random orthogonal matrix (float32, row-major), by Gram-Schmidt on Gaussian rows in double.
inline std::vector<float> random_orthogonal(int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<double> m(static_cast<size_t>(d) * d);
  for (double& x : m) x = normal(rng);
  for (int i = 0; i < d; ++i) {
    for (int pass = 0; pass < 2; ++pass) {  // twice for numerical orthogonality
      for (int j = 0; j < i; ++j) {
        double dot = 0;
        for (int k = 0; k < d; ++k) dot += m[i * d + k] * m[j * d + k];
        for (int k = 0; k < d; ++k) m[i * d + k] -= dot * m[j * d + k];
      }
    }
    double norm = 0;
    for (int k = 0; k < d; ++k) norm += m[i * d + k] * m[i * d + k];
    norm = std::sqrt(norm);
    for (int k = 0; k < d; ++k) m[i * d + k] /= norm;
  }
  return std::vector<float>(m.begin(), m.end());
}

}  // namespace oscar::testing
