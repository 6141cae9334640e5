// Online softmax and the exact merge of partial states against float64 softmax.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/naive.hpp"
#include "oscar/attention/softmax_state.hpp"

using namespace oscar;

namespace {

struct Partial {
  std::vector<float> o;
  float lse;
};

// Attention of one query over keys [begin, end) given scores s and values v, block by block.
Partial partial(const std::vector<float>& s, const std::vector<std::vector<float>>& v, int begin,
                int end, int block) {
  const int d = static_cast<int>(v[0].size());
  SoftmaxRunning state;
  std::vector<float> acc(d, 0.0f), p(block);
  for (int t0 = begin; t0 < end; t0 += block) {
    const int n = std::min(block, end - t0);
    for (int j = 0; j < n; ++j) p[j] = s[t0 + j];
    const float factor = online_softmax_update(state, p.data(), n);
    for (float& a : acc) a *= factor;
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < d; ++i) acc[i] += p[j] * v[t0 + j][i];
  }
  softmax_normalize(state, acc.data(), d);
  return {acc, softmax_lse(state)};
}

}  // namespace

TEST_CASE("block-wise online softmax and merged splits equal one float64 softmax") {
  std::mt19937 rng(8);
  std::normal_distribution<float> normal;
  const int d = 16, n = 1000;
  std::vector<float> s(n);
  std::vector<std::vector<float>> v(n, std::vector<float>(d));
  for (int t = 0; t < n; ++t) {
    s[t] = normal(rng) * 4.0f + (t == 321 ? 30.0f : 0.0f);  // one dominant key
    for (float& x : v[t]) x = normal(rng);
  }
  std::vector<double> qd(1, 1.0);
  std::vector<std::vector<double>> keys(n, std::vector<double>(1)), values(n);
  for (int t = 0; t < n; ++t) {
    keys[t][0] = s[t];
    values[t].assign(v[t].begin(), v[t].end());
  }
  const auto expected = oscar::testing::naive_attention(qd, keys, values, 1.0, n);

  for (int block : {1, 7, 32, 1000}) {
    const Partial whole = partial(s, v, 0, n, block);
    CHECK(whole.lse == doctest::Approx(expected.lse).epsilon(1e-6));
    for (int i = 0; i < d; ++i) CHECK(std::abs(whole.o[i] - expected.out[i]) < 1e-5);

    for (int splits : {2, 3, 10}) {
      // Merge the splits in a scrambled order: the result must not depend on it.
      std::vector<int> order(splits);
      for (int i = 0; i < splits; ++i) order[i] = (i * 7) % splits;
      std::vector<float> o(d, 0.0f);
      float lse = -INFINITY;
      for (int k : order) {
        const Partial p = partial(s, v, k * n / splits, (k + 1) * n / splits, block);
        merge_attention_states(o.data(), lse, p.o.data(), p.lse, d);
      }
      CHECK(lse == doctest::Approx(expected.lse).epsilon(1e-6));
      for (int i = 0; i < d; ++i) CHECK(std::abs(o[i] - expected.out[i]) < 1e-5);
    }
  }
}

TEST_CASE("empty and fully masked states merge as nothing") {
  std::vector<float> o{1.0f, 2.0f};
  float lse = 0.5f;
  const std::vector<float> other{9.0f, 9.0f};
  merge_attention_states(o.data(), lse, other.data(), -INFINITY, 2);
  CHECK(o == std::vector<float>{1.0f, 2.0f});
  CHECK(lse == 0.5f);

  SoftmaxRunning state;
  std::vector<float> masked{-INFINITY, -INFINITY};
  CHECK(online_softmax_update(state, masked.data(), 2) == 1.0f);
  CHECK(masked == std::vector<float>{0.0f, 0.0f});
  CHECK(softmax_lse(state) == -INFINITY);
  std::vector<float> acc{0.0f, 0.0f};
  softmax_normalize(state, acc.data(), 2);
  CHECK(acc == std::vector<float>{0.0f, 0.0f});

  std::vector<float> o2(2, 0.0f);
  float lse2 = -INFINITY;
  merge_attention_states(o2.data(), lse2, o.data(), lse, 2);
  CHECK(o2 == o);
  CHECK(lse2 == lse);
}

TEST_CASE("a NaN score poisons its own state only") {
  SoftmaxRunning state;
  std::vector<float> s{1.0f, std::nanf(""), 2.0f};
  online_softmax_update(state, s.data(), 3);
  CHECK(std::isnan(softmax_lse(state)));
  std::vector<float> o{1.0f}, bad{std::nanf("")};
  float lse = 0.0f;
  merge_attention_states(o.data(), lse, bad.data(), std::nanf(""), 1);
  CHECK(std::isnan(o[0]));
}
