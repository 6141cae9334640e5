// A Llama forward pass on the CPU (RMSNorm, RoPE, GQA attention, SwiGLU), float32 with Eigen
// for the matrix work, and the KV caches it attends through.
//
// Attention goes through the abstract KvCache (kv_cache.hpp), one step at a time.
// K is stored after RoPE; queries are rotated with RoPE at their own positions before
// attend(), so the cache never needs positions (method.md §1). Two implementations:
//   ExactKvCache  float32 K/V, plain softmax attention: the reference for tests;
//   PagedKvCache  oscar::host::PagedCache with one request: BF16 sink and window, INT2 middle,
//                 per-layer rotations and clip ratios (LayerQuantizer). K/V are rounded to
//                 bf16 when handed to write(), as an engine holding bf16 activations would.
//
// RoPE layout: HF Llama rotates pairs (i, i + head_dim/2) ("half split"); llama.cpp's GGUF
// converter permutes the rows of W_Q/W_K so that its adjacent-pair RoPE gives the same scores.
// The GGUF loader undoes that permutation (unpermute_rope_rows), so the post-RoPE K the cache
// sees is exactly HF's, channel for channel: rotations fitted from HF activations apply as is.
// llama2.c models (TinyStories) were trained with adjacent pairs and keep them.
#pragma once

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gguf.hpp"
#include "kv_cache.hpp"
#include "oscar/core/numeric.hpp"
#include "oscar/core/status.hpp"
#include "oscar/host/attention_blocked.hpp"
#include "oscar/host/paged_cache.hpp"
#include "oscar/quant/format.hpp"

namespace oscar::decode {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

enum class RopeStyle { kAdjacentPairs, kHalfSplit };

struct LlamaConfig {
  int32_t hidden = 0;
  int32_t intermediate = 0;
  int32_t num_layers = 0;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t vocab_size = 0;
  int32_t max_seq_len = 0;
  float rope_base = 10000.0f;
  float rms_eps = 1e-5f;
  RopeStyle rope_style = RopeStyle::kHalfSplit;
};

// Matrices are row-major [out, in]: y = W x.
struct LlamaLayer {
  Eigen::VectorXf attn_norm, ffn_norm;  // [hidden]
  RowMatrix wq;      // [num_qo_heads * head_dim, hidden]
  RowMatrix wk, wv;  // [num_kv_heads * head_dim, hidden]
  RowMatrix wo;      // [hidden, num_qo_heads * head_dim]
  RowMatrix w_gate, w_up;  // [intermediate, hidden]
  RowMatrix w_down;        // [hidden, intermediate]
};

struct LlamaWeights {
  LlamaConfig config;
  RowMatrix embedding;  // [vocab, hidden]
  std::vector<LlamaLayer> layers;
  Eigen::VectorXf final_norm;
  RowMatrix output;  // [vocab, hidden]; empty when tied to the embedding
  const RowMatrix& output_matrix() const { return output.size() ? output : embedding; }
};

inline Status validate(const LlamaConfig& c) {
  if (c.hidden <= 0 || c.intermediate <= 0 || c.num_layers <= 0 || c.num_qo_heads <= 0 ||
      c.num_kv_heads <= 0 || c.head_dim <= 0 || c.vocab_size <= 0 || c.head_dim % 2 != 0 ||
      c.num_qo_heads % c.num_kv_heads != 0) {
    return data_loss("model hyper-parameters are inconsistent (hidden " + std::to_string(c.hidden) +
                     ", heads " + std::to_string(c.num_qo_heads) + "/" + std::to_string(c.num_kv_heads) +
                     ", head_dim " + std::to_string(c.head_dim) + ")");
  }
  return Status::Ok();
}

// The library's paged cache in this model's shape (layers, heads, head_dim), one quantization
// group per row: what a plan must match (io::check_plan_matches); the page geometry is
// paged_cache_config's.
inline host::CacheConfig cache_shape(const LlamaConfig& model) {
  host::CacheConfig c;
  c.num_layers = model.num_layers;
  c.num_qo_heads = model.num_qo_heads;
  c.num_kv_heads = model.num_kv_heads;
  c.head_dim = model.head_dim;
  c.quant_group_size = 0;
  return c;
}

// ---- KV caches ------------------------------------------------------------------------------

// Rows kept as floats, every token of every layer and KV head, with plain softmax attention
// over them: the storage the exact cache and the simulated caches (simulated_cache.hpp) share.
class FloatRowsCache : public KvCache {
 public:
  FloatRowsCache(const LlamaConfig& config, int64_t capacity)
      : num_kv_heads_(config.num_kv_heads), num_qo_heads_(config.num_qo_heads), head_dim_(config.head_dim),
        num_layers_(config.num_layers), capacity_(capacity), k_(config.num_layers), v_(config.num_layers) {
    for (int32_t l = 0; l < config.num_layers; ++l) {
      k_[l].assign(static_cast<size_t>(num_kv_heads_), RowMatrix(capacity, head_dim_));
      v_[l].assign(static_cast<size_t>(num_kv_heads_), RowMatrix(capacity, head_dim_));
    }
  }
  Status begin_step(int32_t n) override {
    if (length_ + n > capacity_) {
      return resource_exhausted("context full: " + std::to_string(length_ + n) + " tokens > " +
                                std::to_string(capacity_));
    }
    step_ = n;
    length_ += n;
    return Status::Ok();
  }
  Status end_step() override {
    step_ = 0;
    return Status::Ok();
  }
  int64_t length() const override { return length_; }

 protected:
  // Stores the step's rows (k, v as write() takes them), each value through `round`.
  template <class Round>
  void store_step(int32_t layer, const float* k, const float* v, Round round) {
    const int64_t first = length_ - step_;
    for (int32_t t = 0; t < step_; ++t) {
      for (int32_t h = 0; h < num_kv_heads_; ++h) {
        const int64_t off = (static_cast<int64_t>(t) * num_kv_heads_ + h) * head_dim_;
        for (int32_t i = 0; i < head_dim_; ++i) {
          k_[layer][h](first + t, i) = round(k[off + i]);
          v_[layer][h](first + t, i) = round(v[off + i]);
        }
      }
    }
  }
  // Softmax attention of the step's queries over the stored rows, one query and head at a time,
  // each query seeing the keys up to its own position.
  void attend_each_query(int32_t layer, const float* q, float* out) const {
    const int32_t group = num_qo_heads_ / num_kv_heads_;
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
    const int64_t first = length_ - step_;
    for (int32_t t = 0; t < step_; ++t) {
      const int64_t keys = first + t + 1;
      for (int32_t h = 0; h < num_qo_heads_; ++h) {
        const int32_t kvh = h / group;
        const int64_t off = (static_cast<int64_t>(t) * num_qo_heads_ + h) * head_dim_;
        Eigen::Map<const Eigen::VectorXf> qv(q + off, head_dim_);
        Eigen::VectorXf s = (k_[layer][kvh].topRows(keys) * qv) * scale;
        const float m = s.maxCoeff();
        s = (s.array() - m).exp();
        s /= s.sum();
        Eigen::Map<Eigen::RowVectorXf>(out + off, head_dim_) = s.transpose() * v_[layer][kvh].topRows(keys);
      }
    }
  }

  int32_t num_kv_heads_, num_qo_heads_, head_dim_, num_layers_;
  int64_t capacity_;
  int64_t length_ = 0;
  int32_t step_ = 0;
  std::vector<std::vector<RowMatrix>> k_, v_;  // [layer][kv head] -> [capacity, head_dim]
};

class ExactKvCache final : public FloatRowsCache {
 public:
  using FloatRowsCache::FloatRowsCache;
  Status write(int32_t layer, const float* k, const float* v) override {
    store_step(layer, k, v, [](float x) { return x; });
    return Status::Ok();
  }
  Status attend(int32_t layer, const float* q, float* out) override {
    if (step_ <= 1) {
      attend_each_query(layer, q, out);
      return Status::Ok();
    }
    // A chunk of queries: one matrix product per head over all visible keys, the causal mask
    // applied to the scores (calibration and the evaluator prefill long texts here).
    const int32_t group = num_qo_heads_ / num_kv_heads_;
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
    const int64_t first = length_ - step_;
    using Map = Eigen::Map<const RowMatrix, 0, Eigen::OuterStride<>>;
    using MapOut = Eigen::Map<RowMatrix, 0, Eigen::OuterStride<>>;
    const int64_t keys = length_;
    const Eigen::Index stride = static_cast<Eigen::Index>(num_qo_heads_) * head_dim_;
    for (int32_t h = 0; h < num_qo_heads_; ++h) {
      const int32_t kvh = h / group;
      const Map qh(q + static_cast<int64_t>(h) * head_dim_, step_, head_dim_, Eigen::OuterStride<>(stride));
      RowMatrix s = (qh * k_[layer][kvh].topRows(keys).transpose()) * scale;
      for (int32_t t = 0; t < step_; ++t) {
        const Eigen::Index visible = first + t + 1;
        auto row = s.row(t);
        const float m = row.head(visible).maxCoeff();
        row.head(visible) = (row.head(visible).array() - m).exp();
        row.tail(keys - visible).setZero();
        row /= row.sum();
      }
      MapOut(out + static_cast<int64_t>(h) * head_dim_, step_, head_dim_, Eigen::OuterStride<>(stride)) =
          s * v_[layer][kvh].topRows(keys);
    }
    return Status::Ok();
  }
  double bytes_per_token() const override { return 2.0 * 4.0 * head_dim_ * num_kv_heads_ * num_layers_; }
};

// The library's paged cache, one request. Pools are sized for `capacity` tokens.
class PagedKvCache final : public KvCache {
 public:
  static Result<std::unique_ptr<PagedKvCache>> create(const LlamaConfig& model, int64_t capacity,
                                                      int32_t sink_tokens, int32_t recent_tokens,
                                                      int32_t page_size,
                                                      std::vector<host::LayerQuantizer> layers,
                                                      int32_t max_requests = 1) {
    auto config = paged_cache_config(cache_shape(model), capacity, sink_tokens, recent_tokens, page_size,
                                     max_requests);
    if (!config.ok()) return config.status();
    auto cache = host::PagedCache::create(*config, std::move(layers));
    if (!cache.ok()) return cache.status();
    std::unique_ptr<PagedKvCache> out(new PagedKvCache(std::move(*cache), capacity));
    auto request = out->cache_.add_request();
    if (!request.ok()) return request.status();
    out->request_ = *request;
    out->lengths_[*request] = 0;
    return out;
  }

  // Prefix sharing: a new request holding the active request's tokens (its full pages shared
  // by reference count, PagedCache::fork_request), made the active one. Both stay alive.
  Result<host::RequestId> fork_active() {
    auto child = cache_.fork_request(request_);
    if (!child.ok()) return child.status();
    lengths_[*child] = length_;
    request_ = *child;
    return *child;
  }
  // Later steps go to request `id` (from create() or fork_active()).
  Status activate(host::RequestId id) {
    if (step_ != 0) return failed_precondition("activate: a step is open");
    const auto it = lengths_.find(id);
    if (it == lengths_.end()) return out_of_range("request " + std::to_string(id) + " does not exist");
    lengths_[request_] = length_;
    request_ = id;
    length_ = it->second;
    return Status::Ok();
  }
  host::RequestId active_request() const { return request_; }

  Status begin_step(int32_t n) override {
    if (length_ + n > capacity_) {
      return resource_exhausted("context full: " + std::to_string(length_ + n) + " tokens > " +
                                std::to_string(capacity_));
    }
    const int32_t counts[1] = {n};
    auto plan = cache_.plan_append(std::span<const host::RequestId>(&request_, 1), counts);
    if (!plan.ok()) return plan.status();
    plan_ = std::move(*plan);
    step_ = n;
    length_ += n;
    return Status::Ok();
  }
  Status write(int32_t layer, const float* k, const float* v) override {
    const auto& c = cache_.config();
    const size_t count = static_cast<size_t>(step_) * c.num_kv_heads * c.head_dim;
    rows_to_bf16(k, count, k_bf16_);
    rows_to_bf16(v, count, v_bf16_);
    return cache_.write(layer, plan_, k_bf16_.data(), v_bf16_.data());
  }
  Status attend(int32_t layer, const float* q, float* out) override {
    const host::RequestId requests[1] = {request_};
    // The attention products are small (a few dozen query rows × one key block): Eigen's
    // OpenMP threads, set by --threads for the model's matrix products, would only add
    // fork/join overhead to each, or oversubscribe the cores when the blocked path runs its
    // own threads. Single-threaded Eigen for the call; the path parallelizes if asked to.
    const int eigen_threads = Eigen::nbThreads();
    Eigen::setNbThreads(1);
    Status status;
    if (step_ == 1) {
      status = cache_.decode(layer, requests, q, out, nullptr, attention_);
    } else {
      const int32_t counts[1] = {step_};
      status = cache_.extend(layer, requests, counts, q, out, nullptr, attention_);
    }
    Eigen::setNbThreads(eigen_threads);
    return status;
  }
  // The attention path of decode/extend: by default the blocked one (host/attention_blocked.hpp),
  // single-threaded; AttentionOptions{} runs the scalar reference.
  void set_attention(host::AttentionOptions options) { attention_ = std::move(options); }
  Status end_step() override {
    step_ = 0;
    lengths_[request_] = length_;
    return cache_.finish(plan_);
  }
  int64_t length() const override { return length_; }
  double bytes_per_token() const override { return paged_bytes_per_token(cache_.config(), length_); }
  const host::PagedCache& cache() const { return cache_; }

 private:
  PagedKvCache(host::PagedCache cache, int64_t capacity) : cache_(std::move(cache)), capacity_(capacity) {}
  host::PagedCache cache_;
  int64_t capacity_;
  host::RequestId request_ = 0;
  host::WritePlan plan_;
  int64_t length_ = 0;
  int32_t step_ = 0;
  std::map<host::RequestId, int64_t> lengths_;  // every live request's length
  std::vector<bf16_t> k_bf16_, v_bf16_;
  host::AttentionOptions attention_{.path = host::blocked_attention()};
};

// ---- forward ------------------------------------------------------------------------------

inline void rms_norm(const RowMatrix& x, const Eigen::VectorXf& weight, float eps, RowMatrix& out) {
  out.resize(x.rows(), x.cols());
  for (Eigen::Index r = 0; r < x.rows(); ++r) {
    const float ms = x.row(r).squaredNorm() / static_cast<float>(x.cols());
    out.row(r) = x.row(r).cwiseProduct(weight.transpose()) * (1.0f / std::sqrt(ms + eps));
  }
}

// Rotates each head of `x` ([tokens, heads * head_dim]) in place; row t is at position
// first + t % period (period: the tokens of one sequence when several are stacked; 0 = all rows).
inline void apply_rope(RowMatrix& x, int32_t heads, const LlamaConfig& c, int64_t first, Eigen::Index period = 0) {
  const int32_t d = c.head_dim;
  const int32_t half = d / 2;
  if (period <= 0) period = x.rows();
  for (Eigen::Index t = 0; t < x.rows(); ++t) {
    const double pos = static_cast<double>(first + t % period);
    for (int32_t i = 0; i < half; ++i) {
      // The angle in double: at position 8000 a float angle would be off by ~1e-3 rad.
      const double freq = std::pow(static_cast<double>(c.rope_base), -2.0 * i / d);
      const double angle = pos * freq;
      const float cs = static_cast<float>(std::cos(angle)), sn = static_cast<float>(std::sin(angle));
      for (int32_t h = 0; h < heads; ++h) {
        float* row = x.row(t).data() + static_cast<int64_t>(h) * d;
        const int32_t a = c.rope_style == RopeStyle::kAdjacentPairs ? 2 * i : i;
        const int32_t b = c.rope_style == RopeStyle::kAdjacentPairs ? 2 * i + 1 : i + half;
        const float x0 = row[a], x1 = row[b];
        row[a] = x0 * cs - x1 * sn;
        row[b] = x0 * sn + x1 * cs;
      }
    }
  }
}

// Sees each layer's post-RoPE activations of a step, as the cache receives them:
// q [tokens, num_qo_heads * head_dim], k and v [tokens, num_kv_heads * head_dim], row-major.
// Calibration and the dumps read the model through it.
using LayerObserver = std::function<void(int32_t layer, const RowMatrix& q, const RowMatrix& k, const RowMatrix& v)>;

// Runs `tokens` (the next tokens of the sequence in each cache) through the model once per
// cache, in lockstep: every cache holds the same number of tokens and gets the same new ones
// (teacher forcing), so the weight products are shared (one matrix-matrix product over all
// caches' rows) while each cache stores and attends on its own. Returns one logits matrix
// per cache, [tokens, vocab] (or only of the last token when last_only). The observer, if
// any, sees the first cache's activations.
inline Result<std::vector<RowMatrix>> forward_lockstep(const LlamaWeights& w, const std::vector<KvCache*>& caches,
                                                       const std::vector<int32_t>& tokens, bool last_only = false,
                                                       const LayerObserver* observer = nullptr) {
  const LlamaConfig& c = w.config;
  const auto n = static_cast<Eigen::Index>(tokens.size());
  const auto b = static_cast<Eigen::Index>(caches.size());
  if (n == 0) return invalid_argument("forward: no tokens");
  if (b == 0) return invalid_argument("forward: no cache");
  const int64_t first = caches[0]->length();
  for (KvCache* cache : caches) {
    if (cache->length() != first) return failed_precondition("forward_lockstep: caches of different lengths");
  }
  RowMatrix x(n * b, c.hidden);
  for (Eigen::Index t = 0; t < n; ++t) {
    const int32_t id = tokens[static_cast<size_t>(t)];
    if (id < 0 || id >= c.vocab_size) {
      return out_of_range("token id " + std::to_string(id) + " outside the vocabulary of " +
                          std::to_string(c.vocab_size));
    }
    for (Eigen::Index i = 0; i < b; ++i) x.row(i * n + t) = w.embedding.row(id);
  }
  for (KvCache* cache : caches) OSCAR_RETURN_IF_ERROR(cache->begin_step(static_cast<int32_t>(n)));
  const int64_t qw = static_cast<int64_t>(c.num_qo_heads) * c.head_dim;
  const int64_t kw = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  RowMatrix xn, q, k, v, attn(n * b, qw), gate, up;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const LlamaLayer& L = w.layers[static_cast<size_t>(l)];
    rms_norm(x, L.attn_norm, c.rms_eps, xn);
    q.noalias() = xn * L.wq.transpose();
    k.noalias() = xn * L.wk.transpose();
    v.noalias() = xn * L.wv.transpose();
    apply_rope(q, c.num_qo_heads, c, first, n);
    apply_rope(k, c.num_kv_heads, c, first, n);
    if (observer) {
      if (b == 1) {
        (*observer)(l, q, k, v);
      } else {
        (*observer)(l, q.topRows(n), k.topRows(n), v.topRows(n));
      }
    }
    for (Eigen::Index i = 0; i < b; ++i) {
      KvCache& cache = *caches[static_cast<size_t>(i)];
      OSCAR_RETURN_IF_ERROR(cache.write(l, k.data() + i * n * kw, v.data() + i * n * kw));
      OSCAR_RETURN_IF_ERROR(cache.attend(l, q.data() + i * n * qw, attn.data() + i * n * qw));
    }
    x.noalias() += attn * L.wo.transpose();
    rms_norm(x, L.ffn_norm, c.rms_eps, xn);
    gate.noalias() = xn * L.w_gate.transpose();
    up.noalias() = xn * L.w_up.transpose();
    gate = (gate.array() / (1.0f + (-gate.array()).exp())) * up.array();  // SiLU(gate) * up
    x.noalias() += gate * L.w_down.transpose();
  }
  for (KvCache* cache : caches) OSCAR_RETURN_IF_ERROR(cache->end_step());
  std::vector<RowMatrix> out;
  for (Eigen::Index i = 0; i < b; ++i) {
    RowMatrix rows = last_only ? RowMatrix(x.middleRows(i * n + n - 1, 1)) : RowMatrix(x.middleRows(i * n, n));
    rms_norm(rows, w.final_norm, c.rms_eps, xn);
    out.push_back(xn * w.output_matrix().transpose());
  }
  return out;
}

// One cache: the logits of `tokens`, [tokens, vocab] (or only of the last token).
inline Result<RowMatrix> forward(const LlamaWeights& w, KvCache& cache, const std::vector<int32_t>& tokens,
                                 bool last_only = false, const LayerObserver* observer = nullptr) {
  auto out = forward_lockstep(w, {&cache}, tokens, last_only, observer);
  if (!out.ok()) return out.status();
  return std::move((*out)[0]);
}

// ---- loading from GGUF ----------------------------------------------------------------------

// llama.cpp's converter stores row (head h, 2i + s) of W_Q/W_K where HF has row
// (h, s * head_dim/2 + i); this puts the rows back in HF order.
inline RowMatrix unpermute_rope_rows(const RowMatrix& w, int32_t heads, int32_t head_dim) {
  RowMatrix out(w.rows(), w.cols());
  const int32_t half = head_dim / 2;
  for (int32_t h = 0; h < heads; ++h) {
    for (int32_t i = 0; i < half; ++i) {
      for (int32_t s = 0; s < 2; ++s) {
        out.row(static_cast<Eigen::Index>(h) * head_dim + s * half + i) =
            w.row(static_cast<Eigen::Index>(h) * head_dim + 2 * i + s);
      }
    }
  }
  return out;
}

namespace detail {

inline Status load_matrix(const GgufFile& f, const std::string& name, int64_t rows, int64_t cols,
                          RowMatrix& out) {
  auto data = f.read_f32(name, {cols, rows});
  if (!data.ok()) return data.status();
  out = Eigen::Map<const RowMatrix>(data->data(), rows, cols);
  return Status::Ok();
}
inline Status load_vector(const GgufFile& f, const std::string& name, int64_t size, Eigen::VectorXf& out) {
  auto data = f.read_f32(name, {size});
  if (!data.ok()) return data.status();
  out = Eigen::Map<const Eigen::VectorXf>(data->data(), size);
  return Status::Ok();
}

}  // namespace detail

// The hyper-parameters of a llama-architecture GGUF.
inline Result<LlamaConfig> llama_config_from_gguf(const GgufFile& f) {
  auto arch = f.get_string("general.architecture");
  if (!arch.ok()) return arch.status();
  if (*arch != "llama") {
    return unsupported(f.origin() + ": architecture '" + *arch + "' is not supported (only 'llama')");
  }
  LlamaConfig c;
  c.rope_style = RopeStyle::kHalfSplit;  // after unpermute_rope_rows
  auto get = [&](const char* key, int32_t& out) -> Status {
    auto v = f.get_int(std::string("llama.") + key);
    if (!v.ok()) return v.status();
    if (*v <= 0 || *v > (int64_t{1} << 30)) return data_loss(f.origin() + ": llama." + key + " is out of range");
    out = static_cast<int32_t>(*v);
    return Status::Ok();
  };
  OSCAR_RETURN_IF_ERROR(get("embedding_length", c.hidden));
  OSCAR_RETURN_IF_ERROR(get("feed_forward_length", c.intermediate));
  OSCAR_RETURN_IF_ERROR(get("block_count", c.num_layers));
  OSCAR_RETURN_IF_ERROR(get("attention.head_count", c.num_qo_heads));
  c.num_kv_heads = c.num_qo_heads;
  if (f.find("llama.attention.head_count_kv")) OSCAR_RETURN_IF_ERROR(get("attention.head_count_kv", c.num_kv_heads));
  c.max_seq_len = 2048;
  if (f.find("llama.context_length")) OSCAR_RETURN_IF_ERROR(get("context_length", c.max_seq_len));
  if (c.num_qo_heads > 0) c.head_dim = c.hidden / c.num_qo_heads;
  if (f.find("llama.rope.dimension_count")) {
    int32_t rot = 0;
    OSCAR_RETURN_IF_ERROR(get("rope.dimension_count", rot));
    if (rot != c.head_dim) return unsupported(f.origin() + ": partial RoPE (rope.dimension_count != head_dim) is not supported");
  }
  if (f.find("llama.rope.freq_base")) {
    auto v = f.get_float("llama.rope.freq_base");
    if (!v.ok()) return v.status();
    c.rope_base = static_cast<float>(*v);
  }
  if (f.find("llama.attention.layer_norm_rms_epsilon")) {
    auto v = f.get_float("llama.attention.layer_norm_rms_epsilon");
    if (!v.ok()) return v.status();
    c.rms_eps = static_cast<float>(*v);
  }
  if (f.find("llama.rope.scaling.type")) {
    auto v = f.get_string("llama.rope.scaling.type");
    if (!v.ok()) return data_loss(f.origin() + ": llama.rope.scaling.type is not a string");
    if (*v != "none") return unsupported(f.origin() + ": RoPE scaling '" + *v + "' is not supported");
  }
  // Llama 3.1/3.2 scale RoPE's frequencies by this tensor; the forward here has no such scaling.
  if (f.find_tensor("rope_freqs.weight")) {
    return unsupported(f.origin() + ": RoPE frequency factors (rope_freqs.weight, Llama 3.1+) are not supported");
  }
  const GgufTensorInfo* embd = f.find_tensor("token_embd.weight");
  if (!embd) return data_loss(f.origin() + ": tensor 'token_embd.weight' is missing");
  if (embd->shape.size() != 2) return data_loss(f.origin() + ": token_embd.weight is not a matrix");
  c.vocab_size = static_cast<int32_t>(embd->shape[1]);
  OSCAR_RETURN_IF_ERROR(validate(c));
  return c;
}

// `unpermute`: undo llama.cpp's Q/K row permutation (see the top of this file). Tests load
// with unpermute = false and adjacent pairs to check both layouts give the same logits.
inline Result<LlamaWeights> load_llama(const GgufFile& f, bool unpermute = true) {
  auto config = llama_config_from_gguf(f);
  if (!config.ok()) return config.status();
  LlamaWeights w;
  w.config = *config;
  const LlamaConfig& c = w.config;
  if (!unpermute) w.config.rope_style = RopeStyle::kAdjacentPairs;
  const int64_t qd = static_cast<int64_t>(c.num_qo_heads) * c.head_dim;
  const int64_t kvd = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  OSCAR_RETURN_IF_ERROR(detail::load_matrix(f, "token_embd.weight", c.vocab_size, c.hidden, w.embedding));
  OSCAR_RETURN_IF_ERROR(detail::load_vector(f, "output_norm.weight", c.hidden, w.final_norm));
  if (f.find_tensor("output.weight")) {
    OSCAR_RETURN_IF_ERROR(detail::load_matrix(f, "output.weight", c.vocab_size, c.hidden, w.output));
  }
  // The file's last layer must exist before num_layers sizes anything (a corrupted
  // block_count of 2^30 would otherwise allocate first).
  if (!f.find_tensor("blk." + std::to_string(c.num_layers - 1) + ".attn_norm.weight") ||
      f.find_tensor("blk." + std::to_string(c.num_layers) + ".attn_norm.weight")) {
    return data_loss(f.origin() + ": llama.block_count " + std::to_string(c.num_layers) +
                     " does not match the file's blk.N tensors");
  }
  w.layers.resize(static_cast<size_t>(c.num_layers));
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    LlamaLayer& L = w.layers[static_cast<size_t>(l)];
    OSCAR_RETURN_IF_ERROR(detail::load_vector(f, p + "attn_norm.weight", c.hidden, L.attn_norm));
    OSCAR_RETURN_IF_ERROR(detail::load_vector(f, p + "ffn_norm.weight", c.hidden, L.ffn_norm));
    OSCAR_RETURN_IF_ERROR(detail::load_matrix(f, p + "attn_q.weight", qd, c.hidden, L.wq));
    OSCAR_RETURN_IF_ERROR(detail::load_matrix(f, p + "attn_k.weight", kvd, c.hidden, L.wk));
    OSCAR_RETURN_IF_ERROR(detail::load_matrix(f, p + "attn_v.weight", kvd, c.hidden, L.wv));
    OSCAR_RETURN_IF_ERROR(detail::load_matrix(f, p + "attn_output.weight", c.hidden, qd, L.wo));
    OSCAR_RETURN_IF_ERROR(detail::load_matrix(f, p + "ffn_gate.weight", c.intermediate, c.hidden, L.w_gate));
    OSCAR_RETURN_IF_ERROR(detail::load_matrix(f, p + "ffn_up.weight", c.intermediate, c.hidden, L.w_up));
    OSCAR_RETURN_IF_ERROR(detail::load_matrix(f, p + "ffn_down.weight", c.hidden, c.intermediate, L.w_down));
    if (unpermute) {
      L.wq = unpermute_rope_rows(L.wq, c.num_qo_heads, c.head_dim);
      L.wk = unpermute_rope_rows(L.wk, c.num_kv_heads, c.head_dim);
    }
  }
  return Result<LlamaWeights>(std::move(w));
}

}  // namespace oscar::decode
