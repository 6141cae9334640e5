// The fidelity evaluator rebuilds what each cache holds; these tests tie it to the caches
// themselves: attention over its rows equals the paged cache's decode (oscar-fit-like method:
// Hadamard rotation with clipping, sink and window) and the simulated caches' attention
// (int4, kivi), on the same seeded K/V. And the metrics are zero where nothing differs.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "cache_methods.hpp"
#include "common/random.hpp"
#include "fidelity.hpp"
#include "llama.hpp"

using namespace oscar::decode;

namespace {

LlamaConfig tiny_config() {
  LlamaConfig c;
  c.hidden = 128;
  c.intermediate = 256;
  c.num_layers = 1;
  c.num_qo_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 64;
  c.vocab_size = 16;
  return c;
}

// K/V rows shaped like real ones (outlier channels), T tokens, one KV head; q for 2 heads.
struct Rows {
  RowMatrix q, k, v;
};
Rows make_rows(int64_t tokens, uint64_t seed) {
  oscar::testing::RowGenerator gk(seed, 64), gv(seed + 1, 64, 2, 4.0f), gq(seed + 2, 64);
  Rows r{RowMatrix(tokens, 128), RowMatrix(tokens, 64), RowMatrix(tokens, 64)};
  for (int64_t t = 0; t < tokens; ++t) {
    const auto k = gk.row(), v = gv.row(), q0 = gq.row(), q1 = gq.row();
    for (int i = 0; i < 64; ++i) {
      r.k(t, i) = k[i];
      r.v(t, i) = v[i];
      r.q(t, i) = q0[i] * 0.2f;  // softmax neither flat nor one-hot
      r.q(t, 64 + i) = q1[i] * 0.2f;
    }
  }
  return r;
}

// The output of both query heads of the last token, through `cache` fed token by token.
std::vector<float> cache_output(KvCache& cache, const Rows& r) {
  std::vector<float> out(128);
  for (Eigen::Index t = 0; t < r.k.rows(); ++t) {
    REQUIRE(cache.begin_step(1).ok());
    REQUIRE(cache.write(0, r.k.row(t).data(), r.v.row(t).data()).ok());
    REQUIRE(cache.attend(0, r.q.row(t).data(), out.data()).ok());
    REQUIRE(cache.end_step().ok());
  }
  return out;
}

// The same output from the evaluator's rows.
std::vector<float> evaluator_output(CacheMethod method, const oscar::host::LayerQuantizer* quantizer, const Rows& r,
                                    const CacheGeometry& g) {
  const Eigen::MatrixXd k = cached_rows(method, quantizer, true, r.k, g);
  const Eigen::MatrixXd v = cached_rows(method, quantizer, false, r.v, g);
  std::vector<float> out(128);
  const int64_t last = r.k.rows() - 1;
  for (int h = 0; h < 2; ++h) {
    const Eigen::MatrixXd q = r.q.block(last, h * 64, 1, 64).cast<double>();
    const HeadAttention a = attend_head(q, k, v, last);
    for (int i = 0; i < 64; ++i) out[static_cast<size_t>(h * 64 + i)] = static_cast<float>(a.out(0, i));
  }
  return out;
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::abs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::abs(b[i])));
  }
  return worst / scale;
}

}  // namespace

TEST_CASE("fidelity: the evaluator's rows give the paged cache's decode output") {
  const LlamaConfig c = tiny_config();
  const Rows r = make_rows(200, 7);
  const CacheGeometry g{16, 32, 16};
  oscar::host::LayerQuantizer hadamard = hadamard_quantizers(1, 64)[0];
  hadamard.k_clip_ratio = 0.9f;
  hadamard.v_clip_ratio = 0.85f;
  for (const auto& [method, quantizer] :
       {std::pair{CacheMethod::kInt2Naive, oscar::host::LayerQuantizer{}}, std::pair{CacheMethod::kOscarFit, hadamard}}) {
    auto cache = PagedKvCache::create(c, 200, g.sink_tokens, g.recent_tokens, g.page_size, {quantizer});
    REQUIRE(cache.ok());
    const auto expected = cache_output(**cache, r);
    const auto got = evaluator_output(method, &quantizer, r, g);
    // Same bytes in the cache; the two attention sums differ only by float32 vs float64
    // accumulation over 200 keys and the float32 un-rotation (~1e-6 relative). A wrong
    // segment boundary, clip rank or rotation changes INT2 rows by ~10% of their range.
    CHECK(max_rel_diff(got, expected) < 1e-4);
  }
}

TEST_CASE("fidelity: the evaluator's rows give the simulated caches' output (int4, kivi)") {
  const LlamaConfig c = tiny_config();
  const Rows r = make_rows(200, 11);
  const CacheGeometry g{16, 32, 16};
  for (auto [method, format] : {std::pair{CacheMethod::kInt4, SimulatedFormat::kInt4},
                                std::pair{CacheMethod::kKivi, SimulatedFormat::kKivi}}) {
    SimulatedKvCache cache(c, 200, g.sink_tokens, g.recent_tokens, g.page_size, format);
    const auto expected = cache_output(cache, r);
    const auto got = evaluator_output(method, nullptr, r, g);
    CHECK(max_rel_diff(got, expected) < 1e-4);
    // And it is quantized: the exact rows give a different output.
    const auto exact = evaluator_output(CacheMethod::kExact, nullptr, r, g);
    CHECK(max_rel_diff(exact, expected) > 1e-3);
  }
}

TEST_CASE("fidelity: metrics of a lossless method are (near) perfect; INT2 is not") {
  const LlamaConfig c = tiny_config();
  const Rows r = make_rows(300, 3);
  LlamaLayer layer;
  layer.wo = RowMatrix::Identity(128, 128);
  const CacheGeometry g{16, 32, 16};
  auto exact = layer_fidelity(CacheMethod::kExact, nullptr, layer, c, r.q, r.k, r.v, 32, g);
  REQUIRE(exact.ok());
  // The rows are bf16 already, so "exact" (bf16-rounded) rows are the inputs themselves.
  CHECK(exact->logit_rel_err == 0.0);
  CHECK(exact->attn_kl == doctest::Approx(0.0).epsilon(1e-12));
  CHECK(exact->top1 == 1.0);
  CHECK(exact->top32 == 1.0);
  const oscar::host::LayerQuantizer none;
  auto naive = layer_fidelity(CacheMethod::kInt2Naive, &none, layer, c, r.q, r.k, r.v, 32, g);
  REQUIRE(naive.ok());
  CHECK(naive->logit_rel_err > 0.05);  // 4 levels over a row with 12x outliers
  CHECK(naive->attn_kl > 0.0);
  CHECK(naive->top8 < 1.0);
  // With W_O the identity, the error after W_O equals the error before it.
  CHECK(naive->out_wo_rel_err == doctest::Approx(naive->out_rel_err).epsilon(1e-9));
}
