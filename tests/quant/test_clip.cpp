// Clipping: the threshold is the exact order statistic of the magnitudes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "common/naive.hpp"
#include "oscar/quant/clip.hpp"

using namespace oscar;

TEST_CASE("clip_rank follows min(floor(rho*d), d-1) and disables outside (0, 1)") {
  CHECK(clip_rank(0.96f, 128) == 122);  // method.md: clips the 5 largest magnitudes
  CHECK(clip_rank(0.92f, 128) == 117);
  CHECK(clip_rank(0.5f, 64) == 32);
  CHECK(clip_rank(0.75f, 64) == 48);
  CHECK(clip_rank(0.9999f, 64) == 63);
  CHECK(clip_rank(1.0f, 128) == -1);
  CHECK(clip_rank(1.5f, 128) == -1);
  CHECK(clip_rank(0.0f, 128) == -1);
  CHECK(clip_rank(-0.3f, 128) == -1);
  CHECK(clip_rank(std::nanf(""), 128) == -1);
}

TEST_CASE("kth_smallest_magnitude equals sorting, for every rank") {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (int n : {8, 64, 128, 256}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> x(n);
      for (float& v : x) v = normal(rng) * (trial % 3 == 0 ? 1e-3f : 10.0f);
      if (trial % 4 == 1) {  // ties, signed zeros and repeated magnitudes
        for (int i = 0; i < n; i += 3) x[i] = (i % 2 ? -1.0f : 1.0f) * x[0];
        x[1] = 0.0f;
        x[2] = -0.0f;
      }
      const std::vector<double> xd(x.begin(), x.end());
      for (int k = 0; k < n; ++k) {
        CHECK(kth_smallest_magnitude(x.data(), n, k) == oscar::testing::naive_kth_magnitude(xd, k));
      }
    }
  }
}

TEST_CASE("Inf sorts as the largest magnitude") {
  std::vector<float> x{1.0f, -INFINITY, 3.0f, -2.0f};
  CHECK(kth_smallest_magnitude(x.data(), 4, 3) == INFINITY);
  CHECK(kth_smallest_magnitude(x.data(), 4, 2) == 3.0f);
}

TEST_CASE("clip_row clamps exactly the magnitudes above tau") {
  std::mt19937 rng(4);
  std::normal_distribution<float> normal;
  std::vector<float> x(128);
  for (float& v : x) v = normal(rng);
  x[7] = 40.0f;
  x[90] = -55.0f;
  const std::vector<float> before = x;
  const int k = clip_rank(0.96f, 128);
  const float tau = clip_row(x.data(), 128, k);
  std::vector<float> sorted(128);
  std::transform(before.begin(), before.end(), sorted.begin(), [](float v) { return std::abs(v); });
  std::sort(sorted.begin(), sorted.end());
  CHECK(tau == sorted[k]);
  int clipped = 0;
  for (int i = 0; i < 128; ++i) {
    if (std::abs(before[i]) > tau) {
      ++clipped;
      CHECK(x[i] == std::copysign(tau, before[i]));
    } else {
      CHECK(x[i] == before[i]);
    }
  }
  CHECK(clipped == 127 - k);  // distinct magnitudes: the d-1-k largest are clamped
  CHECK(clip_row(x.data(), 128, -1) == INFINITY);
}
