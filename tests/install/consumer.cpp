// Host part of a consumer: build a cache from the installed headers, write, decode.
#include <cmath>
#include <cstdio>
#include <vector>

#include <Eigen/Core>
#include <oscar/host/paged_cache.hpp>

int main() {
  oscar::host::CacheConfig config;
  config.head_dim = 64;
  config.num_qo_heads = 3;
  config.num_kv_heads = 1;
  config.sink_tokens = 4;
  config.recent_tokens = 8;
  config.num_int2_pages = 8;
  config.num_bf16_pages = 8;
  auto cache = oscar::host::PagedCache::create(config, std::vector<oscar::host::LayerQuantizer>(1));
  if (!cache.ok()) return std::printf("%s\n", cache.status().to_string().c_str()), 1;
  auto id = cache->add_request();
  std::vector<oscar::bf16_t> k(40 * 64), v(40 * 64);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = oscar::float_to_bf16(std::sin(0.1f * i));
    v[i] = oscar::float_to_bf16(std::cos(0.1f * i));
  }
  const std::vector<oscar::host::RequestId> ids{*id};
  if (!cache->append(ids, std::vector<int32_t>{40}, k.data(), v.data()).ok()) return 1;
  std::vector<float> q(3 * 64, 0.1f), out(3 * 64);
  if (!cache->decode(0, ids, q.data(), out.data(), nullptr).ok()) return 1;
  Eigen::Map<Eigen::VectorXf> o(out.data(), out.size());
  std::printf("consumer: decoded %lld tokens, |o| = %.4f\n", static_cast<long long>(cache->length(*id)), o.norm());
  return std::isfinite(o.norm()) ? 0 : 1;
}
