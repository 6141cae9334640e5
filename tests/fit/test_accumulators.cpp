// Streaming statistics: the sums equal the definitions (method.md §2) computed naively, chunking
// and merging change nothing but rounding, and misuse is refused with a message.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include <Eigen/Dense>

#include "fit/fit_test_util.hpp"
#include "oscar/fit/accumulators.hpp"

using namespace oscar;
using namespace oscar::fit;

namespace {

const ModelShape kShape{2, 6, 2, 64};  // g = 3

// Naive float64 definitions, one token and one head at a time.
struct Naive {
  Eigen::MatrixXd c_k;
  std::vector<Eigen::MatrixXd> a;
  Eigen::MatrixXd c_v_proxy, c_v_mass, k_moment;
};

Naive naive(const ModelShape& s, const testing::Activations& x, const std::vector<float>& mass) {
  const int d = s.head_dim, g = s.group_size();
  Naive n;
  n.c_k = Eigen::MatrixXd::Zero(d, d);
  n.k_moment = Eigen::MatrixXd::Zero(d, d);
  n.c_v_proxy = Eigen::MatrixXd::Zero(d, d);
  n.c_v_mass = Eigen::MatrixXd::Zero(d, d);
  auto row = [d](const std::vector<float>& src, int64_t index) {
    Eigen::RowVectorXd r(d);
    for (int i = 0; i < d; ++i) r[i] = src[index * d + i];
    return r;
  };
  for (int h = 0; h < s.num_kv_heads; ++h) {
    Eigen::MatrixXd a = Eigen::MatrixXd::Zero(d, d);
    for (int64_t t = 0; t < x.tokens; ++t) {
      for (int j = h * g; j < (h + 1) * g; ++j) {
        const Eigen::RowVectorXd q = row(x.q, t * s.num_qo_heads + j);
        a += q.transpose() * q;
      }
    }
    a /= static_cast<double>(x.tokens * g);
    n.a.push_back(a);
    n.c_k += a / s.num_kv_heads;
    std::vector<double> w(x.tokens);
    double wsum = 0, msum = 0;
    for (int64_t t = 0; t < x.tokens; ++t) {
      const Eigen::RowVectorXd k = row(x.k, t * s.num_kv_heads + h);
      w[t] = (k * a * k.transpose())(0, 0);
      wsum += w[t];
      msum += mass[t * s.num_kv_heads + h];
      n.k_moment += k.transpose() * k / static_cast<double>(x.tokens * s.num_kv_heads);
    }
    for (int64_t t = 0; t < x.tokens; ++t) {
      const Eigen::RowVectorXd v = row(x.v, t * s.num_kv_heads + h);
      // w <- w * T / Σw (mean 1), C_V = (1/Hkv) Σ_t w v'v / T
      n.c_v_proxy += (w[t] * x.tokens / wsum) * v.transpose() * v / static_cast<double>(x.tokens * s.num_kv_heads);
      n.c_v_mass += (static_cast<double>(mass[t * s.num_kv_heads + h]) * x.tokens / msum) * v.transpose() * v /
                    static_cast<double>(x.tokens * s.num_kv_heads);
    }
  }
  return n;
}

std::vector<float> random_mass(int64_t tokens, int heads, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::exponential_distribution<float> e(1.0f);
  std::vector<float> m(tokens * heads);
  for (float& x : m) x = e(rng);
  return m;
}

// Relative Frobenius distance. Sums of ~1e3 float64 products: 1e-12 is ~1e4 ulps of slack for
// the different summation order of GEMM vs the naive loop, far below any real error.
double rel(const Eigen::MatrixXd& a, const Eigen::MatrixXd& b) { return (a - b).norm() / b.norm(); }
constexpr double kTol = 1e-12;

CalibrationAccumulator feed(const testing::Activations& x, const std::vector<float>& mass, int64_t chunk, bool proxy) {
  auto acc = CalibrationAccumulator::create(kShape);
  REQUIRE(acc.ok());
  const int d = kShape.head_dim;
  for (int32_t l = 0; l < kShape.num_layers; ++l) {
    for (int64_t t = 0; t < x.tokens; t += chunk) {
      const int64_t n = std::min(chunk, x.tokens - t);
      REQUIRE(acc->add_chunk(l, &x.q[t * kShape.num_qo_heads * d], &x.k[t * kShape.num_kv_heads * d],
                             &x.v[t * kShape.num_kv_heads * d], n).ok());
      if (!proxy) REQUIRE(acc->add_values_weighted(l, &x.v[t * kShape.num_kv_heads * d], &mass[t * kShape.num_kv_heads], n).ok());
    }
  }
  if (proxy) {
    REQUIRE(acc->begin_value_pass().ok());
    for (int32_t l = 0; l < kShape.num_layers; ++l) {
      for (int64_t t = 0; t < x.tokens; t += chunk) {
        const int64_t n = std::min(chunk, x.tokens - t);
        REQUIRE(acc->add_values_proxy(l, &x.k[t * kShape.num_kv_heads * d], &x.v[t * kShape.num_kv_heads * d], n).ok());
      }
    }
  }
  return std::move(*acc);
}

}  // namespace

TEST_CASE("accumulated C_K, A_h, C_V and KᵀK equal their definitions") {
  const testing::Activations x = testing::make_activations(kShape, 300, 1);
  const std::vector<float> mass = random_mass(300, kShape.num_kv_heads, 2);
  const Naive n = naive(kShape, x, mass);
  for (bool proxy : {true, false}) {
    CAPTURE(proxy);
    const CalibrationAccumulator acc = feed(x, mass, 300, proxy);
    CHECK(acc.value_weighting() == (proxy ? ValueWeighting::kProxy : ValueWeighting::kAttentionMass));
    for (int32_t l = 0; l < kShape.num_layers; ++l) {
      auto st = acc.statistics(l);
      REQUIRE(st.ok());
      CHECK(st->tokens == 300);
      CHECK(rel(st->c_k, n.c_k) < kTol);
      for (int h = 0; h < kShape.num_kv_heads; ++h) CHECK(rel(st->a[h], n.a[h]) < kTol);
      CHECK(rel(st->k_moment, n.k_moment) < kTol);
      CHECK(rel(st->c_v, proxy ? n.c_v_proxy : n.c_v_mass) < kTol);
      CHECK(st->c_k.isApprox(st->c_k.transpose(), 0.0));  // exactly symmetric
    }
  }
}

TEST_CASE("chunked accumulation equals one-shot, and merged partials equal one big accumulator") {
  const testing::Activations x = testing::make_activations(kShape, 257, 3);
  const std::vector<float> mass = random_mass(257, kShape.num_kv_heads, 4);
  for (bool proxy : {true, false}) {
    CAPTURE(proxy);
    const CalibrationAccumulator one = feed(x, mass, 257, proxy);
    const CalibrationAccumulator chunked = feed(x, mass, 13, proxy);
    for (int32_t l = 0; l < kShape.num_layers; ++l) {
      auto a = one.statistics(l), b = chunked.statistics(l);
      CHECK(rel(b->c_k, a->c_k) < kTol);
      CHECK(rel(b->c_v, a->c_v) < kTol);
      CHECK(rel(b->v_moment, a->v_moment) < kTol);
    }
  }
  // Split the tokens over three "workers": pass 1 separately, merge, pass 2 from the merged A_h.
  const int d = kShape.head_dim;
  const int64_t cuts[] = {0, 100, 180, 257};
  std::vector<CalibrationAccumulator> workers;
  for (int w = 0; w < 3; ++w) {
    auto acc = CalibrationAccumulator::create(kShape);
    for (int32_t l = 0; l < kShape.num_layers; ++l) {
      REQUIRE(acc->add_chunk(l, &x.q[cuts[w] * kShape.num_qo_heads * d], &x.k[cuts[w] * kShape.num_kv_heads * d],
                             &x.v[cuts[w] * kShape.num_kv_heads * d], cuts[w + 1] - cuts[w]).ok());
    }
    workers.push_back(std::move(*acc));
  }
  auto merged = CalibrationAccumulator::create(kShape);
  for (const auto& w : workers) REQUIRE(merged->merge(w).ok());
  auto merged2 = CalibrationAccumulator::create(kShape);
  REQUIRE(merged2->merge(*merged).ok());
  for (int w = 0; w < 3; ++w) {
    REQUIRE(workers[w].begin_value_pass(*merged).ok());
    for (int32_t l = 0; l < kShape.num_layers; ++l) {
      REQUIRE(workers[w].add_values_proxy(l, &x.k[cuts[w] * kShape.num_kv_heads * d],
                                          &x.v[cuts[w] * kShape.num_kv_heads * d], cuts[w + 1] - cuts[w]).ok());
    }
  }
  auto total = CalibrationAccumulator::create(kShape);
  for (const auto& w : workers) REQUIRE(total->merge(w).ok());
  const CalibrationAccumulator one = feed(x, mass, 257, true);
  for (int32_t l = 0; l < kShape.num_layers; ++l) {
    auto a = one.statistics(l), b = total->statistics(l);
    CHECK(b->tokens == 257);
    CHECK(b->value_tokens == 257);
    CHECK(rel(b->c_k, a->c_k) < kTol);
    CHECK(rel(b->c_v, a->c_v) < kTol);
    CHECK(rel(b->k_moment, a->k_moment) < kTol);
  }
}

TEST_CASE("misuse of the accumulators is refused with a message") {
  const testing::Activations x = testing::make_activations(kShape, 8, 5);
  const std::vector<float> mass = random_mass(8, kShape.num_kv_heads, 6);
  auto acc = CalibrationAccumulator::create(kShape);
  CHECK(CalibrationAccumulator::create({1, 6, 4, 64}).status().message().find("multiple") != std::string::npos);
  const Status early = acc->add_values_proxy(0, x.k.data(), x.v.data(), 8);
  CHECK(early.code() == StatusCode::kFailedPrecondition);
  CHECK(early.message().find("begin_value_pass") != std::string::npos);
  CHECK(acc->add_chunk(2, x.q.data(), x.k.data(), x.v.data(), 8).code() == StatusCode::kOutOfRange);
  CHECK(acc->begin_value_pass().code() == StatusCode::kFailedPrecondition);  // no tokens yet
  CHECK(acc->statistics(0).status().code() == StatusCode::kFailedPrecondition);
  for (int32_t l = 0; l < 2; ++l) REQUIRE(acc->add_chunk(l, x.q.data(), x.k.data(), x.v.data(), 8).ok());
  REQUIRE(acc->add_values_weighted(0, x.v.data(), mass.data(), 8).ok());
  REQUIRE(acc->begin_value_pass().ok());
  CHECK(acc->add_chunk(0, x.q.data(), x.k.data(), x.v.data(), 8).code() == StatusCode::kFailedPrecondition);
  CHECK(acc->add_values_proxy(0, x.k.data(), x.v.data(), 8).message().find("one kind") != std::string::npos);
  std::vector<float> bad = mass;
  bad[3] = -1.0f;
  auto other = CalibrationAccumulator::create(kShape);
  CHECK(other->add_values_weighted(0, x.v.data(), bad.data(), 8).message().find("negative") != std::string::npos);
  auto wrong = CalibrationAccumulator::create({2, 6, 2, 128});
  CHECK(acc->merge(*wrong).message().find("different models") != std::string::npos);
}

TEST_CASE("one frozen A_h per value pass: no re-freezing under existing sums, merge compares it either way") {
  const testing::Activations x = testing::make_activations(kShape, 8, 5), y = testing::make_activations(kShape, 8, 9);
  auto worker = [&](const testing::Activations& a) {
    auto acc = CalibrationAccumulator::create(kShape);
    REQUIRE(acc.ok());
    for (int32_t l = 0; l < kShape.num_layers; ++l) REQUIRE(acc->add_chunk(l, a.q.data(), a.k.data(), a.v.data(), 8).ok());
    return std::move(*acc);
  };
  CalibrationAccumulator a = worker(x), b = worker(y);
  REQUIRE(a.begin_value_pass().ok());
  REQUIRE(a.begin_value_pass().ok());  // the same A_h again: a no-op
  REQUIRE(a.add_values_proxy(0, x.k.data(), x.v.data(), 8).ok());
  // Another A_h under sums weighted with the first would mix two weightings in one sum.
  CHECK(a.begin_value_pass(b).message().find("already holds value sums weighted with another frozen A_h") !=
        std::string::npos);
  CHECK(a.freeze_layer(1, b).ok());  // layer 1 holds no value sums yet
  // b froze its own A_h but added no values: merging a's proxy sums would leave b's later
  // values weighted differently from a's. Refused in either order.
  CalibrationAccumulator c = worker(y);
  REQUIRE(c.begin_value_pass().ok());
  CalibrationAccumulator a0 = worker(x);
  REQUIRE(a0.begin_value_pass().ok());
  REQUIRE(a0.add_values_proxy(0, x.k.data(), x.v.data(), 8).ok());
  CHECK(c.merge(a0).message().find("layer 0 used different frozen A_h") != std::string::npos);
  CHECK(a0.merge(c).message().find("different frozen A_h") != std::string::npos);
}
