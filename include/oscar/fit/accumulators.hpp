// Streaming calibration statistics (method.md §2), fed chunk by chunk during calibration
// prefill, so an engine never has to dump activations:
//
//   C_K = (1/Hkv) Σ_h Q_hᵀQ_h / (T·g)        GQA-grouped query second moment (key target)
//   A_h = Q_hᵀQ_h / (T·g)                     per KV head
//   C_V = (1/Hkv) Σ_h Σ_t w_{h,t} v_{h,t}ᵀv_{h,t} / Σ_t w_{h,t}     (w normalized to mean 1)
//
// plus KᵀK and VᵀV (the authors' "ktk" ablation). Query head j belongs to KV head j / g
// (contiguous groups, as in Hugging Face's repeat_kv). Everything is float64.
//
// State is kept as sums, never means, so two accumulators over disjoint tokens merge by
// addition (split calibration across processes or GPUs, then merge()). Symmetric sums are
// rank-k updates through Eigen's SYRK (selfadjointView().rankUpdate), one GEMM-shaped call
// per chunk and head, no per-token loops; only their lower triangle is maintained.
//
// The value weights. Two choices:
//  - kAttentionMass: the engine passes m_{h,t}, the attention mass that token t of KV head h
//    received (summed over the group's query heads and over the query positions that can see
//    it). Exact, and needs no A_h: one pass.
//  - kProxy: the authors' w_t = k_{h,t} A_h k_{h,t}ᵀ. It needs A_h, which is only known once
//    all queries were seen, and the 4th-order moment that would make one pass exact is d⁴
//    numbers. So it takes two passes: pass 1 (add_chunk) builds A_h; freeze it with
//    begin_value_pass() (all layers) or freeze_layer(l) (one layer, so a tool can finish a
//    layer before reading the next); pass 2 (add_values_proxy) reads the same tokens again
//    (or any representative tokens) and weights them with the frozen A_h. An engine that can run the
//    calibration prompts only once may freeze A_h after a prefix of them; the result is then
//    approximate (the weights use A_h of the prefix), which the docs say.
// Workers of a distributed calibration merge their pass-1 accumulators, then start pass 2
// from the merged A_h (begin_value_pass(merged)) so their pass-2 sums can be merged too.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <Eigen/Dense>

#include "oscar/core/status.hpp"

namespace oscar::fit {

struct ModelShape {
  int32_t num_layers = 0;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;

  int32_t group_size() const { return num_qo_heads / num_kv_heads; }
  bool operator==(const ModelShape&) const = default;
  std::string to_string() const {
    return "num_layers " + std::to_string(num_layers) + ", num_qo_heads " + std::to_string(num_qo_heads) +
           ", num_kv_heads " + std::to_string(num_kv_heads) + ", head_dim " + std::to_string(head_dim);
  }
};

inline Status validate(const ModelShape& shape) {
  if (shape.num_layers <= 0) return invalid_argument("num_layers must be positive");
  if (shape.head_dim <= 0) return invalid_argument("head_dim must be positive");
  if (shape.num_kv_heads <= 0 || shape.num_qo_heads <= 0 || shape.num_qo_heads % shape.num_kv_heads != 0) {
    return invalid_argument("num_qo_heads (" + std::to_string(shape.num_qo_heads) +
                            ") must be a positive multiple of num_kv_heads (" +
                            std::to_string(shape.num_kv_heads) + ")");
  }
  return Status::Ok();
}

enum class ValueWeighting { kNone, kProxy, kAttentionMass };

inline const char* to_string(ValueWeighting w) {
  switch (w) {
    case ValueWeighting::kNone: return "none";
    case ValueWeighting::kProxy: return "proxy";
    case ValueWeighting::kAttentionMass: return "attention_mass";
  }
  return "?";
}

// Means of one layer, ready for fitting. Matrices are full (symmetrized), d×d.
struct LayerStatistics {
  Eigen::MatrixXd c_k;             // C_K
  std::vector<Eigen::MatrixXd> a;  // A_h, [num_kv_heads]
  Eigen::MatrixXd c_v;             // C_V (empty when no value pass was run)
  Eigen::MatrixXd k_moment;        // KᵀK / (T·Hkv)
  Eigen::MatrixXd v_moment;        // VᵀV / (T·Hkv)
  int64_t tokens = 0;              // of the query pass
  int64_t value_tokens = 0;        // of the value pass
};

// The sums of one layer. Public so that tools can save and load them; invariants: matrices
// are d×d, only the lower triangle of symmetric sums is meaningful.
struct LayerSums {
  std::vector<Eigen::MatrixXd> qtq;   // [Hkv] Σ_t Σ_{j in group h} q_{j,t}ᵀ q_{j,t}
  Eigen::MatrixXd ktk, vtv;           // Σ over tokens and KV heads
  std::vector<Eigen::MatrixXd> wvtv;  // [Hkv] Σ_t w_{h,t} v_{h,t}ᵀ v_{h,t}
  Eigen::VectorXd wsum;               // [Hkv] Σ_t w_{h,t}
  int64_t tokens = 0;
  int64_t value_tokens = 0;
};

namespace detail {
inline Eigen::MatrixXd symmetrized(const Eigen::MatrixXd& lower) {
  Eigen::MatrixXd full = lower.selfadjointView<Eigen::Lower>();
  return full;
}
}  // namespace detail

class CalibrationAccumulator {
 public:
  using RowMatrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  static Result<CalibrationAccumulator> create(const ModelShape& shape) {
    OSCAR_RETURN_IF_ERROR(validate(shape));
    CalibrationAccumulator acc;
    acc.shape_ = shape;
    const int d = shape.head_dim;
    for (int32_t l = 0; l < shape.num_layers; ++l) {
      LayerSums s;
      s.qtq.assign(shape.num_kv_heads, Eigen::MatrixXd::Zero(d, d));
      s.wvtv.assign(shape.num_kv_heads, Eigen::MatrixXd::Zero(d, d));
      s.ktk = Eigen::MatrixXd::Zero(d, d);
      s.vtv = Eigen::MatrixXd::Zero(d, d);
      s.wsum = Eigen::VectorXd::Zero(shape.num_kv_heads);
      acc.layers_.push_back(std::move(s));
    }
    acc.frozen_a_.resize(shape.num_layers);
    return Result<CalibrationAccumulator>(std::move(acc));
  }

  const ModelShape& shape() const { return shape_; }
  ValueWeighting value_weighting() const { return weighting_; }
  bool value_pass_started(int32_t layer) const { return !frozen_a_[layer].empty(); }
  const LayerSums& sums(int32_t layer) const { return layers_[layer]; }
  LayerSums& mutable_sums(int32_t layer) { return layers_[layer]; }  // for loaders
  void set_value_weighting(ValueWeighting w) { weighting_ = w; }     // for loaders
  // The A_h a layer's value pass weights with, [num_kv_heads] d×d; empty before it started.
  // Saved with the sums (io/accumulator_file.hpp) so that a loaded pass-2 accumulator still
  // refuses pass-1 chunks and merges only with sums made under the same A_h.
  const std::vector<Eigen::MatrixXd>& frozen_a(int32_t layer) const { return frozen_a_[layer]; }
  Status restore_frozen_a(int32_t layer, std::vector<Eigen::MatrixXd> a) {  // for loaders
    OSCAR_RETURN_IF_ERROR(check_layer(layer, 0));
    if (a.size() != static_cast<size_t>(shape_.num_kv_heads)) {
      return invalid_argument("restore_frozen_a: " + std::to_string(a.size()) + " matrices for " +
                              std::to_string(shape_.num_kv_heads) + " KV heads");
    }
    for (const Eigen::MatrixXd& m : a) {
      if (m.rows() != shape_.head_dim || m.cols() != shape_.head_dim) {
        return invalid_argument("restore_frozen_a: a matrix is not head_dim x head_dim");
      }
    }
    frozen_a_[layer] = std::move(a);
    return Status::Ok();
  }

  // Pass 1. q: float32 [tokens, num_qo_heads, head_dim], k and v: [tokens, num_kv_heads,
  // head_dim], row-major, post-RoPE. k or v may be null (then KᵀK or VᵀV is not updated).
  Status add_chunk(int32_t layer, const float* q, const float* k, const float* v, int64_t tokens) {
    OSCAR_RETURN_IF_ERROR(check_layer(layer, tokens));
    if (tokens == 0) return Status::Ok();
    if (!q) return invalid_argument("add_chunk: q must not be null");
    if (value_pass_started(layer)) {
      return failed_precondition("add_chunk: the value pass of layer " + std::to_string(layer) +
                                 " has started; A_h is frozen");
    }
    LayerSums& s = layers_[layer];
    const int d = shape_.head_dim, g = shape_.group_size();
    for (int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      // The g query heads of KV head h are contiguous in a token's row: a (tokens*g)×d block
      // with row stride num_qo_heads*d per token, gathered into one matrix for a single SYRK.
      RowMatrix x(tokens * g, d);
      for (int64_t t = 0; t < tokens; ++t) {
        const float* src = q + (t * shape_.num_qo_heads + static_cast<int64_t>(h) * g) * d;
        for (int64_t r = 0; r < g; ++r) {
          for (int i = 0; i < d; ++i) x(t * g + r, i) = src[r * d + i];
        }
      }
      s.qtq[h].selfadjointView<Eigen::Lower>().rankUpdate(x.transpose());
    }
    if (k) s.ktk.selfadjointView<Eigen::Lower>().rankUpdate(gather_all_heads(k, tokens).transpose());
    if (v) s.vtv.selfadjointView<Eigen::Lower>().rankUpdate(gather_all_heads(v, tokens).transpose());
    s.tokens += tokens;
    return Status::Ok();
  }

  // Freezes A_h of every layer from this accumulator's own pass 1 (or from `merged`, the sum
  // of every worker's pass 1) for the proxy weights of pass 2.
  Status begin_value_pass() { return begin_value_pass(*this); }
  Status begin_value_pass(const CalibrationAccumulator& merged) {
    if (!(merged.shape_ == shape_)) return invalid_argument("begin_value_pass: accumulators of different models");
    for (int32_t l = 0; l < shape_.num_layers; ++l) {
      if (merged.layers_[l].tokens == 0) {
        return failed_precondition("begin_value_pass: layer " + std::to_string(l) + " has no query tokens");
      }
    }
    for (int32_t l = 0; l < shape_.num_layers; ++l) OSCAR_RETURN_IF_ERROR(freeze_layer(l, merged));
    return Status::Ok();
  }
  Status freeze_layer(int32_t layer) { return freeze_layer(layer, *this); }
  Status freeze_layer(int32_t layer, const CalibrationAccumulator& merged) {
    OSCAR_RETURN_IF_ERROR(check_layer(layer, 0));
    if (!(merged.shape_ == shape_)) return invalid_argument("freeze_layer: accumulators of different models");
    const LayerSums& s = merged.layers_[layer];
    if (s.tokens == 0) {
      return failed_precondition("freeze_layer: layer " + std::to_string(layer) + " has no query tokens");
    }
    std::vector<Eigen::MatrixXd> frozen;
    for (int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      frozen.push_back(detail::symmetrized(s.qtq[h]) / (static_cast<double>(s.tokens) * shape_.group_size()));
    }
    // Once values were weighted with the frozen A_h, another one would mix two weightings in
    // one sum (the file would record only the last).
    if (layers_[layer].value_tokens > 0 && value_pass_started(layer) && frozen != frozen_a_[layer]) {
      return failed_precondition("freeze_layer: layer " + std::to_string(layer) +
                                 " already holds value sums weighted with another frozen A_h");
    }
    frozen_a_[layer] = std::move(frozen);
    return Status::Ok();
  }

  // Pass 2 with the authors' proxy weights w_t = k A_h kᵀ. k, v: float32 [tokens, Hkv, d].
  Status add_values_proxy(int32_t layer, const float* k, const float* v, int64_t tokens) {
    OSCAR_RETURN_IF_ERROR(check_layer(layer, tokens));
    if (!value_pass_started(layer)) {
      return failed_precondition("add_values_proxy: call begin_value_pass() or freeze_layer() first (A_h of layer " +
                                 std::to_string(layer) + " must be frozen)");
    }
    OSCAR_RETURN_IF_ERROR(set_weighting(ValueWeighting::kProxy));
    if (tokens == 0) return Status::Ok();
    if (!k || !v) return invalid_argument("add_values_proxy: k and v must not be null");
    LayerSums& s = layers_[layer];
    for (int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      const RowMatrix kh = gather_head(k, tokens, h);
      const Eigen::VectorXd w = ((kh * frozen_a_[layer][h]).cwiseProduct(kh)).rowwise().sum();
      add_weighted(s, h, gather_head(v, tokens, h), w);
    }
    s.value_tokens += tokens;
    return Status::Ok();
  }

  // Value pass with exact attention masses: weights float32 [tokens, Hkv], >= 0. No A_h is
  // needed, so this may run in the same pass as add_chunk.
  Status add_values_weighted(int32_t layer, const float* v, const float* weights, int64_t tokens) {
    OSCAR_RETURN_IF_ERROR(check_layer(layer, tokens));
    OSCAR_RETURN_IF_ERROR(set_weighting(ValueWeighting::kAttentionMass));
    if (tokens == 0) return Status::Ok();
    if (!v || !weights) return invalid_argument("add_values_weighted: v and weights must not be null");
    LayerSums& s = layers_[layer];
    for (int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      Eigen::VectorXd w(tokens);
      for (int64_t t = 0; t < tokens; ++t) {
        const float m = weights[t * shape_.num_kv_heads + h];
        if (!(m >= 0.0f) || !std::isfinite(m)) {
          return invalid_argument("add_values_weighted: weight of token " + std::to_string(t) + ", kv head " +
                                  std::to_string(h) + " is negative or not finite");
        }
        w[t] = m;
      }
      add_weighted(s, h, gather_head(v, tokens, h), w);
    }
    s.value_tokens += tokens;
    return Status::Ok();
  }

  // this += other, over disjoint tokens.
  Status merge(const CalibrationAccumulator& other) {
    if (!(other.shape_ == shape_)) {
      return invalid_argument("merge: accumulators of different models (" + shape_.to_string() + " vs " +
                              other.shape_.to_string() + ")");
    }
    if (weighting_ != ValueWeighting::kNone && other.weighting_ != ValueWeighting::kNone &&
        weighting_ != other.weighting_) {
      return invalid_argument(std::string("merge: value weights differ (") + to_string(weighting_) + " vs " +
                              to_string(other.weighting_) + ")");
    }
    // Where both sides froze a layer's A_h, they must agree, whether or not values were added
    // yet: values added later on either side are weighted with it.
    for (int32_t l = 0; l < shape_.num_layers; ++l) {
      if (!frozen_a_[l].empty() && !other.frozen_a_[l].empty() && frozen_a_[l] != other.frozen_a_[l]) {
        return invalid_argument("merge: the value passes of layer " + std::to_string(l) +
                                " used different frozen A_h; start every worker's value pass from the same merged "
                                "accumulator");
      }
    }
    for (int32_t l = 0; l < shape_.num_layers; ++l) {
      LayerSums& a = layers_[l];
      const LayerSums& b = other.layers_[l];
      for (int32_t h = 0; h < shape_.num_kv_heads; ++h) {
        a.qtq[h] += b.qtq[h];
        a.wvtv[h] += b.wvtv[h];
      }
      a.ktk += b.ktk;
      a.vtv += b.vtv;
      a.wsum += b.wsum;
      a.tokens += b.tokens;
      a.value_tokens += b.value_tokens;
    }
    if (weighting_ == ValueWeighting::kNone) weighting_ = other.weighting_;
    for (int32_t l = 0; l < shape_.num_layers; ++l) {
      if (frozen_a_[l].empty()) frozen_a_[l] = other.frozen_a_[l];
    }
    return Status::Ok();
  }

  // The means of one layer.
  Result<LayerStatistics> statistics(int32_t layer) const {
    if (layer < 0 || layer >= shape_.num_layers) return out_of_range("statistics: layer " + std::to_string(layer));
    const LayerSums& s = layers_[layer];
    if (s.tokens == 0) return failed_precondition("layer " + std::to_string(layer) + ": no calibration tokens");
    LayerStatistics st;
    const int d = shape_.head_dim;
    const double tg = static_cast<double>(s.tokens) * shape_.group_size();
    st.c_k = Eigen::MatrixXd::Zero(d, d);
    for (int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      st.a.push_back(detail::symmetrized(s.qtq[h]) / tg);
      st.c_k += st.a.back();
    }
    st.c_k /= shape_.num_kv_heads;
    const double th = static_cast<double>(s.tokens) * shape_.num_kv_heads;
    st.k_moment = detail::symmetrized(s.ktk) / th;
    st.v_moment = detail::symmetrized(s.vtv) / th;
    if (s.value_tokens > 0) {
      st.c_v = Eigen::MatrixXd::Zero(d, d);
      for (int32_t h = 0; h < shape_.num_kv_heads; ++h) {
        // Normalizing w to mean 1 per head and dividing by T is dividing by Σ_t w.
        if (s.wsum[h] > 0) st.c_v += detail::symmetrized(s.wvtv[h]) / s.wsum[h];
      }
      st.c_v /= shape_.num_kv_heads;
    }
    st.tokens = s.tokens;
    st.value_tokens = s.value_tokens;
    return Result<LayerStatistics>(std::move(st));
  }

 private:
  Status check_layer(int32_t layer, int64_t tokens) const {
    if (layer < 0 || layer >= shape_.num_layers) {
      return out_of_range("layer " + std::to_string(layer) + " outside 0.." + std::to_string(shape_.num_layers - 1));
    }
    if (tokens < 0) return invalid_argument("tokens must be >= 0");
    return Status::Ok();
  }
  Status set_weighting(ValueWeighting w) {
    if (weighting_ != ValueWeighting::kNone && weighting_ != w) {
      return failed_precondition(std::string("value weights already accumulated as ") + to_string(weighting_) +
                                 "; one accumulator holds one kind");
    }
    weighting_ = w;
    return Status::Ok();
  }
  // All KV heads of a chunk as (tokens*Hkv)×d: the layout already is that matrix.
  RowMatrix gather_all_heads(const float* x, int64_t tokens) const {
    const int64_t rows = tokens * shape_.num_kv_heads;
    return Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
               x, rows, shape_.head_dim)
        .cast<double>();
  }
  RowMatrix gather_head(const float* x, int64_t tokens, int32_t h) const {
    const int d = shape_.head_dim;
    using Stride = Eigen::OuterStride<>;
    return Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, 0, Stride>(
               x + static_cast<int64_t>(h) * d, tokens, d, Stride(static_cast<int64_t>(shape_.num_kv_heads) * d))
        .cast<double>();
  }
  static void add_weighted(LayerSums& s, int32_t h, const RowMatrix& v, const Eigen::VectorXd& w) {
    // Σ_t w_t v_tᵀv_t = (√w∘V)ᵀ(√w∘V): one SYRK (weights are >= 0: masses, or kAkᵀ with A PSD;
    // rounding can make kAkᵀ a tiny negative, clamped to 0).
    const RowMatrix scaled = w.cwiseMax(0.0).cwiseSqrt().asDiagonal() * v;
    s.wvtv[h].selfadjointView<Eigen::Lower>().rankUpdate(scaled.transpose());
    s.wsum[h] += w.cwiseMax(0.0).sum();
  }

  ModelShape shape_;
  std::vector<LayerSums> layers_;
  ValueWeighting weighting_ = ValueWeighting::kNone;
  std::vector<std::vector<Eigen::MatrixXd>> frozen_a_;  // [layer][kv head]; empty: not frozen
};

}  // namespace oscar::fit
