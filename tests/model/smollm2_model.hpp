// What the SmolLM2 tests share: the model loaded once, the test text, per-token logits through
// a cache, and the comparison of two runs' logits. Needs OSCAR_TEST_DATA_DIR and doctest.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "gguf.hpp"
#include "llama.hpp"
#include "model_location.hpp"
#include "tokenizer.hpp"

namespace oscar::decode::testing {

struct Loaded {
  GgufFile file;
  LlamaWeights weights;
  BpeTokenizer tokenizer;
};

inline const Loaded& model() {
  static std::unique_ptr<Loaded> loaded = [] {
    auto file = GgufFile::open(default_model_path());
    REQUIRE_MESSAGE(file.ok(), file.status().to_string());
    auto weights = load_llama(*file);
    REQUIRE_MESSAGE(weights.ok(), weights.status().to_string());
    auto tok = BpeTokenizer::from_gguf(*file);
    REQUIRE_MESSAGE(tok.ok(), tok.status().to_string());
    return std::unique_ptr<Loaded>(new Loaded{std::move(*file), std::move(*weights), std::move(*tok)});
  }();
  return *loaded;
}

// False (after printing why, as ctest's skip message) where the model file is absent: the
// test's main() then returns 77 (skipped).
inline bool smollm2_model_present() {
  const std::string path = default_model_path();
  if (std::ifstream(path)) return true;
  std::printf("SKIPPED: SmolLM2 model not found at %s (run scripts/fetch-model.sh, or set OSCAR_MODEL)\n", path.c_str());
  return false;
}

inline std::string read_text() {
  std::ifstream in(std::string(OSCAR_TEST_DATA_DIR) + "/lighthouse.txt");
  REQUIRE(in);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline int argmax(const float* x, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i) if (x[i] > x[best]) best = i;
  return best;
}

inline std::vector<double> log_softmax(const std::vector<float>& z) {
  double m = -1e300, s = 0;
  for (float v : z) m = std::max(m, static_cast<double>(v));
  for (float v : z) s += std::exp(v - m);
  std::vector<double> out(z.size());
  for (size_t i = 0; i < z.size(); ++i) out[i] = z[i] - m - std::log(s);
  return out;
}

// Logits of every token, fed through all `caches` in lockstep (the same tokens, the weight
// products shared) in steps of schedule[i] tokens (the last entry repeats until the tokens run
// out); one list per cache.
inline std::vector<std::vector<std::vector<float>>> run_lockstep(const std::vector<KvCache*>& caches,
                                                                 const std::vector<int32_t>& ids,
                                                                 const std::vector<size_t>& schedule) {
  std::vector<std::vector<std::vector<float>>> out(caches.size());
  size_t step = 0;
  for (size_t start = 0; start < ids.size(); ++step) {
    const size_t end = std::min(ids.size(), start + schedule[std::min(step, schedule.size() - 1)]);
    auto logits = forward_lockstep(model().weights, caches,
                                   std::vector<int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(start),
                                                        ids.begin() + static_cast<std::ptrdiff_t>(end)));
    REQUIRE_MESSAGE(logits.ok(), logits.status().to_string());
    for (size_t c = 0; c < caches.size(); ++c) {
      const RowMatrix& m = (*logits)[c];
      for (Eigen::Index r = 0; r < m.rows(); ++r) out[c].emplace_back(m.row(r).data(), m.row(r).data() + m.cols());
    }
    start = end;
  }
  return out;
}

inline std::vector<std::vector<float>> run(KvCache& cache, const std::vector<int32_t>& ids,
                                           const std::vector<size_t>& schedule) {
  return std::move(run_lockstep({&cache}, ids, schedule)[0]);
}

// How far run b's next-token distributions are from run a's.
struct LogitGap {
  double mean_kl = 0;        // mean over tokens of KL(a || b), nats
  double max_kl = 0;
  double worst_logit = 0;    // largest |a - b| over every token and vocabulary entry
  int same_top1 = 0;         // tokens whose argmax agrees
};

inline LogitGap logit_gap(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  REQUIRE(a.size() == b.size());
  LogitGap g;
  for (size_t t = 0; t < a.size(); ++t) {
    const auto p = log_softmax(a[t]), q = log_softmax(b[t]);
    double kl = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      kl += std::exp(p[i]) * (p[i] - q[i]);
      g.worst_logit = std::max(g.worst_logit, static_cast<double>(std::abs(a[t][i] - b[t][i])));
    }
    g.mean_kl += kl;
    g.max_kl = std::max(g.max_kl, kl);
    const int n = static_cast<int>(a[t].size());
    g.same_top1 += argmax(a[t].data(), n) == argmax(b[t].data(), n);
  }
  g.mean_kl /= static_cast<double>(a.size());
  return g;
}

}  // namespace oscar::decode::testing
