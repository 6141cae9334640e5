// Clip search: the residual is exactly what the cache stores, the search returns the
// minimizer of the curve, and with one group per row P_br changes nothing.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "common/random.hpp"
#include "fit/fit_test_util.hpp"
#include "oscar/fit/clip_search.hpp"
#include "oscar/fit/fit_plan.hpp"
#include "oscar/host/paged_cache.hpp"

using namespace oscar;
using namespace oscar::fit;

TEST_CASE("the clip-search reconstruction is bit-identical to the paged cache's INT2 rows") {
  const int d = 64, heads = 2, tokens = 48;
  host::CacheConfig config;
  config.head_dim = d;
  config.num_qo_heads = heads;
  config.num_kv_heads = heads;
  config.page_size = 16;
  config.sink_tokens = 0;
  config.recent_tokens = 0;
  config.num_int2_pages = 8;
  config.num_bf16_pages = 8;
  const std::vector<float> rk = testing::random_orthogonal(d, 1), rv = testing::random_orthogonal(d, 2);
  for (float rho : {1.0f, 0.93f}) {
    CAPTURE(rho);
    host::LayerQuantizer lq{rk, rv, rho, rho};
    auto cache = host::PagedCache::create(config, {lq});
    REQUIRE(cache.ok());
    auto id = cache->add_request();
    testing::RowGenerator gen(3, d);
    std::vector<bf16_t> k(tokens * heads * d), v(k.size());
    gen.fill_bf16(k.data(), tokens * heads);
    gen.fill_bf16(v.data(), tokens * heads);
    const std::vector<host::RequestId> ids{*id};
    REQUIRE(cache->append(ids, std::vector<int32_t>{tokens}, k.data(), v.data()).ok());
    REQUIRE(cache->segments(*id).int2 == tokens);  // every token went to INT2
    auto tables = cache->page_tables(ids);
    REQUIRE(tables.ok());
    for (int pass = 0; pass < 2; ++pass) {
      const std::vector<bf16_t>& src = pass == 0 ? k : v;
      std::vector<float> xf(src.size());
      for (size_t i = 0; i < src.size(); ++i) xf[i] = bf16_to_float(src[i]);
      auto rows = rotate_rows(xf.data(), tokens, heads, d, pass == 0 ? rk : rv);
      REQUIRE(rows.ok());
      const RowMatrixXd e = quantization_residual(*rows, 0, clip_rank(rho, d));
      const Int2PoolRef pool =
          cache->int2_pool(0, pass == 0 ? host::PagedCache::Tensor::kKeys : host::PagedCache::Tensor::kValues);
      const Int2Layout layout = cache->int2_layout();
      int mismatches = 0;
      for (int t = 0; t < tokens; ++t) {
        const int32_t page = tables->int2.indices[t / 16];
        for (int h = 0; h < heads; ++h) {
          const uint8_t* block = pool.block(page, h);
          float out[64];
          dequantize_row(layout.codes(block, t % 16), layout.meta(block, t % 16), d, d, out);
          for (int i = 0; i < d; ++i) {
            const double fitted = rows->exact(t * heads + h, i) - e(t * heads + h, i);
            mismatches += static_cast<float>(fitted) != out[i];
          }
        }
      }
      CHECK(mismatches == 0);
    }
  }
}

TEST_CASE("search_clip_ratio returns the curve's minimizer, quantizing each clip rank once") {
  testing::RowGenerator gen(5, 64, 6, 20.0f);
  std::vector<float> x(300 * 64);
  for (int t = 0; t < 300; ++t) {
    const std::vector<float> r = gen.row();
    std::copy(r.begin(), r.end(), x.begin() + t * 64);
  }
  auto rows = rotate_rows(x.data(), 300, 1, 64, {});
  REQUIRE(rows.ok());
  const std::vector<float> grid = default_clip_grid();
  int calls = 0;
  auto j = [&](const RowMatrixXd& e) {
    ++calls;
    return e.squaredNorm();
  };
  auto c = search_clip_ratio(*rows, 0, grid, j);
  REQUIRE(c.ok());
  REQUIRE(c->curve.size() == grid.size());
  std::vector<int> ranks;
  for (float rho : grid) {
    if (std::find(ranks.begin(), ranks.end(), clip_rank(rho, 64)) == ranks.end()) ranks.push_back(clip_rank(rho, 64));
  }
  CHECK(calls == static_cast<int>(ranks.size()));
  CHECK(calls < static_cast<int>(grid.size()));  // d = 64: floor(0.97*64) = floor(0.98*64) = 62
  for (size_t i = 0; i < grid.size(); ++i) {
    CHECK(c->curve[i] >= c->objective);
    CHECK(c->curve[i] == quantization_residual(*rows, 0, clip_rank(grid[i], 64)).squaredNorm());
  }
  // The minimizer, and among equal values the largest ratio.
  size_t best = 0;
  for (size_t i = 1; i < grid.size(); ++i) {
    if (c->curve[i] < c->curve[best]) best = i;
  }
  CHECK(c->ratio == grid[best]);
  // Outlier channels 20x the others: clipping must beat no clipping on plain squared error.
  CHECK(c->ratio < 1.0f);
  CHECK(search_clip_ratio(*rows, 0, {}, j).status().message().find("empty") != std::string::npos);
  CHECK(search_clip_ratio(*rows, 0, {1.2f}, j).status().message().find("outside") != std::string::npos);
  // Groups the quantizer lacks (48 would read past the row, 16 overrun the metadata).
  CHECK(search_clip_ratio(*rows, 48, grid, j).status().message().find("quant_group_size 48") != std::string::npos);
  CHECK(search_clip_ratio(*rows, 16, grid, j).status().message().find("not a supported shape") != std::string::npos);
  // A non-finite objective (NaN compares false: the minimum would silently be grid[0]).
  auto nan_j = [](const RowMatrixXd& e) { return e.squaredNorm() * std::nan(""); };
  CHECK(search_clip_ratio(*rows, 0, grid, nan_j).status().message().find("not finite") != std::string::npos);
}

TEST_CASE("with one quantization group per row, P_br changes no objective; with groups it does") {
  const ModelShape s{1, 4, 2, 64};
  const testing::Activations x = testing::make_activations(s, 400, 21);
  auto acc = CalibrationAccumulator::create(s);
  REQUIRE(acc->add_chunk(0, x.q.data(), x.k.data(), x.v.data(), 400).ok());
  auto st = acc->statistics(0);
  auto plain = spectral_rotation(st->c_k, false), br = spectral_rotation(st->c_k, true);
  const std::vector<float> rp = detail::to_f32(plain->rotation), rb = detail::to_f32(br->rotation);
  for (int group : {0, 32}) {
    double j[2];
    for (int which = 0; which < 2; ++which) {
      const std::vector<float>& r = which ? rb : rp;
      auto rows = rotate_rows(x.k.data(), 400, 2, 64, r);
      std::vector<Eigen::MatrixXd> metric;
      for (const auto& a : st->a) metric.push_back(detail::from_f32(r, 64).transpose() * a * detail::from_f32(r, 64));
      j[which] = key_objective(quantization_residual(*rows, group, clip_rank(0.95f, 64)), metric);
    }
    CAPTURE(group);
    if (group == 0) {
      // Permuting the columns permutes each rotated row exactly (rotate_row computes every
      // output on its own) and the one-group quantizer is permutation-equivariant: only the
      // float64 summation order of J differs.
      CHECK(std::abs(j[0] - j[1]) / j[0] < 1e-12);
    } else {
      CHECK(std::abs(j[0] - j[1]) / j[0] > 1e-6);
    }
  }
}
