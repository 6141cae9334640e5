// Per-layer fidelity of a KV cache method on real activations (method.md §5): the exact
// post-RoPE q/k/v of one sequence, the K and V the method's cache would hold for it, and how
// attention over them differs from exact attention.
//
// What the cache holds is built with the library's functors, row by row, exactly as
// PagedCache::write builds it: input rounded to bf16, rotate_row by the layer's R, rounded to
// bf16, then either kept (BF16 sink and window, by oscar::segment_counts at the sequence's
// final length) or quantize_row / dequantize_row (INT2, with the layer's clip rank); int4
// and kivi use the simulated formats of simulated_cache.hpp. Rows are un-rotated (·Rᵀ, in
// double) for the metrics: the metrics are basis-independent, and exact attention is in the
// model's basis. The scored queries are the last `num_queries` positions, against the cache
// state at the end of the sequence (they all sit in the recent window when num_queries ≤ the
// window), each attending causally.
//
// Metrics, per layer, averaged over query heads and queries:
//   logit_rel_err   ‖Q(K̂−K)ᵀ‖_F / ‖QKᵀ‖_F over every (query, visible key)
//   score_snr_db    10·log10(Σ (s − s̄)² / Σ (ŝ − s)²) per query row (centered: softmax
//                   ignores a shift), averaged in dB
//   attn_kl         KL(softmax(s) ‖ softmax(ŝ)), nats
//   out_rel_err     ‖Ô − O‖_F / ‖O‖_F of the attention output, all heads
//   out_wo_rel_err  the same after W_O (what the residual stream receives)
//   top{1,8,32}     |top-k(p) ∩ top-k(p̂)| / k
// The needle (attention level): a span of random tokens planted early (in the INT2 region)
// and repeated at the end. Heads whose exact attention from the repeat puts at least
// kRetrievalMass of its mass on the planted span are retrieval heads; per method we report
// the share of (retrieval head, query) pairs whose top-1 key is still in the span, and the
// mass the span keeps relative to exact attention.
#pragma once

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cache_methods.hpp"
#include "llama.hpp"
#include "oscar/core/numeric.hpp"
#include "oscar/quant/clip.hpp"
#include "oscar/quant/format.hpp"
#include "oscar/quant/row.hpp"
#include "oscar/rotate/dense.hpp"
#include "simulated_cache.hpp"

namespace oscar::decode {

inline constexpr double kRetrievalMass = 0.3;

// One sequence's exact activations, per layer: q [T, Hq*d], k and v [T, Hkv*d].
struct LayerActivations {
  std::vector<RowMatrix> q, k, v;
};

inline Result<LayerActivations> capture_activations(const LlamaWeights& w, const std::vector<int32_t>& ids,
                                                    int64_t chunk_tokens = 256) {
  const LlamaConfig& c = w.config;
  const auto T = static_cast<Eigen::Index>(ids.size());
  LayerActivations a;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    a.q.emplace_back(T, static_cast<Eigen::Index>(c.num_qo_heads) * c.head_dim);
    a.k.emplace_back(T, static_cast<Eigen::Index>(c.num_kv_heads) * c.head_dim);
    a.v.emplace_back(T, static_cast<Eigen::Index>(c.num_kv_heads) * c.head_dim);
  }
  ExactKvCache cache(c, T);
  for (Eigen::Index start = 0; start < T; start += chunk_tokens) {
    const Eigen::Index n = std::min<Eigen::Index>(chunk_tokens, T - start);
    const LayerObserver observer = [&](int32_t l, const RowMatrix& q, const RowMatrix& k, const RowMatrix& v) {
      a.q[l].middleRows(start, n) = q;
      a.k[l].middleRows(start, n) = k;
      a.v[l].middleRows(start, n) = v;
    };
    auto logits = forward(w, cache, std::vector<int32_t>(ids.begin() + start, ids.begin() + start + n), true, &observer);
    if (!logits.ok()) return logits.status();
  }
  return Result<LayerActivations>(std::move(a));
}

struct LayerFidelity {
  double logit_rel_err = 0, score_snr_db = 0, attn_kl = 0, out_rel_err = 0, out_wo_rel_err = 0;
  double top1 = 0, top8 = 0, top32 = 0;
  // needle
  int32_t retrieval_heads = 0;
  double needle_top1 = 0, needle_mass_ratio = 0;
};

struct CacheGeometry {
  int32_t sink_tokens = 64;
  int32_t recent_tokens = 256;
  int32_t page_size = 16;
};

// The rows of one KV head of one tensor as the method's cache holds them, in the model's
// basis: x [T, d] exact -> [T, d].
inline Eigen::MatrixXd cached_rows(CacheMethod method, const host::LayerQuantizer* quantizer, bool keys,
                                   const Eigen::Ref<const RowMatrix>& x, const CacheGeometry& g) {
  const auto T = x.rows();
  const int d = static_cast<int>(x.cols());
  const SegmentCounts counts = segment_counts(T, g.sink_tokens, g.recent_tokens, g.page_size);
  const int64_t int2_begin = counts.sink, int2_end = counts.sink + counts.int2;
  RowMatrix out(T, d);
  for (Eigen::Index t = 0; t < T; ++t) {
    for (int i = 0; i < d; ++i) out(t, i) = round_to_bf16(x(t, i));
  }
  if (method == CacheMethod::kBf16 || method == CacheMethod::kExact) return out.cast<double>();
  if (method == CacheMethod::kInt4) {
    for (int64_t t = int2_begin; t < int2_end; ++t) fake_quantize_int4(out.row(t).data(), d);
    return out.cast<double>();
  }
  if (method == CacheMethod::kKivi) {
    if (keys) {
      for (int64_t s = int2_begin; s + kKiviTokenGroup <= int2_end; s += kKiviTokenGroup) {
        for (int i = 0; i < d; ++i) fake_quantize_int2_column(&out(s, i), kKiviTokenGroup, d);
      }
    } else {
      for (int64_t t = int2_begin; t < int2_end; ++t) fake_quantize_int2_row(out.row(t).data(), d);
    }
    return out.cast<double>();
  }
  // The paged INT2 methods: rotate, round, quantize, reconstruct, un-rotate.
  const std::vector<float>& r = keys ? quantizer->k_rotation : quantizer->v_rotation;
  const int clip_k = clip_rank(keys ? quantizer->k_clip_ratio : quantizer->v_clip_ratio, d);
  Eigen::MatrixXd rotated(T, d);
  std::vector<float> y(static_cast<size_t>(d));
  std::vector<uint8_t> packed(static_cast<size_t>(d / 4));
  QuantMeta meta[1];
  for (Eigen::Index t = 0; t < T; ++t) {
    if (r.empty()) {
      for (int i = 0; i < d; ++i) y[i] = out(t, i);
    } else {
      rotate_row(out.row(t).data(), r.data(), d, y.data());
      for (int i = 0; i < d; ++i) y[i] = round_to_bf16(y[i]);
    }
    if (t >= int2_begin && t < int2_end) {
      quantize_row(y.data(), d, d, clip_k, packed.data(), meta);
      dequantize_row(packed.data(), meta, d, d, y.data());
    }
    for (int i = 0; i < d; ++i) rotated(t, i) = y[i];
  }
  if (r.empty()) return rotated;
  const Eigen::MatrixXd rd =
      Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(r.data(), d, d).cast<double>();
  return rotated * rd.transpose();
}

// Softmax attention of query rows q [n, d] at positions first..first+n-1 over keys [T, d].
struct HeadAttention {
  Eigen::MatrixXd scores;  // [n, T], scaled; masked entries -inf
  Eigen::MatrixXd probs;   // [n, T]
  Eigen::MatrixXd out;     // [n, d]
};
inline HeadAttention attend_head(const Eigen::MatrixXd& q, const Eigen::MatrixXd& k, const Eigen::MatrixXd& v,
                                 int64_t first) {
  HeadAttention a;
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.cols()));
  a.scores = (q * k.transpose()) * scale;
  a.probs.resize(a.scores.rows(), a.scores.cols());
  for (Eigen::Index i = 0; i < a.scores.rows(); ++i) {
    const Eigen::Index visible = first + i + 1;
    for (Eigen::Index j = visible; j < a.scores.cols(); ++j) a.scores(i, j) = -INFINITY;
    const double m = a.scores.row(i).head(visible).maxCoeff();
    double sum = 0;
    for (Eigen::Index j = 0; j < a.scores.cols(); ++j) {
      a.probs(i, j) = j < visible ? std::exp(a.scores(i, j) - m) : 0.0;
      sum += a.probs(i, j);
    }
    a.probs.row(i) /= sum;
  }
  a.out = a.probs * v;
  return a;
}

inline std::vector<Eigen::Index> top_k(const Eigen::RowVectorXd& p, int k) {
  std::vector<Eigen::Index> idx(static_cast<size_t>(p.size()));
  for (Eigen::Index i = 0; i < p.size(); ++i) idx[static_cast<size_t>(i)] = i;
  k = std::min<int>(k, static_cast<int>(idx.size()));
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](Eigen::Index a, Eigen::Index b) { return p(a) > p(b); });
  idx.resize(static_cast<size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

// The needle's span and queries in a sequence (see the top of this file).
struct NeedleSpec {
  int64_t span_begin = 0, span_end = 0;  // planted keys
  int64_t first_query = 0;               // queries: first_query .. T-1 (the repeat, minus its first token)
};

// Metrics of one method in one layer. `needle`/`needle_spec` may be null (no needle test).
inline Result<LayerFidelity> layer_fidelity(CacheMethod method, const host::LayerQuantizer* quantizer,
                                            const LlamaLayer& weights, const LlamaConfig& c, const RowMatrix& q,
                                            const RowMatrix& k, const RowMatrix& v, int64_t num_queries,
                                            const CacheGeometry& g, const LayerActivations* needle = nullptr,
                                            const NeedleSpec* spec = nullptr, int32_t layer = 0) {
  const int d = c.head_dim, group = c.num_qo_heads / c.num_kv_heads;
  const auto T = q.rows();
  const int64_t nq = std::min<int64_t>(num_queries, T);
  const int64_t first = T - nq;
  LayerFidelity f;
  double noise = 0, signal = 0, out_err = 0, out_norm = 0;
  Eigen::MatrixXd o_exact(nq, static_cast<Eigen::Index>(c.num_qo_heads) * d), o_hat(nq, o_exact.cols());
  int64_t rows = 0;
  for (int32_t kvh = 0; kvh < c.num_kv_heads; ++kvh) {
    const auto kx = k.middleCols(static_cast<Eigen::Index>(kvh) * d, d);
    const auto vx = v.middleCols(static_cast<Eigen::Index>(kvh) * d, d);
    const Eigen::MatrixXd ke = kx.cast<double>(), ve = vx.cast<double>();
    const Eigen::MatrixXd kc = cached_rows(method, quantizer, true, kx, g);
    const Eigen::MatrixXd vc = cached_rows(method, quantizer, false, vx, g);
    for (int32_t j = 0; j < group; ++j) {
      const int32_t h = kvh * group + j;
      const Eigen::MatrixXd qh = q.block(first, static_cast<Eigen::Index>(h) * d, nq, d).cast<double>();
      const HeadAttention ex = attend_head(qh, ke, ve, first);
      const HeadAttention qa = attend_head(qh, kc, vc, first);
      o_exact.middleCols(static_cast<Eigen::Index>(h) * d, d) = ex.out;
      o_hat.middleCols(static_cast<Eigen::Index>(h) * d, d) = qa.out;
      for (Eigen::Index i = 0; i < nq; ++i) {
        const Eigen::Index visible = first + i + 1;
        const Eigen::RowVectorXd s = ex.scores.row(i).head(visible), sh = qa.scores.row(i).head(visible);
        const double e2 = (sh - s).squaredNorm();
        noise += e2;
        signal += s.squaredNorm();
        const double centered = (s.array() - s.mean()).square().sum();
        f.score_snr_db += 10.0 * std::log10(centered / std::max(e2, 1e-300));
        double kl = 0;
        for (Eigen::Index t = 0; t < visible; ++t) {
          const double p = ex.probs(i, t);
          if (p > 0) kl += p * (std::log(p) - std::log(std::max(qa.probs(i, t), 1e-300)));
        }
        f.attn_kl += kl;
        for (int kk : {1, 8, 32}) {
          const auto a = top_k(ex.probs.row(i).head(visible), kk), b = top_k(qa.probs.row(i).head(visible), kk);
          std::vector<Eigen::Index> common;
          std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(common));
          const double overlap = static_cast<double>(common.size()) / static_cast<double>(a.size());
          (kk == 1 ? f.top1 : kk == 8 ? f.top8 : f.top32) += overlap;
        }
        ++rows;
      }
    }
  }
  out_err = (o_hat - o_exact).squaredNorm();
  out_norm = o_exact.squaredNorm();
  const Eigen::MatrixXd wo = weights.wo.cast<double>();
  const Eigen::MatrixXd y_exact = o_exact * wo.transpose(), y_hat = o_hat * wo.transpose();
  f.logit_rel_err = std::sqrt(noise / signal);
  f.score_snr_db /= static_cast<double>(rows);
  f.attn_kl /= static_cast<double>(rows);
  f.top1 /= static_cast<double>(rows);
  f.top8 /= static_cast<double>(rows);
  f.top32 /= static_cast<double>(rows);
  f.out_rel_err = std::sqrt(out_err / out_norm);
  f.out_wo_rel_err = std::sqrt((y_hat - y_exact).squaredNorm() / y_exact.squaredNorm());

  if (needle && spec) {
    const RowMatrix& nq_ = needle->q[static_cast<size_t>(layer)];
    const RowMatrix& nk = needle->k[static_cast<size_t>(layer)];
    const RowMatrix& nv = needle->v[static_cast<size_t>(layer)];
    const int64_t n_first = spec->first_query, n_count = nq_.rows() - spec->first_query;
    int64_t pairs = 0;
    double hits = 0, mass_ratio = 0;
    for (int32_t kvh = 0; kvh < c.num_kv_heads; ++kvh) {
      const auto kx = nk.middleCols(static_cast<Eigen::Index>(kvh) * d, d);
      const auto vx = nv.middleCols(static_cast<Eigen::Index>(kvh) * d, d);
      const Eigen::MatrixXd ke = kx.cast<double>(), ve = vx.cast<double>();
      const Eigen::MatrixXd kc = cached_rows(method, quantizer, true, kx, g);
      for (int32_t j = 0; j < group; ++j) {
        const int32_t h = kvh * group + j;
        const Eigen::MatrixXd qh = nq_.block(n_first, static_cast<Eigen::Index>(h) * d, n_count, d).cast<double>();
        const HeadAttention ex = attend_head(qh, ke, ve, n_first);
        double exact_mass = 0;
        for (Eigen::Index i = 0; i < n_count; ++i) {
          exact_mass += ex.probs.row(i).segment(spec->span_begin, spec->span_end - spec->span_begin).sum();
        }
        exact_mass /= static_cast<double>(n_count);
        if (exact_mass < kRetrievalMass) continue;
        ++f.retrieval_heads;
        const HeadAttention qa = attend_head(qh, kc, ve, n_first);
        double mass = 0;
        for (Eigen::Index i = 0; i < n_count; ++i) {
          Eigen::Index best = 0;
          qa.probs.row(i).maxCoeff(&best);
          hits += best >= spec->span_begin && best < spec->span_end;
          mass += qa.probs.row(i).segment(spec->span_begin, spec->span_end - spec->span_begin).sum();
          ++pairs;
        }
        mass_ratio += mass / static_cast<double>(n_count) / exact_mass;
      }
    }
    if (f.retrieval_heads > 0) {
      f.needle_top1 = hits / static_cast<double>(pairs);
      f.needle_mass_ratio = mass_ratio / f.retrieval_heads;
    }
  }
  return f;
}

}  // namespace oscar::decode
