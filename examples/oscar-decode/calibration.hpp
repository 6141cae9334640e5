// Calibration: text -> an OSCAR plan, through the library's streaming accumulators
// (oscar::fit::CalibrationAccumulator) and fit_plan, with no activation dump in between.
//
// The calibration tokens are cut into sequences of `sequence_tokens` (each run from an empty
// float32 cache, as separate prompts would be; a full-precision prefill is right here: the
// statistics describe the model, not a cache). The last `held_out_tokens` tokens of the text
// are a sequence of their own, kept out of the statistics, for the clip-ratio search. The
// first `skip_tokens` positions of every sequence are left out: they are the attention-sink
// tokens with outlier activations, which a deployed cache keeps in its BF16 sink anyway.
// Value weights are the authors' proxy w_t = k A_h kᵀ, which needs A_h of all queries first:
// pass 1 accumulates the query statistics, A_h is frozen, and pass 2 runs the same sequences
// again for the weighted value statistics (recomputing costs one more forward; keeping every
// layer's K and V of 10^4 tokens would cost ~0.5 GB for this small model).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "llama.hpp"
#include "oscar/core/status.hpp"
#include "oscar/fit/accumulators.hpp"
#include "oscar/fit/fit_plan.hpp"

namespace oscar::decode {

struct CalibrationOptions {
  int64_t sequence_tokens = 2048;
  int64_t max_tokens = 16384;     // statistics tokens read from the text at most
  int64_t held_out_tokens = 1024;
  int64_t skip_tokens = 16;
  int64_t chunk_tokens = 256;     // tokens per forward step (prefill chunk)
  fit::FitOptions fit;            // method, clip search, sink/recent recorded in the plan, threads
};

struct CalibrationProgress {
  const char* phase;  // "pass 1", "pass 2", "held-out", "fit"
  int64_t done;
  int64_t total;
};

struct CalibrationResult {
  fit::FitResult fit;
  int64_t statistics_tokens = 0;  // positions that entered the statistics (per layer)
  int64_t held_out_tokens = 0;
};

namespace detail {

// Runs `ids` through a fresh exact cache in chunks; `observe` sees every layer's q/k/v with
// the position of the chunk's first row.
inline Status run_observed(const LlamaWeights& w, const std::vector<int32_t>& ids, int64_t chunk_tokens,
                           const std::function<void(int32_t, int64_t, const RowMatrix&, const RowMatrix&,
                                                    const RowMatrix&)>& observe) {
  ExactKvCache cache(w.config, static_cast<int64_t>(ids.size()));
  for (size_t start = 0; start < ids.size(); start += static_cast<size_t>(chunk_tokens)) {
    const size_t end = std::min(ids.size(), start + static_cast<size_t>(chunk_tokens));
    const int64_t first = static_cast<int64_t>(start);
    const LayerObserver observer = [&](int32_t layer, const RowMatrix& q, const RowMatrix& k, const RowMatrix& v) {
      observe(layer, first, q, k, v);
    };
    std::vector<int32_t> chunk(ids.begin() + static_cast<std::ptrdiff_t>(start),
                               ids.begin() + static_cast<std::ptrdiff_t>(end));
    auto logits = forward(w, cache, chunk, /*last_only=*/true, &observer);
    if (!logits.ok()) return logits.status();
  }
  return Status::Ok();
}

}  // namespace detail

inline Result<CalibrationResult> calibrate(const LlamaWeights& w, const std::vector<int32_t>& ids,
                                           const CalibrationOptions& options,
                                           const std::function<void(const CalibrationProgress&)>& progress = {}) {
  const LlamaConfig& c = w.config;
  if (options.sequence_tokens <= options.skip_tokens || options.chunk_tokens <= 0 || options.held_out_tokens <= 0) {
    return invalid_argument("calibrate: need sequence tokens > skip tokens, and positive chunk and held-out sizes");
  }
  const int64_t total = static_cast<int64_t>(ids.size());
  if (total < options.held_out_tokens + options.sequence_tokens / 4) {
    return invalid_argument("calibration text has " + std::to_string(total) + " tokens; it needs at least " +
                            std::to_string(options.held_out_tokens + options.sequence_tokens / 4) +
                            " (held-out tokens + a quarter sequence)");
  }
  // Statistics: sequences from the start; held-out: the last tokens of the text.
  const int64_t stats_end = std::min(total - options.held_out_tokens, options.max_tokens);
  std::vector<std::vector<int32_t>> sequences;
  for (int64_t s = 0; s < stats_end; s += options.sequence_tokens) {
    const int64_t e = std::min(stats_end, s + options.sequence_tokens);
    if (e - s <= options.skip_tokens) break;
    sequences.emplace_back(ids.begin() + s, ids.begin() + e);
  }
  const std::vector<int32_t> held_ids(ids.end() - options.held_out_tokens, ids.end());

  const fit::ModelShape shape{c.num_layers, c.num_qo_heads, c.num_kv_heads, c.head_dim};
  auto acc = fit::CalibrationAccumulator::create(shape);
  if (!acc.ok()) return acc.status();
  const int64_t qw = static_cast<int64_t>(c.num_qo_heads) * c.head_dim, kw = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  const int64_t skip = options.skip_tokens;

  // The rows of a chunk at positions >= skip.
  auto usable = [skip](int64_t first, const RowMatrix& m, int64_t* offset) {
    *offset = std::max<int64_t>(0, skip - first);
    return std::max<int64_t>(0, m.rows() - *offset);
  };
  Status failure = Status::Ok();
  int64_t stats_tokens = 0;
  for (int pass = 1; pass <= 2; ++pass) {
    if (pass == 2) OSCAR_RETURN_IF_ERROR(acc->begin_value_pass());
    for (size_t i = 0; i < sequences.size(); ++i) {
      OSCAR_RETURN_IF_ERROR(detail::run_observed(
          w, sequences[i], options.chunk_tokens,
          [&](int32_t layer, int64_t first, const RowMatrix& q, const RowMatrix& k, const RowMatrix& v) {
            int64_t off = 0;
            const int64_t n = usable(first, k, &off);
            if (n == 0 || !failure.ok()) return;
            if (pass == 1) {
              failure = acc->add_chunk(layer, q.data() + off * qw, k.data() + off * kw, v.data() + off * kw, n);
              if (layer == 0) stats_tokens += n;
            } else {
              failure = acc->add_values_proxy(layer, k.data() + off * kw, v.data() + off * kw, n);
            }
          }));
      OSCAR_RETURN_IF_ERROR(failure);
      if (progress) progress({pass == 1 ? "pass 1" : "pass 2", static_cast<int64_t>(i + 1), static_cast<int64_t>(sequences.size())});
    }
  }

  std::vector<fit::HeldOutLayer> held(static_cast<size_t>(c.num_layers));
  OSCAR_RETURN_IF_ERROR(detail::run_observed(
      w, held_ids, options.chunk_tokens,
      [&](int32_t layer, int64_t first, const RowMatrix&, const RowMatrix& k, const RowMatrix& v) {
        int64_t off = 0;
        const int64_t n = usable(first, k, &off);
        fit::HeldOutLayer& h = held[static_cast<size_t>(layer)];
        h.k.insert(h.k.end(), k.data() + off * kw, k.data() + (off + n) * kw);
        h.v.insert(h.v.end(), v.data() + off * kw, v.data() + (off + n) * kw);
        h.tokens += n;
      }));
  if (progress) progress({"held-out", 1, 1});

  std::vector<fit::LayerStatistics> stats;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    auto s = acc->statistics(l);
    if (!s.ok()) return s.status();
    stats.push_back(std::move(*s));
  }
  int32_t fitted = 0;
  auto result = fit::fit_plan(shape, stats, held, options.fit, [&](const fit::LayerReport&) {
    if (progress) progress({"fit", ++fitted, c.num_layers});
  });
  if (!result.ok()) return result.status();
  CalibrationResult out;
  out.fit = std::move(*result);
  out.fit.plan.calibration_tokens = stats_tokens;
  out.statistics_tokens = stats_tokens;
  out.held_out_tokens = held[0].tokens;
  return Result<CalibrationResult>(std::move(out));
}

}  // namespace oscar::decode
