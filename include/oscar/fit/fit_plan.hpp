// End to end: calibration statistics + held-out tokens -> a validated Plan, with a per-layer
// report (spectrum spread, chosen ratios, J_K and J_V against the Hadamard baseline).
// Layers are independent, so they are fitted in parallel on `threads` std::threads (each
// layer single-threaded: Eigen is not built with OpenMP here).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <Eigen/Dense>

#include "oscar/core/status.hpp"
#include "oscar/fit/accumulators.hpp"
#include "oscar/fit/clip_search.hpp"
#include "oscar/fit/rotations.hpp"
#include "oscar/io/plan_file.hpp"

namespace oscar::fit {

// Held-out calibration tokens of one layer (not part of the statistics), post-RoPE.
struct HeldOutLayer {
  int64_t tokens = 0;
  std::vector<float> k;              // [tokens, num_kv_heads, head_dim]
  std::vector<float> v;              // [tokens, num_kv_heads, head_dim]
  std::vector<float> value_weights;  // optional attention masses [tokens, num_kv_heads]; empty: proxy w_t
};

struct FitOptions {
  RotationMethod method = RotationMethod::kOscar;
  bool fit_clip = true;  // false: the fixed ratios below for every layer
  float fixed_k_clip_ratio = kAuthorsKeyClipRatio;
  float fixed_v_clip_ratio = kAuthorsValueClipRatio;
  std::vector<float> clip_grid = default_clip_grid();
  bool bit_reversal = true;
  uint64_t seed = 0;  // random_hadamard signs
  int32_t quant_group_size = 0;
  int32_t sink_tokens = 64;
  int32_t recent_tokens = 256;
  std::string model_name;
  int threads = 0;  // 0: std::thread::hardware_concurrency()
};

struct LayerReport {
  int32_t layer = 0;
  double k_spread = 0, v_spread = 0;  // max λ / mean λ of the targets (0: method uses none)
  float k_clip_ratio = 1, v_clip_ratio = 1;
  // Objectives on held-out tokens (NaN without held-out tokens), and those of the baseline:
  // normalized Hadamard with the authors' fixed ratios.
  double j_k = std::numeric_limits<double>::quiet_NaN(), j_v = std::numeric_limits<double>::quiet_NaN();
  double j_k_hadamard = std::numeric_limits<double>::quiet_NaN(), j_v_hadamard = std::numeric_limits<double>::quiet_NaN();
};

struct FitResult {
  io::Plan plan;
  std::vector<LayerReport> reports;
};

namespace detail {

inline uint64_t mix_seed(uint64_t seed, uint64_t stream) {  // splitmix64
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (stream + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline std::vector<float> to_f32(const Eigen::MatrixXd& r) {
  const int d = static_cast<int>(r.rows());
  std::vector<float> out(static_cast<size_t>(d) * d);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) out[static_cast<size_t>(i) * d + j] = static_cast<float>(r(i, j));
  }
  return out;
}

inline Eigen::MatrixXd from_f32(const std::vector<float>& r, int d) {
  return Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(r.data(), d, d)
      .cast<double>();
}

struct TensorFit {
  std::vector<float> rotation;
  double spread = 0;
};

inline Result<TensorFit> fit_rotation(RotationMethod method, const Eigen::MatrixXd* target, int d, uint64_t seed,
                                      bool bit_reversal, const std::string& what) {
  TensorFit out;
  switch (method) {
    case RotationMethod::kIdentity: out.rotation = to_f32(Eigen::MatrixXd::Identity(d, d)); break;
    case RotationMethod::kHadamard: out.rotation = to_f32(hadamard_matrix(d)); break;
    case RotationMethod::kRandomHadamard: out.rotation = to_f32(random_hadamard(d, seed)); break;
    case RotationMethod::kOscar:
    case RotationMethod::kKtk: {
      if (!target || target->rows() != d) return failed_precondition(what + ": no statistics for this method");
      auto s = spectral_rotation(*target, bit_reversal);
      if (!s.ok()) return Status(s.status().code(), what + ": " + s.status().message());
      out.rotation = to_f32(s->rotation);
      out.spread = spectrum_spread(s->eigenvalues);
      break;
    }
  }
  return Result<TensorFit>(std::move(out));
}

struct Objectives {
  const std::vector<Eigen::MatrixXd>* a;
  const HeldOutLayer* held;
  int32_t heads;
  int d;
  int quant_group_size;

  std::vector<Eigen::MatrixXd> key_metric(const std::vector<float>& rotation) const {
    const Eigen::MatrixXd r = from_f32(rotation, d);
    std::vector<Eigen::MatrixXd> m;
    for (const Eigen::MatrixXd& ah : *a) m.push_back(r.transpose() * ah * r);
    return m;
  }
  Eigen::VectorXd value_weights() const {
    return held->value_weights.empty() ? proxy_value_weights(held->k.data(), held->tokens, *a)
                                       : normalized_weights(held->value_weights.data(), held->tokens, heads);
  }
};

}  // namespace detail

// Fits one layer. `held` may be null when options.fit_clip is false (no report objectives).
inline Result<std::pair<io::PlanLayer, LayerReport>> fit_layer(int32_t layer, const ModelShape& shape,
                                                               const LayerStatistics& stats, const HeldOutLayer* held,
                                                               const FitOptions& options) {
  const int d = shape.head_dim;
  const std::string where = "layer " + std::to_string(layer);
  const bool ktk = options.method == RotationMethod::kKtk;
  const Eigen::MatrixXd* k_target = ktk ? &stats.k_moment : &stats.c_k;
  const Eigen::MatrixXd* v_target = ktk ? &stats.v_moment : &stats.c_v;
  if (options.method == RotationMethod::kOscar && stats.c_v.size() == 0) {
    return failed_precondition(where + ": no value statistics (C_V); run the value pass before fitting");
  }
  // A NaN or Inf in the activations makes every clip objective NaN, and the search would keep
  // its first grid ratio without a word (the spectral methods refuse their target; A_h also
  // weights the key objective of every method): refused here, by name.
  for (const Eigen::MatrixXd& a : stats.a) {
    if (!a.allFinite()) return invalid_argument(where + ": A_h has a NaN or Inf entry (non-finite calibration queries)");
  }
  if (held) {
    const auto finite = [](const std::vector<float>& x) {
      return std::all_of(x.begin(), x.end(), [](float v) { return std::isfinite(v); });
    };
    if (!finite(held->k) || !finite(held->v) || !finite(held->value_weights)) {
      return invalid_argument(where + ": the held-out k, v or value weights have a NaN or Inf entry");
    }
  }
  auto kf = detail::fit_rotation(options.method, k_target, d, detail::mix_seed(options.seed, 2ull * layer),
                                 options.bit_reversal, where + " k_rotation");
  if (!kf.ok()) return kf.status();
  auto vf = detail::fit_rotation(options.method, v_target, d, detail::mix_seed(options.seed, 2ull * layer + 1),
                                 options.bit_reversal, where + " v_rotation");
  if (!vf.ok()) return vf.status();

  io::PlanLayer out;
  out.k_rotation = std::move(kf->rotation);
  out.v_rotation = std::move(vf->rotation);
  out.k_clip_ratio = options.fixed_k_clip_ratio;
  out.v_clip_ratio = options.fixed_v_clip_ratio;
  LayerReport report;
  report.layer = layer;
  report.k_spread = kf->spread;
  report.v_spread = vf->spread;

  if (held && held->tokens > 0) {
    const size_t n = static_cast<size_t>(held->tokens) * shape.num_kv_heads * d;
    if (held->k.size() != n || held->v.size() != n ||
        (!held->value_weights.empty() && held->value_weights.size() != n / d)) {
      return invalid_argument(where + ": held-out k/v/value_weights sizes do not match " +
                              std::to_string(held->tokens) + " tokens");
    }
    const detail::Objectives obj{&stats.a, held, shape.num_kv_heads, d, options.quant_group_size};
    const Eigen::VectorXd weights = obj.value_weights();
    auto evaluate = [&](const std::vector<float>& k_rot, const std::vector<float>& v_rot, bool search, float k_fixed,
                        float v_fixed, float* k_rho, float* v_rho, double* jk, double* jv) -> Status {
      auto kr = rotate_rows(held->k.data(), held->tokens, shape.num_kv_heads, d, k_rot);
      if (!kr.ok()) return kr.status();
      auto vr = rotate_rows(held->v.data(), held->tokens, shape.num_kv_heads, d, v_rot);
      if (!vr.ok()) return vr.status();
      const std::vector<Eigen::MatrixXd> metric = obj.key_metric(k_rot);
      auto key_j = [&](const RowMatrixXd& e) { return key_objective(e, metric); };
      auto value_j = [&](const RowMatrixXd& e) { return value_objective(e, weights, shape.num_kv_heads); };
      const std::vector<float> k_grid = search ? options.clip_grid : std::vector<float>{k_fixed};
      const std::vector<float> v_grid = search ? options.clip_grid : std::vector<float>{v_fixed};
      auto kc = search_clip_ratio(*kr, options.quant_group_size, k_grid, key_j);
      if (!kc.ok()) return kc.status();
      auto vc = search_clip_ratio(*vr, options.quant_group_size, v_grid, value_j);
      if (!vc.ok()) return vc.status();
      *k_rho = kc->ratio;
      *v_rho = vc->ratio;
      *jk = kc->objective;
      *jv = vc->objective;
      return Status::Ok();
    };
    OSCAR_RETURN_IF_ERROR(evaluate(out.k_rotation, out.v_rotation, options.fit_clip, options.fixed_k_clip_ratio,
                                   options.fixed_v_clip_ratio, &out.k_clip_ratio, &out.v_clip_ratio, &report.j_k,
                                   &report.j_v));
    const std::vector<float> h = detail::to_f32(hadamard_matrix(d));
    float unused_k = 0, unused_v = 0;
    OSCAR_RETURN_IF_ERROR(evaluate(h, h, false, kAuthorsKeyClipRatio, kAuthorsValueClipRatio, &unused_k, &unused_v,
                                   &report.j_k_hadamard, &report.j_v_hadamard));
  } else if (options.fit_clip) {
    return invalid_argument(where + ": clip search needs held-out tokens (or use fixed clip ratios)");
  }
  report.k_clip_ratio = out.k_clip_ratio;
  report.v_clip_ratio = out.v_clip_ratio;
  return std::pair{std::move(out), report};
}

// Fits every layer. held_out: one entry per layer, or empty with options.fit_clip = false.
// `progress` (optional) is called once per finished layer, from the fitting threads, serialized.
inline Result<FitResult> fit_plan(const ModelShape& shape, const std::vector<LayerStatistics>& stats,
                                  const std::vector<HeldOutLayer>& held_out, const FitOptions& options,
                                  const std::function<void(const LayerReport&)>& progress = {}) {
  OSCAR_RETURN_IF_ERROR(validate(shape));
  if (stats.size() != static_cast<size_t>(shape.num_layers)) {
    return invalid_argument("fit_plan: " + std::to_string(stats.size()) + " layer statistics for " +
                            std::to_string(shape.num_layers) + " layers");
  }
  if (!held_out.empty() && held_out.size() != stats.size()) {
    return invalid_argument("fit_plan: " + std::to_string(held_out.size()) + " held-out layers for " +
                            std::to_string(shape.num_layers) + " layers");
  }
  if (!is_supported_head_dim(shape.head_dim)) {
    return unsupported("head_dim " + std::to_string(shape.head_dim) + " is not supported (64, 128, 256)");
  }
  if (options.quant_group_size != 0 && !is_supported_quant_group(shape.head_dim, options.quant_group_size)) {
    return invalid_argument("quant_group_size " + std::to_string(options.quant_group_size) + " is not supported");
  }
  for (int32_t l = 0; l < shape.num_layers; ++l) {
    if (stats[l].c_k.rows() != shape.head_dim || static_cast<int32_t>(stats[l].a.size()) != shape.num_kv_heads) {
      return invalid_argument("fit_plan: layer " + std::to_string(l) + " statistics do not match the model shape");
    }
  }
  FitResult result;
  io::Plan& plan = result.plan;
  plan.method = to_string(options.method);
  plan.clip_method = options.fit_clip ? "fitted" : "fixed";
  plan.head_dim = shape.head_dim;
  plan.num_layers = shape.num_layers;
  plan.num_qo_heads = shape.num_qo_heads;
  plan.num_kv_heads = shape.num_kv_heads;
  plan.quant_group_size = options.quant_group_size;
  plan.sink_tokens = options.sink_tokens;
  plan.recent_tokens = options.recent_tokens;
  plan.model_name = options.model_name;
  plan.calibration_tokens = stats[0].tokens;
  plan.layers.resize(shape.num_layers);
  result.reports.resize(shape.num_layers);

  std::vector<Status> statuses(shape.num_layers);
  std::atomic<int32_t> next{0};
  std::mutex progress_mutex;
  auto worker = [&] {
    for (int32_t l = next++; l < shape.num_layers; l = next++) {
      auto fitted = fit_layer(l, shape, stats[l], held_out.empty() ? nullptr : &held_out[l], options);
      if (!fitted.ok()) {
        statuses[l] = fitted.status();
        continue;
      }
      plan.layers[l] = std::move(fitted->first);
      result.reports[l] = fitted->second;
      if (progress) {
        const std::lock_guard<std::mutex> lock(progress_mutex);
        progress(result.reports[l]);
      }
    }
  };
  int threads = options.threads > 0 ? options.threads : static_cast<int>(std::thread::hardware_concurrency());
  threads = std::clamp(threads, 1, shape.num_layers);
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  for (const Status& s : statuses) OSCAR_RETURN_IF_ERROR(s);
  OSCAR_RETURN_IF_ERROR(io::validate(plan));
  return Result<FitResult>(std::move(result));
}

}  // namespace oscar::fit
