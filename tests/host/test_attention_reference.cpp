// Bad input: every error names the problem, and nothing already stored changes.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "host/cache_test_util.hpp"

using namespace oscar;
using namespace oscar::testing;
using host::CacheConfig;
using host::PagedCache;
using host::RequestId;

namespace {

CacheConfig small_config() {
  CacheConfig c;
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.num_qo_heads = 4;
  c.head_dim = 64;
  c.page_size = 16;
  c.sink_tokens = 8;
  c.recent_tokens = 16;
  c.num_int2_pages = 16;
  c.num_bf16_pages = 16;
  c.max_requests = 4;
  return c;
}

bool contains(const Status& s, const std::string& text) { return s.message().find(text) != std::string::npos; }

}  // namespace

TEST_CASE("configuration errors") {
  CacheConfig c = small_config();
  c.head_dim = 96;
  auto r = PagedCache::create(c, std::vector<host::LayerQuantizer>(2));
  CHECK(r.status().code() == StatusCode::kUnsupported);
  CHECK(contains(r.status(), "head_dim 96"));

  c = small_config();
  c.page_size = 12;
  CHECK(contains(PagedCache::create(c, std::vector<host::LayerQuantizer>(2)).status(), "page_size 12"));
  c = small_config();
  c.quant_group_size = 48;
  CHECK(contains(PagedCache::create(c, std::vector<host::LayerQuantizer>(2)).status(), "quant_group_size 48"));
  c = small_config();
  c.num_qo_heads = 3;
  CHECK(contains(PagedCache::create(c, std::vector<host::LayerQuantizer>(2)).status(), "multiple of num_kv_heads"));
  c = small_config();
  CHECK(contains(PagedCache::create(c, std::vector<host::LayerQuantizer>(1)).status(), "1 layer quantizers"));

  std::vector<host::LayerQuantizer> layers(2);
  layers[1].k_rotation.assign(64 * 64, 0.0f);
  for (int i = 0; i < 64; ++i) layers[1].k_rotation[i * 64 + i] = 2.0f;
  CHECK(contains(PagedCache::create(c, layers).status(), "layer 1 k_rotation is not orthogonal"));
  layers[1].k_rotation.resize(100);
  CHECK(contains(PagedCache::create(c, layers).status(), "layer 1 k_rotation has 100 entries"));
}

TEST_CASE("append errors leave the cache as it was") {
  const CacheConfig config = small_config();
  PagedCache cache = make_cache(config, true);
  RowGenerator keys(1, 64), values(2, 64), queries(3, 64, 0);
  auto a = cache.add_request();
  append_in_chunks(cache, *a, 100, {100}, keys, values);
  const auto usage = cache.usage();
  const auto stored = read_cache(cache, 0, *a);
  const KvRows kv = random_kv(keys, values, config, 1000);

  auto expect_unchanged = [&] {
    CHECK(cache.length(*a) == 100);
    CHECK(cache.usage().int2_pages_used == usage.int2_pages_used);
    CHECK(cache.usage().bf16_pages_used == usage.bf16_pages_used);
    CHECK(read_cache(cache, 0, *a)[0].keys == stored[0].keys);
    CHECK(read_cache(cache, 1, *a)[1].values == read_cache(cache, 1, *a)[1].values);
  };

  const std::vector<RequestId> ids{*a};
  Status s = cache.append(ids, std::vector<int32_t>{1000}, kv.k.data(), kv.v.data());  // pool too small
  CHECK(s.code() == StatusCode::kResourceExhausted);
  CHECK(contains(s, "INT2 pool"));
  expect_unchanged();

  s = cache.append(std::vector<RequestId>{*a, *a}, std::vector<int32_t>{1, 1}, kv.k.data(), kv.v.data());
  CHECK(contains(s, "appears twice"));
  s = cache.append(std::vector<RequestId>{3}, std::vector<int32_t>{1}, kv.k.data(), kv.v.data());
  CHECK(s.code() == StatusCode::kOutOfRange);
  CHECK(contains(s, "request 3 does not exist"));
  s = cache.append(ids, std::vector<int32_t>{1, 2}, kv.k.data(), kv.v.data());
  CHECK(contains(s, "different lengths"));
  s = cache.append(ids, std::vector<int32_t>{-1}, kv.k.data(), kv.v.data());
  CHECK(contains(s, "negative"));
  s = cache.append(ids, std::vector<int32_t>{4}, nullptr, kv.v.data());
  CHECK(contains(s, "must not be null"));
  expect_unchanged();

  // A step that is planned, partly written and cancelled.
  auto plan = cache.plan_append(ids, std::vector<int32_t>{40});
  REQUIRE(plan.ok());
  CHECK(cache.length(*a) == 140);
  CHECK(cache.plan_append(ids, std::vector<int32_t>{1}).status().code() == StatusCode::kFailedPrecondition);
  CHECK(contains(cache.write(0, *plan, nullptr, kv.v.data()), "must not be null"));
  CHECK(contains(cache.write(2, *plan, kv.k.data(), kv.v.data()), "layer 2 outside"));
  REQUIRE(cache.write(0, *plan, kv.k.data(), kv.v.data()).ok());
  CHECK(contains(cache.finish(*plan), "layer 1 of this step was not written"));
  REQUIRE(cache.cancel(*plan).ok());
  expect_unchanged();
  CHECK(cache.write(0, *plan, kv.k.data(), kv.v.data()).code() == StatusCode::kFailedPrecondition);
  check_decode(cache, 0, {*a}, queries, 2e-4);
}

TEST_CASE("attention errors write no output") {
  const CacheConfig config = small_config();
  PagedCache cache = make_cache(config, true);
  RowGenerator keys(4, 64), values(5, 64), queries(6, 64, 0);
  auto a = cache.add_request();
  append_in_chunks(cache, *a, 50, {50}, keys, values);
  const std::vector<RequestId> ids{*a};
  const std::vector<float> q = random_queries(queries, config.num_qo_heads);
  std::vector<float> out(q.size(), 123.0f);
  const std::vector<float> untouched = out;

  CHECK(contains(cache.decode(5, ids, q.data(), out.data(), nullptr), "layer 5"));
  CHECK(contains(cache.decode(0, std::vector<RequestId>{2}, q.data(), out.data(), nullptr), "request 2"));
  CHECK(contains(cache.decode(0, ids, nullptr, out.data(), nullptr), "must not be null"));
  CHECK(contains(cache.extend(0, ids, std::vector<int32_t>{51}, q.data(), out.data(), nullptr), "51 query tokens"));
  CHECK(out == untouched);

  // Broken views straight into the reference: page ids, last_page_len, mismatched pools.
  auto tables = cache.page_tables(ids);
  REQUIRE(tables.ok());
  host::AttentionParams params;
  params.num_qo_heads = config.num_qo_heads;
  params.q = q.data();
  params.out = out.data();

  host::BatchTables broken = *tables;
  broken.int2.indices[0] = 99;
  params.kv = cache.view(0, broken);
  Status s = host::attention_reference(params);
  CHECK(s.code() == StatusCode::kOutOfRange);
  CHECK(contains(s, "int2 page table: indices[0] = 99 outside the pool of 16 pages"));

  broken = *tables;
  broken.recent.last_page_len[0] = 17;
  params.kv = cache.view(0, broken);
  CHECK(contains(host::attention_reference(params), "last_page_len[0] = 17"));

  broken = *tables;
  broken.int2.last_page_len[0] = 3;
  params.kv = cache.view(0, broken);
  CHECK(contains(host::attention_reference(params), "partial INT2 page"));

  params.kv = cache.view(0, *tables);
  params.kv.v_bf16.page_size = 8;  // a valid pool on its own, but not this cache's
  CHECK(contains(host::attention_reference(params), "pools disagree"));
  params.kv = cache.view(0, *tables);
  params.kv.k_int2.data = nullptr;
  CHECK(contains(host::attention_reference(params), "k_int2 pool: data must not be null"));
  params.kv = cache.view(0, *tables);
  params.num_qo_heads = 3;
  CHECK(contains(host::attention_reference(params), "num_qo_heads 3"));
  params.num_qo_heads = 4;
  params.split_tokens = 0;
  CHECK(contains(host::attention_reference(params), "split_tokens"));
  CHECK(out == untouched);
}

TEST_CASE("request slots and forks run out cleanly") {
  CacheConfig config = small_config();
  config.max_requests = 2;
  PagedCache cache = make_cache(config, false);
  auto a = cache.add_request();
  auto b = cache.add_request();
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(cache.add_request().status().code() == StatusCode::kResourceExhausted);
  CHECK(cache.fork_request(*a).status().code() == StatusCode::kResourceExhausted);
  REQUIRE(cache.release_request(*b).ok());
  CHECK(cache.release_request(*b).code() == StatusCode::kOutOfRange);
  CHECK(cache.fork_request(*a).ok());
}
