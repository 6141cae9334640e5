// oscar-demo: the paged INT2 cache end to end on the CPU, on synthetic attention data.
//
// Keys and queries are drawn with the structure that makes INT2 hard in practice: a few
// outlier key channels, and queries that concentrate on a few directions which the keys'
// large channels do not align with. Three caches are filled with the same post-RoPE K/V and
// queried with the same decode queries; each is compared with exact float64 attention on the
// unquantized K/V:
//   naive INT2     no rotation, no clipping
//   Hadamard INT2  normalized Walsh-Hadamard rotation (QuaRot-style), no clipping
//   OSCAR          R_K = eig(C_Q)·H, R_V = eig(score-weighted C_V)·H, fitted on a separate
//                  calibration draw, clip ratios 0.96 / 0.92 (the authors' fixed values)
// This is a demonstration on synthetic data; quality claims come from the real-model report.
#include <Eigen/Dense>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "oscar/host/paged_cache.hpp"
#include "oscar/rotate/hadamard.hpp"

namespace {

using oscar::bf16_t;
using oscar::host::CacheConfig;
using oscar::host::LayerQuantizer;
using oscar::host::PagedCache;
using oscar::host::RequestId;

constexpr int kHeadDim = 128;
constexpr int kKvHeads = 2;
constexpr int kQoHeads = 8;  // GQA group of 4

// A synthetic attention "layer": queries live mostly in a low-dimensional subspace; keys have
// outlier channels and a component aligned with that subspace (so scores carry signal).
struct SyntheticLayer {
  Eigen::MatrixXd query_basis;  // [d, d] orthogonal
  Eigen::VectorXd query_scale;  // per basis direction
  Eigen::VectorXd key_channel_scale;
  std::mt19937_64 rng;

  explicit SyntheticLayer(uint64_t seed) : rng(seed) {
    std::normal_distribution<double> normal;
    Eigen::MatrixXd g(kHeadDim, kHeadDim);
    for (int i = 0; i < g.size(); ++i) g.data()[i] = normal(rng);
    query_basis = Eigen::HouseholderQR<Eigen::MatrixXd>(g).householderQ();
    query_scale.resize(kHeadDim);
    for (int i = 0; i < kHeadDim; ++i) query_scale[i] = 4.0 * std::exp(-i / 6.0) + 0.05;
    key_channel_scale = Eigen::VectorXd::Ones(kHeadDim);
    for (int c : {3, 40, 77, 100, 101}) key_channel_scale[c] = 10.0;
  }
  Eigen::VectorXd query() {
    std::normal_distribution<double> normal;
    Eigen::VectorXd z(kHeadDim);
    for (int i = 0; i < kHeadDim; ++i) z[i] = normal(rng) * query_scale[i];
    return query_basis * z;
  }
  Eigen::VectorXd key() {
    std::normal_distribution<double> normal;
    Eigen::VectorXd k(kHeadDim), z(kHeadDim);
    for (int i = 0; i < kHeadDim; ++i) k[i] = normal(rng) * key_channel_scale[i];
    for (int i = 0; i < kHeadDim; ++i) z[i] = normal(rng) * (i < 8 ? 4.0 : 0.0);
    return k + query_basis * z;
  }
  // Values share a mean direction (as real heads' values do) plus channel-scaled noise.
  Eigen::VectorXd value() {
    std::normal_distribution<double> normal;
    Eigen::VectorXd v(kHeadDim);
    for (int i = 0; i < kHeadDim; ++i) v[i] = std::sin(0.3 * i) + normal(rng) * (i % 16 == 0 ? 6.0 : 1.0);
    return v;
  }
};

double bf16(double x) { return oscar::round_to_bf16(static_cast<float>(x)); }

Eigen::MatrixXd hadamard() {
  Eigen::MatrixXd h(kHeadDim, kHeadDim);
  for (int i = 0; i < kHeadDim; ++i)
    for (int j = 0; j < kHeadDim; ++j) h(i, j) = oscar::hadamard_entry(i, j, kHeadDim);
  return h;
}

// Eigenvectors by descending eigenvalue, times H: every rotated coordinate gets an equal
// share of every eigen-direction.
Eigen::MatrixXd spectral_rotation(const Eigen::MatrixXd& covariance) {
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> eig(covariance);
  Eigen::MatrixXd u = eig.eigenvectors().rowwise().reverse();
  return u * hadamard();
}

std::vector<float> to_row_major(const Eigen::MatrixXd& m) {
  std::vector<float> r(m.size());
  for (int i = 0; i < m.rows(); ++i)
    for (int j = 0; j < m.cols(); ++j) r[i * m.cols() + j] = static_cast<float>(m(i, j));
  return r;
}

struct Method {
  std::string name;
  LayerQuantizer quantizer;
};


}  // namespace

int main(int argc, char** argv) {
  int context = 16384;
  if (argc > 1) context = std::atoi(argv[1]);
  if (context < 1 || context > 1 << 20) {
    std::fprintf(stderr, "usage: oscar-demo [context_tokens]  (1 .. 1048576, default 16384)\n");
    return 2;
  }
  const int kQueries = 16;

  // Calibration draw (for fitting) and evaluation draw (for measuring), same distribution.
  SyntheticLayer calib(1), eval(1);
  eval.rng.seed(2);
  const int calib_tokens = 4096;
  Eigen::MatrixXd cq = Eigen::MatrixXd::Zero(kHeadDim, kHeadDim);
  for (int t = 0; t < calib_tokens * kQoHeads / kKvHeads; ++t) {
    const Eigen::VectorXd q = calib.query();
    cq += q * q.transpose();
  }
  cq /= calib_tokens * kQoHeads / kKvHeads;
  Eigen::MatrixXd cv = Eigen::MatrixXd::Zero(kHeadDim, kHeadDim);
  double weight_sum = 0;
  for (int t = 0; t < calib_tokens; ++t) {
    const Eigen::VectorXd k = calib.key(), v = calib.value();
    const double w = k.dot(cq * k);  // the authors' proxy weight k A kᵀ
    cv += w * v * v.transpose();
    weight_sum += w;
  }
  cv /= weight_sum;

  std::vector<Method> methods(3);
  methods[0].name = "naive INT2";
  methods[1].name = "Hadamard INT2";
  methods[1].quantizer.k_rotation = methods[1].quantizer.v_rotation = to_row_major(hadamard());
  methods[2].name = "OSCAR";
  methods[2].quantizer.k_rotation = to_row_major(spectral_rotation(cq));
  methods[2].quantizer.v_rotation = to_row_major(spectral_rotation(cv));
  methods[2].quantizer.k_clip_ratio = 0.96f;
  methods[2].quantizer.v_clip_ratio = 0.92f;

  // The evaluation sequence: post-RoPE K/V for every KV head, stored as bf16.
  std::vector<bf16_t> k(size_t(context) * kKvHeads * kHeadDim), v(k.size());
  std::vector<Eigen::MatrixXd> exact_k(kKvHeads, Eigen::MatrixXd(context, kHeadDim)), exact_v = exact_k;
  for (int t = 0; t < context; ++t) {
    for (int h = 0; h < kKvHeads; ++h) {
      const Eigen::VectorXd kr = eval.key(), vr = eval.value();
      for (int i = 0; i < kHeadDim; ++i) {
        const size_t at = (size_t(t) * kKvHeads + h) * kHeadDim + i;
        k[at] = oscar::float_to_bf16(static_cast<float>(kr[i]));
        v[at] = oscar::float_to_bf16(static_cast<float>(vr[i]));
        exact_k[h](t, i) = bf16(kr[i]);
        exact_v[h](t, i) = bf16(vr[i]);
      }
    }
  }
  std::vector<float> queries(size_t(kQueries) * kQoHeads * kHeadDim);
  for (int r = 0; r < kQueries * kQoHeads; ++r) {
    const Eigen::VectorXd q = eval.query();
    for (int i = 0; i < kHeadDim; ++i) queries[size_t(r) * kHeadDim + i] = static_cast<float>(bf16(q[i]));
  }

  CacheConfig config;
  config.num_qo_heads = kQoHeads;
  config.num_kv_heads = kKvHeads;
  config.head_dim = kHeadDim;
  config.page_size = 16;
  config.sink_tokens = 64;
  config.recent_tokens = 256;
  config.num_int2_pages = context / config.page_size + 1;
  config.num_bf16_pages = (config.sink_tokens + config.recent_tokens) / config.page_size + 4;

  std::printf("oscar-demo: synthetic layer, context %d tokens, head_dim %d, %d query / %d KV heads, "
              "sink %d, recent window %d, page %d\n",
              context, kHeadDim, kQoHeads, kKvHeads, config.sink_tokens, config.recent_tokens, config.page_size);
  std::printf("%-15s %12s %14s %12s %22s\n", "cache", "bits/elem", "bytes/token", "vs BF16", "attn output rel. error");

  const double scale = 1.0 / std::sqrt(double(kHeadDim));
  for (const Method& method : methods) {
    auto cache = PagedCache::create(config, {method.quantizer});
    if (!cache.ok()) {
      std::fprintf(stderr, "oscar-demo: %s\n", cache.status().to_string().c_str());
      return 1;
    }
    auto id = cache->add_request();
    const std::vector<RequestId> ids{*id};
    if (oscar::Status s = cache->append(ids, std::vector<int32_t>{context}, k.data(), v.data()); !s.ok()) {
      std::fprintf(stderr, "oscar-demo: %s\n", s.to_string().c_str());
      return 1;
    }
    double error_sum = 0;
    int count = 0;
    std::vector<float> out(size_t(kQoHeads) * kHeadDim);
    for (int qi = 0; qi < kQueries; ++qi) {
      const float* q = queries.data() + size_t(qi) * kQoHeads * kHeadDim;
      if (oscar::Status s = cache->decode(0, ids, q, out.data(), nullptr); !s.ok()) {
        std::fprintf(stderr, "oscar-demo: %s\n", s.to_string().c_str());
        return 1;
      }
      for (int h = 0; h < kQoHeads; ++h) {
        const int kv = h / (kQoHeads / kKvHeads);
        Eigen::VectorXd qd(kHeadDim);
        for (int i = 0; i < kHeadDim; ++i) qd[i] = q[h * kHeadDim + i];
        Eigen::VectorXd s = exact_k[kv] * qd * scale;
        const double m = s.maxCoeff();
        Eigen::VectorXd p = (s.array() - m).exp();
        p /= p.sum();
        const Eigen::VectorXd exact = exact_v[kv].transpose() * p;
        Eigen::VectorXd got(kHeadDim);
        for (int i = 0; i < kHeadDim; ++i) got[i] = out[h * kHeadDim + i];
        error_sum += (got - exact).norm() / exact.norm();
        ++count;
      }
    }
    const oscar::StorageCost cost = oscar::storage_cost(cache->int2_layout(), cache->segments(*id));
    std::printf("%-15s %12.3f %14.1f %11.2fx %22.4f\n", method.name.c_str(), cost.bits_per_element,
                cost.bytes_per_token * kKvHeads, cost.compression_vs_bf16, error_sum / count);
  }
  std::printf("(bytes/token: K and V of the %d KV heads of one layer; error: mean over %d queries x %d heads)\n",
              kKvHeads, kQueries, kQoHeads);
  return 0;
}
