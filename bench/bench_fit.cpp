// Cost of offline fitting at Qwen3-8B scale (36 layers, 32 query / 8 KV heads, d = 128,
// 30,000 calibration tokens): the fit from accumulated statistics plus held-out tokens (the
// 60 s target of docs/benchmarks.md), and the accumulation itself, per layer.
// Synthetic data: the cost does not depend on the values.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "common/random.hpp"
#include "oscar/fit/accumulators.hpp"
#include "oscar/fit/fit_plan.hpp"
#include "oscar/io/plan_file.hpp"

namespace {

using namespace oscar;

constexpr fit::ModelShape kQwen3_8B{36, 32, 8, 128};
constexpr int64_t kCalibrationTokens = 30000;
constexpr int64_t kHeldOutTokens = 1024;  // oscar-fit's default cap per layer

Eigen::MatrixXd random_moment(int d, std::mt19937_64& rng) {
  std::normal_distribution<double> normal;
  Eigen::MatrixXd b(d, d);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) b(i, j) = normal(rng) * std::pow(0.97, j);
  }
  return b * b.transpose() / d;
}

std::vector<float> gaussian(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// End to end from statistics: 72 eigen-decompositions, the clip search over the default grid
// (16 ratios) for K and V on 1024 held-out tokens x 8 heads, the Hadamard baseline, plan
// validation and an atomic save.
void BM_FitQwen3_8B(benchmark::State& state) {
  const fit::ModelShape s = kQwen3_8B;
  std::mt19937_64 rng(1);
  std::vector<fit::LayerStatistics> stats(s.num_layers);
  std::vector<fit::HeldOutLayer> held(s.num_layers);
  for (int32_t l = 0; l < s.num_layers; ++l) {
    fit::LayerStatistics& st = stats[l];
    st.c_k = Eigen::MatrixXd::Zero(s.head_dim, s.head_dim);
    for (int h = 0; h < s.num_kv_heads; ++h) {
      st.a.push_back(random_moment(s.head_dim, rng));
      st.c_k += st.a.back() / s.num_kv_heads;
    }
    st.c_v = random_moment(s.head_dim, rng);
    st.k_moment = random_moment(s.head_dim, rng);
    st.v_moment = random_moment(s.head_dim, rng);
    st.tokens = st.value_tokens = kCalibrationTokens - kHeldOutTokens;
    held[l].tokens = kHeldOutTokens;
    held[l].k = gaussian(kHeldOutTokens * s.num_kv_heads * s.head_dim, rng);
    held[l].v = gaussian(held[l].k.size(), rng);
  }
  fit::FitOptions options;
  options.threads = static_cast<int>(state.range(0));
  const std::string path =
      (std::filesystem::temp_directory_path() / ("bench_fit_" + std::to_string(::getpid()) + ".safetensors")).string();
  for (auto _ : state) {
    auto result = fit::fit_plan(s, stats, held, options);
    if (!result.ok()) {
      state.SkipWithError(result.status().to_string().c_str());
      break;
    }
    const Status saved = io::save_plan(result->plan, path);
    if (!saved.ok()) state.SkipWithError(saved.to_string().c_str());
  }
  std::filesystem::remove(path);
  state.counters["layers"] = s.num_layers;
}
BENCHMARK(BM_FitQwen3_8B)->Arg(1)->Arg(2)->Unit(benchmark::kSecond)->Iterations(1)->UseRealTime();

// Accumulating one layer's 30,000 tokens (both passes: C_K/A_h, KᵀK, VᵀV, proxy-weighted C_V),
// in chunks of 2048 tokens. An engine pays this during calibration prefill, once per layer.
void BM_AccumulateLayerQwen3_8B(benchmark::State& state) {
  const fit::ModelShape s{1, kQwen3_8B.num_qo_heads, kQwen3_8B.num_kv_heads, kQwen3_8B.head_dim};
  constexpr int64_t chunk = 2048;
  std::mt19937_64 rng(2);
  const std::vector<float> q = gaussian(chunk * s.num_qo_heads * s.head_dim, rng);
  const std::vector<float> k = gaussian(chunk * s.num_kv_heads * s.head_dim, rng);
  const std::vector<float> v = gaussian(k.size(), rng);
  for (auto _ : state) {
    auto acc = fit::CalibrationAccumulator::create(s);
    for (int64_t t = 0; t < kCalibrationTokens; t += chunk) {
      const int64_t n = std::min(chunk, kCalibrationTokens - t);
      if (!acc->add_chunk(0, q.data(), k.data(), v.data(), n).ok()) state.SkipWithError("add_chunk");
    }
    if (!acc->freeze_layer(0).ok()) state.SkipWithError("freeze_layer");
    for (int64_t t = 0; t < kCalibrationTokens; t += chunk) {
      const int64_t n = std::min(chunk, kCalibrationTokens - t);
      if (!acc->add_values_proxy(0, k.data(), v.data(), n).ok()) state.SkipWithError("add_values_proxy");
    }
    benchmark::DoNotOptimize(acc->sums(0).qtq[0].data());
  }
  state.counters["tokens"] = kCalibrationTokens;
}
BENCHMARK(BM_AccumulateLayerQwen3_8B)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
