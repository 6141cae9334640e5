// Dense and Hadamard rotations against float64 matrix products.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "common/naive.hpp"
#include "common/random.hpp"
#include "oscar/rotate/dense.hpp"
#include "oscar/rotate/hadamard.hpp"

using namespace oscar;

TEST_CASE("rotate_row / unrotate_row equal float64 x·R and y·Rᵀ") {
  std::mt19937 rng(6);
  std::normal_distribution<float> normal;
  for (int d : {64, 128, 256}) {
    const std::vector<float> r = oscar::testing::random_orthogonal(d, d);
    const std::vector<double> rd(r.begin(), r.end());
    std::vector<float> x(d), y(d), back(d);
    for (float& v : x) v = normal(rng);
    rotate_row(x.data(), r.data(), d, y.data());
    const auto expected = oscar::testing::naive_rotate(std::vector<double>(x.begin(), x.end()), rd, d);
    double norm = 0;
    for (float v : x) norm += double{v} * v;
    for (int j = 0; j < d; ++j) CHECK(std::abs(y[j] - expected[j]) <= 1e-5 * std::sqrt(norm));
    unrotate_row(y.data(), r.data(), d, back.data());
    for (int i = 0; i < d; ++i) CHECK(std::abs(back[i] - x[i]) <= 1e-5 * std::sqrt(norm));
  }
}

TEST_CASE("hadamard_transform equals the normalized Sylvester matrix and is an involution") {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (int d : {8, 64, 128, 256}) {
    const std::vector<double> h = oscar::testing::naive_hadamard(d);
    std::vector<float> x(d);
    for (float& v : x) v = normal(rng);
    std::vector<float> y = x;
    CHECK(hadamard_transform(y.data(), d));
    const auto expected = oscar::testing::naive_rotate(std::vector<double>(x.begin(), x.end()), h, d);
    for (int j = 0; j < d; ++j) CHECK(std::abs(y[j] - expected[j]) <= 1e-5);
    hadamard_transform(y.data(), d);
    for (int i = 0; i < d; ++i) CHECK(std::abs(y[i] - x[i]) <= 1e-5);
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) CHECK(hadamard_entry(i, j, d) == doctest::Approx(h[i * d + j]).epsilon(1e-6));
  }
}

TEST_CASE("hadamard_transform refuses a length that is not a power of two and leaves the row as it was") {
  for (int n : {0, -4, 3, 96, 100}) {
    CAPTURE(n);
    // n + 8 values, so that a transform stepping past x[n - 1] would show in the guard.
    std::vector<float> x(static_cast<size_t>(std::max(n, 0)) + 8);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) + 0.5f;
    const std::vector<float> before = x;
    CHECK_FALSE(hadamard_transform(x.data(), n));
    CHECK(x == before);
  }
}

TEST_CASE("hadamard_entry builds an orthogonal matrix") {
  const int d = 128;
  double worst = 0;
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) {
      double dot = 0;
      for (int k = 0; k < d; ++k) dot += double{hadamard_entry(i, k, d)} * hadamard_entry(j, k, d);
      worst = std::max(worst, std::abs(dot - (i == j)));
    }
  CHECK(worst < 1e-6);
}
