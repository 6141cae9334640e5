// Shared set-up for the reference-cache tests.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/cache_oracle.hpp"
#include "common/random.hpp"
#include "oscar/host/paged_cache.hpp"

namespace oscar::testing {

inline host::LayerQuantizer make_quantizer(int d, uint64_t seed, bool rotate, float rho_k = 0.96f,
                                           float rho_v = 0.92f) {
  host::LayerQuantizer q;
  if (rotate) {
    q.k_rotation = random_orthogonal(d, seed);
    q.v_rotation = random_orthogonal(d, seed + 1000);
  }
  q.k_clip_ratio = rho_k;
  q.v_clip_ratio = rho_v;
  return q;
}

inline host::PagedCache make_cache(const host::CacheConfig& config, bool rotate, uint64_t seed = 1, float rho_k = 0.96f,
                                   float rho_v = 0.92f) {
  std::vector<host::LayerQuantizer> layers;
  for (int l = 0; l < config.num_layers; ++l) {
    layers.push_back(make_quantizer(config.head_dim, seed + l, rotate, rho_k, rho_v));
  }
  auto cache = host::PagedCache::create(config, std::move(layers));
  REQUIRE_MESSAGE(cache.ok(), cache.status().to_string());
  return std::move(cache).value();
}

// K and V rows for `tokens` tokens of every layer: [layers][tokens][kv heads][d], bf16.
struct KvRows {
  std::vector<bf16_t> k, v;
};
inline KvRows random_kv(RowGenerator& keys, RowGenerator& values, const host::CacheConfig& c, int tokens) {
  const size_t rows = size_t(c.num_layers) * tokens * c.num_kv_heads;
  KvRows kv{std::vector<bf16_t>(rows * c.head_dim), std::vector<bf16_t>(rows * c.head_dim)};
  keys.fill_bf16(kv.k.data(), rows);
  values.fill_bf16(kv.v.data(), rows);
  return kv;
}

// Appends `total` tokens to one request in chunks of the given sizes (cycled).
inline void append_in_chunks(host::PagedCache& cache, host::RequestId id, int total,
                             const std::vector<int>& chunks, RowGenerator& keys, RowGenerator& values) {
  for (int done = 0, c = 0; done < total; ++c) {
    const int n = std::min(chunks[c % chunks.size()], total - done);
    const KvRows kv = random_kv(keys, values, cache.config(), n);
    const int32_t count = n;
    const Status s = cache.append(std::span<const host::RequestId>(&id, 1), std::span<const int32_t>(&count, 1),
                                  kv.k.data(), kv.v.data());
    REQUIRE_MESSAGE(s.ok(), s.to_string());
    done += n;
  }
}

inline std::vector<float> random_queries(RowGenerator& gen, size_t rows) {
  std::vector<float> q;
  for (size_t r = 0; r < rows; ++r) {
    const std::vector<float> row = gen.row();
    q.insert(q.end(), row.begin(), row.end());
  }
  return q;
}

// Largest |value| in the cache of one request: the scale the output errors are measured on.
inline double value_scale(const std::vector<DenseHead>& heads) {
  double m = 0;
  for (const auto& h : heads)
    for (const auto& v : h.values)
      for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// Decodes one query per request and checks each output row against the float64 oracle:
// |o - o_ref| <= tol * max|v| and |lse - lse_ref| <= tol * (1 + |lse_ref|).
inline double check_decode(const host::PagedCache& cache, int layer, const std::vector<host::RequestId>& ids,
                           RowGenerator& gen, double tol, const host::AttentionOptions& options = {}) {
  const auto& c = cache.config();
  const int d = c.head_dim;
  const std::vector<float> q = random_queries(gen, ids.size() * c.num_qo_heads);
  std::vector<float> out(q.size(), std::nanf("")), lse(ids.size() * c.num_qo_heads, std::nanf(""));
  const Status s = cache.decode(layer, ids, q.data(), out.data(), lse.data(), options);
  REQUIRE_MESSAGE(s.ok(), s.to_string());
  double worst = 0;
  for (size_t b = 0; b < ids.size(); ++b) {
    const auto heads = read_cache(cache, layer, ids[b]);
    const double scale = std::max(value_scale(heads), 1e-30);
    for (int h = 0; h < c.num_qo_heads; ++h) {
      const size_t row = b * c.num_qo_heads + h;
      const auto ref = oracle_attention(cache, layer, heads, h, q.data() + row * d, cache.length(ids[b]) - 1);
      for (int i = 0; i < d; ++i) worst = std::max(worst, std::abs(out[row * d + i] - ref.out[i]) / scale);
      if (std::isfinite(ref.lse)) {
        CHECK(std::abs(lse[row] - ref.lse) <= tol * (1 + std::abs(ref.lse)));
      } else {
        CHECK(lse[row] == -INFINITY);
      }
    }
  }
  CHECK(worst <= tol);
  return worst;
}

}  // namespace oscar::testing
