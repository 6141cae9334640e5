// The Llama forward pass's model-independent parts: llama.cpp's Q/K row permutation undone,
// the cache methods' names and errors, and the paged-cache adapter on random K/V. The
// TinyStories model's forward pass is checked in test_tinystories.cpp.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "cache_methods.hpp"
#include "llama.hpp"

using namespace oscar::decode;


TEST_CASE("undoing llama.cpp's Q/K permutation turns adjacent-pair RoPE into half-split RoPE") {
  // W holds 2 heads of 64 in llama.cpp's row order. Adjacent-pair RoPE on W x must equal
  // half-split RoPE on unpermute(W) x, with rows matched as (h, 2i+s) <-> (h, s*32+i).
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  LlamaConfig c;
  c.head_dim = 64;
  c.rope_base = 1e5f;
  RowMatrix wmat(128, 16);
  for (Eigen::Index i = 0; i < wmat.size(); ++i) wmat.data()[i] = normal(rng);
  Eigen::VectorXf x(16);
  for (auto& v : x) v = normal(rng);
  RowMatrix adj = (wmat * x).transpose();
  RowMatrix half = (unpermute_rope_rows(wmat, 2, 64) * x).transpose();
  c.rope_style = RopeStyle::kAdjacentPairs;
  apply_rope(adj, 2, c, 37);
  c.rope_style = RopeStyle::kHalfSplit;
  apply_rope(half, 2, c, 37);
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 32; ++i) {
      for (int s = 0; s < 2; ++s) {
        CHECK(half(0, h * 64 + s * 32 + i) == doctest::Approx(adj(0, h * 64 + 2 * i + s)).epsilon(1e-6));
      }
    }
  }
}

TEST_CASE("cache methods: names, and --cache oscar without a plan explains itself") {
  CHECK(*parse_cache_method("int2-hadamard") == CacheMethod::kInt2Hadamard);
  CHECK(parse_cache_method("int3").status().message().find("unknown cache method 'int3'") != std::string::npos);
  LlamaConfig c;
  c.num_layers = 2; c.num_qo_heads = 4; c.num_kv_heads = 2; c.head_dim = 64; c.hidden = 256;
  auto oscar_cache = make_cache(CacheMethod::kOscar, c, {});
  CHECK(oscar_cache.status().message().find("--plan") != std::string::npos);
  auto bad = make_cache(CacheMethod::kInt2Naive, LlamaConfig{1024, 1, 1, 8, 1, 8, 10, 10}, {});
  CHECK(bad.status().message().find("head_dim 8 is not supported") != std::string::npos);
  // The Hadamard rotations are orthogonal: the paged cache accepts them (it checks).
  auto had = make_cache(CacheMethod::kInt2Hadamard, c, {});
  CHECK_MESSAGE(had.ok(), had.status().to_string());
}

TEST_CASE("PagedKvCache: long steps, sink and window; bf16 method tracks the exact cache") {
  // Random post-RoPE K/V/Q through the adapter: steps of 1, 7, 64 and a 200-token first step
  // (a prompt) must neither run out of pages nor misplace tokens.
  LlamaConfig c;
  c.num_layers = 2; c.num_qo_heads = 4; c.num_kv_heads = 2; c.head_dim = 64; c.hidden = 256;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  const int64_t capacity = 400;
  ExactKvCache exact(c, capacity);
  auto bf16 = make_cache(CacheMethod::kBf16, c, {capacity, 0, 0, 16});
  auto int2 = make_cache(CacheMethod::kInt2Hadamard, c, {capacity, 16, 32, 16});
  REQUIRE(bf16.ok());
  REQUIRE(int2.ok());
  KvCache* caches[] = {&exact, bf16->get(), int2->get()};
  double worst_bf16 = 0, worst_int2 = 0, scale = 0;
  for (int step : {200, 1, 7, 64, 1, 1, 16, 100}) {
    const size_t kv_n = static_cast<size_t>(step) * 2 * 64, q_n = static_cast<size_t>(step) * 4 * 64;
    std::vector<std::vector<float>> out(3, std::vector<float>(q_n));
    for (KvCache* cache : caches) REQUIRE(cache->begin_step(step).ok());
    for (int32_t l = 0; l < 2; ++l) {
      std::vector<float> k(kv_n), v(kv_n), q(q_n);
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      for (auto& x : q) x = 0.3f * normal(rng);
      for (int i = 0; i < 3; ++i) {
        REQUIRE(caches[i]->write(l, k.data(), v.data()).ok());
        const auto status = caches[i]->attend(l, q.data(), out[static_cast<size_t>(i)].data());
        REQUIRE_MESSAGE(status.ok(), status.to_string());
      }
      for (size_t j = 0; j < q_n; ++j) {
        worst_bf16 = std::max(worst_bf16, static_cast<double>(std::abs(out[1][j] - out[0][j])));
        worst_int2 = std::max(worst_int2, static_cast<double>(std::abs(out[2][j] - out[0][j])));
        scale = std::max(scale, static_cast<double>(std::abs(out[0][j])));
      }
    }
    for (KvCache* cache : caches) {
      const auto status = cache->end_step();
      REQUIRE_MESSAGE(status.ok(), status.to_string());
    }
  }
  CHECK(exact.length() == 390);
  CHECK((*int2)->length() == 390);
  MESSAGE("max |out error|: bf16 " << worst_bf16 << ", int2-hadamard " << worst_int2 << " (max |out| " << scale << ")");
  // Outputs are convex combinations of unit-normal V rows (|v| < ~4.5 over these draws).
  // bf16 moves each element by <= 2^-9 of itself: V rounding alone moves an output by
  // <= 4.5 * 2^-9 ~ 0.009; K rounding moves each score q.k/8 (|q| ~ 2.4, |k| ~ 8) by up to
  // ~2.4 * 8 * 2^-9 / 8 ~ 0.005, which reweights rows spread over ~9: <= ~0.045 if every
  // change lined up, typically far less. 0.05 bounds the sum; a misplaced or dropped token
  // moves outputs by O(1) (the int2 check below shows the scale of real damage).
  CHECK(worst_bf16 <= 0.05);
  CHECK(worst_int2 > worst_bf16);
  // The adapter prices its length with the library: storage_cost over segment_counts.
  const oscar::SegmentCounts counts = oscar::segment_counts(390, 16, 32, 16);
  CHECK((*int2)->bytes_per_token() ==
        doctest::Approx(oscar::storage_cost({64, 64, 16}, counts).bytes_per_token * 2 * 2));
  CHECK((*bf16)->bytes_per_token() == doctest::Approx(2.0 * 2 * 64 * 2 * 2));
}
