// The CPU reference cache: write / demote / decode / extend against float64 attention on the
// dequantized cache, prefix sharing, NaN isolation, and errors that change nothing.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "host/cache_test_util.hpp"

using namespace oscar;
using namespace oscar::testing;
using host::CacheConfig;
using host::PagedCache;
using host::RequestId;

namespace {

// Float32 accumulation against float64: scores carry ~d·2^-24 relative error of Σ|q_i k_i|,
// which moves the softmax weights by ~1e-6 relative; the output is a convex combination of
// values, so its error is ~1e-6·max|v| (the worst seen over all shapes below: 9e-7). 2e-5
// leaves a margin of ~20, while any real bug (a wrong code, token, page, weight or rotation)
// moves the output by a sizeable fraction of max|v|.
constexpr double kTol = 2e-5;

CacheConfig config_for(int d, int group_size, int page, int sink, int recent, int quant_group = 0) {
  CacheConfig c;
  c.num_layers = 1;
  c.num_kv_heads = 2;
  c.num_qo_heads = 2 * group_size;
  c.head_dim = d;
  c.quant_group_size = quant_group;
  c.page_size = page;
  c.sink_tokens = sink;
  c.recent_tokens = recent;
  c.num_int2_pages = 4096 / page + 64;
  c.num_bf16_pages = 4096 / page + 64;
  c.max_requests = 8;
  return c;
}

}  // namespace

TEST_CASE("decode matches float64 attention on the dequantized cache, across shapes") {
  struct Shape {
    int d, gqa, page, sink, recent, quant_group;
  };
  const Shape shapes[] = {
      {64, 1, 8, 0, 0, 0},     {64, 3, 16, 64, 256, 0}, {128, 4, 16, 64, 256, 0},
      {128, 8, 64, 0, 32, 32}, {128, 4, 8, 5, 0, 64},   {256, 4, 32, 16, 64, 0},
      {256, 1, 256, 0, 0, 32}, {64, 3, 128, 3, 7, 32},
  };
  for (const Shape& s : shapes) {
    CAPTURE(s.d);
    CAPTURE(s.gqa);
    CAPTURE(s.page);
    CAPTURE(s.sink);
    CAPTURE(s.recent);
    CAPTURE(s.quant_group);
    const CacheConfig config = config_for(s.d, s.gqa, s.page, s.sink, s.recent, s.quant_group);
    PagedCache cache = make_cache(config, true, s.d + s.page);
    RowGenerator keys(1, s.d), values(2, s.d, 2, 4.0f), queries(3, s.d, 0);
    std::vector<RequestId> ids;
    const int lengths[] = {1, 37, 700};
    for (int length : lengths) {
      auto id = cache.add_request();
      REQUIRE(id.ok());
      ids.push_back(*id);
      append_in_chunks(cache, *id, length, {length % 2 ? 1 : 300, 64, 5}, keys, values);
      CHECK(cache.length(*id) == length);
      const SegmentCounts expected = segment_counts(length, s.sink, s.recent, s.page);
      const SegmentCounts got = cache.segments(*id);
      CHECK(got.sink == expected.sink);
      CHECK(got.int2 == expected.int2);
      CHECK(got.recent == expected.recent);
    }
    const double worst = check_decode(cache, 0, ids, queries, kTol);
    MESSAGE("worst normalized error " << worst);
  }
}

TEST_CASE("the split size changes only rounding") {
  const CacheConfig config = config_for(128, 4, 16, 64, 256);
  PagedCache cache = make_cache(config, true);
  RowGenerator keys(4, 128), values(5, 128), queries(6, 128, 0);
  auto id = cache.add_request();
  append_in_chunks(cache, *id, 3000, {1000}, keys, values);
  const std::vector<RequestId> ids{*id};
  const std::vector<float> q = random_queries(queries, config.num_qo_heads);
  std::vector<float> a(q.size()), b(q.size());
  host::AttentionOptions small, large;
  small.split_tokens = 37;
  large.split_tokens = 100000;
  REQUIRE(cache.decode(0, ids, q.data(), a.data(), nullptr, small).ok());
  REQUIRE(cache.decode(0, ids, q.data(), b.data(), nullptr, large).ok());
  for (size_t i = 0; i < a.size(); ++i) CHECK(a[i] == doctest::Approx(b[i]).epsilon(1e-4).scale(1.0));
}

TEST_CASE("q_rotated and output_rotated are the same computation in another basis") {
  const CacheConfig config = config_for(64, 3, 16, 8, 32);
  PagedCache cache = make_cache(config, true);
  RowGenerator keys(7, 64), values(8, 64), queries(9, 64, 0);
  auto id = cache.add_request();
  append_in_chunks(cache, *id, 500, {500}, keys, values);
  const std::vector<RequestId> ids{*id};
  const auto& quantizer = cache.layer_quantizer(0);
  const std::vector<float> q = random_queries(queries, config.num_qo_heads);
  std::vector<float> q_rot(q.size()), out(q.size()), out_rot(q.size());
  for (int h = 0; h < config.num_qo_heads; ++h) rotate_row(&q[h * 64], quantizer.k_rotation.data(), 64, &q_rot[h * 64]);
  REQUIRE(cache.decode(0, ids, q.data(), out.data(), nullptr).ok());
  host::AttentionOptions options;
  options.q_rotated = true;
  options.output_rotated = true;
  REQUIRE(cache.decode(0, ids, q_rot.data(), out_rot.data(), nullptr, options).ok());
  for (int h = 0; h < config.num_qo_heads; ++h) {
    std::vector<float> back(64);
    unrotate_row(&out_rot[h * 64], quantizer.v_rotation.data(), 64, back.data());
    for (int i = 0; i < 64; ++i) CHECK(back[i] == doctest::Approx(out[h * 64 + i]).epsilon(1e-4).scale(1e-3));
  }
}

TEST_CASE("values_prerotated stores V as given") {
  CacheConfig config = config_for(64, 3, 16, 0, 16);
  config.values_prerotated = true;
  PagedCache cache = make_cache(config, true);
  RowGenerator keys(10, 64), values(11, 64), queries(12, 64, 0);
  auto id = cache.add_request();
  append_in_chunks(cache, *id, 100, {100}, keys, values);
  // The window's V rows are the input rows, unrotated: compare against the window contents.
  const auto heads = read_cache(cache, 0, *id);
  CHECK(heads[0].values.size() == 100);
  check_decode(cache, 0, {*id}, queries, kTol);
}

TEST_CASE("extend: chunked prefill sees a causal prefix through the cache") {
  for (int page : {8, 64}) {
    const CacheConfig config = config_for(128, 4, page, 16, 64);
    PagedCache cache = make_cache(config, true);
    RowGenerator keys(13, 128), values(14, 128), queries(15, 128, 0);
    auto a = cache.add_request();
    auto b = cache.add_request();
    const std::vector<RequestId> ids{*a, *b};
    // Chunks of a prompt: each step appends then extends, like chunked prefill.
    const std::vector<std::vector<int32_t>> steps{{100, 3}, {1, 250}, {250, 1}, {7, 0}};
    for (const auto& counts : steps) {
      int total = counts[0] + counts[1];
      const KvRows kv = random_kv(keys, values, config, total);
      auto plan = cache.plan_append(ids, counts);
      REQUIRE(plan.ok());
      REQUIRE(cache.write(0, *plan, kv.k.data(), kv.v.data()).ok());
      const std::vector<float> q = random_queries(queries, size_t(total) * config.num_qo_heads);
      std::vector<float> out(q.size(), std::nanf(""));
      std::vector<float> lse(size_t(total) * config.num_qo_heads, std::nanf(""));
      REQUIRE(cache.extend(0, ids, counts, q.data(), out.data(), lse.data()).ok());
      REQUIRE(cache.finish(*plan).ok());
      int row = 0;
      for (int r = 0; r < 2; ++r) {
        const auto heads = read_cache(cache, 0, ids[r]);
        const double scale = value_scale(heads);
        const int64_t length = cache.length(ids[r]);
        for (int i = 0; i < counts[r]; ++i, ++row) {
          for (int h = 0; h < config.num_qo_heads; ++h) {
            const size_t at = size_t(row) * config.num_qo_heads + h;
            const auto ref = oracle_attention(cache, 0, heads, h, &q[at * 128], length - counts[r] + i);
            for (int e = 0; e < 128; ++e) CHECK(std::abs(out[at * 128 + e] - ref.out[e]) <= kTol * scale);
            CHECK(std::abs(lse[at] - ref.lse) <= kTol * (1 + std::abs(ref.lse)));
          }
        }
      }
    }
  }
}

TEST_CASE("tokens written straight to INT2 get the bytes a demotion would write") {
  const CacheConfig config = config_for(128, 2, 16, 20, 48, 64);
  PagedCache bulk = make_cache(config, true), one_by_one = make_cache(config, true);
  RowGenerator keys(16, 128), values(17, 128);
  const KvRows kv = random_kv(keys, values, config, 500);
  auto a = bulk.add_request();
  auto b = one_by_one.add_request();
  const int32_t n = 500;
  REQUIRE(bulk.append(std::span<const RequestId>(&*a, 1), std::span<const int32_t>(&n, 1), kv.k.data(), kv.v.data()).ok());
  const size_t row = size_t(config.num_kv_heads) * 128;
  for (int t = 0; t < 500; ++t) {
    const int32_t one = 1;
    REQUIRE(one_by_one.append(std::span<const RequestId>(&*b, 1), std::span<const int32_t>(&one, 1),
                              kv.k.data() + t * row, kv.v.data() + t * row).ok());
  }
  const auto x = read_cache(bulk, 0, *a), y = read_cache(one_by_one, 0, *b);
  for (int h = 0; h < config.num_kv_heads; ++h) {
    REQUIRE(x[h].keys.size() == 500);
    CHECK(x[h].keys == y[h].keys);  // exact: same codes, same fp16 metadata
    CHECK(x[h].values == y[h].values);
  }
  CHECK(bulk.usage().int2_pages_used == one_by_one.usage().int2_pages_used);
  CHECK(bulk.usage().bf16_pages_used == one_by_one.usage().bf16_pages_used);
}

TEST_CASE("stored rows are the bf16-rounded rotation, and INT2 rows its quantization") {
  const CacheConfig config = config_for(64, 1, 8, 8, 8);
  PagedCache cache = make_cache(config, true);
  RowGenerator keys(18, 64), values(19, 64);
  const KvRows kv = random_kv(keys, values, config, 64);
  auto id = cache.add_request();
  const int32_t n = 64;
  REQUIRE(cache.append(std::span<const RequestId>(&*id, 1), std::span<const int32_t>(&n, 1), kv.k.data(), kv.v.data()).ok());
  const auto heads = read_cache(cache, 0, *id);
  const auto& r = cache.layer_quantizer(0).k_rotation;
  const SegmentCounts seg = cache.segments(*id);
  for (int t = 0; t < 64; ++t) {
    std::vector<double> x(64);
    for (int i = 0; i < 64; ++i) x[i] = bf16_to_float(kv.k[(size_t(t) * 2 + 1) * 64 + i]);
    const auto exact = naive_rotate(x, std::vector<double>(r.begin(), r.end()), 64);
    const bool int2 = t >= seg.sink && t < seg.sink + seg.int2;
    for (int i = 0; i < 64; ++i) {
      const double stored = heads[1].keys[t][i];
      if (!int2) {
        CHECK(std::abs(stored - exact[i]) <= std::abs(exact[i]) * std::ldexp(1.0, -8) + 1e-6);
      }
    }
    if (int2) {  // reconstruction close to the rotated row (2-bit: errors up to a step)
      double err = 0, norm = 0;
      for (int i = 0; i < 64; ++i) {
        err += (heads[1].keys[t][i] - exact[i]) * (heads[1].keys[t][i] - exact[i]);
        norm += exact[i] * exact[i];
      }
      CHECK(std::sqrt(err / norm) < 0.5);
    }
  }
}

TEST_CASE("with an exact (all-BF16) cache, attention does not depend on the rotation") {
  CacheConfig config = config_for(128, 4, 16, 100000, 0);
  PagedCache plain = make_cache(config, false), rotated = make_cache(config, true);
  RowGenerator keys(20, 128), values(21, 128), queries(22, 128, 0);
  const KvRows kv = random_kv(keys, values, config, 400);
  auto a = plain.add_request();
  auto b = rotated.add_request();
  const int32_t n = 400;
  REQUIRE(plain.append(std::span<const RequestId>(&*a, 1), std::span<const int32_t>(&n, 1), kv.k.data(), kv.v.data()).ok());
  REQUIRE(rotated.append(std::span<const RequestId>(&*b, 1), std::span<const int32_t>(&n, 1), kv.k.data(), kv.v.data()).ok());
  CHECK(plain.segments(*a).int2 == 0);
  CHECK(rotated.segments(*b).int2 == 0);
  const std::vector<float> q = random_queries(queries, config.num_qo_heads);
  std::vector<float> x(q.size()), y(q.size());
  REQUIRE(plain.decode(0, std::vector<RequestId>{*a}, q.data(), x.data(), nullptr).ok());
  REQUIRE(rotated.decode(0, std::vector<RequestId>{*b}, q.data(), y.data(), nullptr).ok());

  // Exact attention on the unrotated input rows, in float64.
  const auto heads = read_cache(plain, 0, *a);  // identity rotation: the input rows themselves
  const double vmax = value_scale(heads);
  double worst_plain = 0, worst_rotated = 0;
  for (int h = 0; h < config.num_qo_heads; ++h) {
    const auto ref = oracle_attention(plain, 0, heads, h, &q[h * 128], n - 1);
    for (int i = 0; i < 128; ++i) {
      worst_plain = std::max(worst_plain, std::abs(x[h * 128 + i] - ref.out[i]) / vmax);
      worst_rotated = std::max(worst_rotated, std::abs(y[h * 128 + i] - ref.out[i]) / vmax);
    }
  }
  CHECK(worst_plain <= kTol);  // the inputs are bf16 already: nothing was rounded
  // Rotated rows are rounded to bf16 (2^-9 relative per element): V moves the output by up
  // to ~2^-9·max|v|, K moves the scores by ~2^-9·Σ|q_i k_i|/sqrt(d) (~10 here), i.e. the
  // weights by ~2%, which moves the output by a fraction of that times the spread of v.
  // 2^-7·max|v| bounds both with a margin of ~10 over what is seen (~7e-4·max|v|).
  CHECK(worst_rotated <= std::ldexp(1.0, -7));
  MESSAGE("exact cache, error/max|v|: identity " << worst_plain << ", rotated " << worst_rotated);
}

TEST_CASE("prefix sharing: forked requests share full pages and never rewrite them") {
  const CacheConfig config = config_for(64, 3, 16, 24, 40);
  PagedCache cache = make_cache(config, true);
  RowGenerator keys(23, 64), values(24, 64), queries(25, 64, 0);
  auto parent = cache.add_request();
  append_in_chunks(cache, *parent, 437, {200}, keys, values);  // sink 24, INT2 368, window 45
  const auto before_usage = cache.usage();
  auto child = cache.fork_request(*parent);
  REQUIRE(child.ok());
  const auto forked_usage = cache.usage();
  CHECK(forked_usage.int2_pages_used == before_usage.int2_pages_used);  // shared, not copied
  CHECK(forked_usage.int2_pages_shared == 368 / 16);
  // Copied: the partial sink page and the partial window page.
  CHECK(forked_usage.bf16_pages_used == before_usage.bf16_pages_used + 2);

  // Snapshot every shared page's bytes.
  auto tables = cache.page_tables(std::vector<RequestId>{*parent});
  REQUIRE(tables.ok());
  const std::vector<int32_t> shared_int2 = tables->int2.indices;
  const Int2PoolRef k_int2 = cache.int2_pool(0, PagedCache::Tensor::kKeys);
  std::vector<std::vector<uint8_t>> snapshot;
  for (int32_t page : shared_int2) {
    const uint8_t* block = k_int2.block(page, 0);
    snapshot.emplace_back(block, block + k_int2.stride_page);
  }
  const auto parent_cache_before = read_cache(cache, 0, *parent);
  CHECK(read_cache(cache, 0, *child)[0].keys == parent_cache_before[0].keys);

  append_in_chunks(cache, *parent, 100, {1}, keys, values);
  append_in_chunks(cache, *child, 150, {150}, keys, values);
  for (size_t i = 0; i < shared_int2.size(); ++i) {
    const uint8_t* block = k_int2.block(shared_int2[i], 0);
    CHECK(std::memcmp(block, snapshot[i].data(), snapshot[i].size()) == 0);
  }
  // The common prefix reads the same in both requests.
  const auto p = read_cache(cache, 0, *parent), c = read_cache(cache, 0, *child);
  for (size_t t = 0; t < 437; ++t) CHECK(p[1].keys[t] == c[1].keys[t]);
  check_decode(cache, 0, {*parent, *child}, queries, kTol);

  // Releasing the parent keeps the child intact; releasing both frees every page.
  const std::vector<float> q = random_queries(queries, config.num_qo_heads);
  std::vector<float> before(q.size()), after(q.size());
  REQUIRE(cache.decode(0, std::vector<RequestId>{*child}, q.data(), before.data(), nullptr).ok());
  REQUIRE(cache.release_request(*parent).ok());
  REQUIRE(cache.decode(0, std::vector<RequestId>{*child}, q.data(), after.data(), nullptr).ok());
  CHECK(before == after);
  REQUIRE(cache.release_request(*child).ok());
  CHECK(cache.usage().int2_pages_used == 0);
  CHECK(cache.usage().bf16_pages_used == 0);
}

TEST_CASE("NaN or Inf in one token changes no other request's output") {
  for (float bad : {std::nanf(""), INFINITY}) {
    for (int where : {3, 100, 299}) {  // sink, INT2, window
      CAPTURE(where);
      const CacheConfig config = config_for(64, 3, 16, 8, 64);
      PagedCache cache = make_cache(config, true);
      RowGenerator keys(26, 64), values(27, 64), queries(28, 64, 0);
      auto a = cache.add_request();
      auto b = cache.add_request();
      const std::vector<RequestId> ids{*a, *b};
      const std::vector<int32_t> counts{300, 300};
      KvRows kv = random_kv(keys, values, config, 600);
      const std::vector<float> q = random_queries(queries, 2 * config.num_qo_heads);

      PagedCache clean = make_cache(config, true);
      auto ca = clean.add_request();
      auto cb = clean.add_request();
      REQUIRE(clean.append(std::vector<RequestId>{*ca, *cb}, counts, kv.k.data(), kv.v.data()).ok());
      std::vector<float> expected(q.size());
      REQUIRE(clean.decode(0, std::vector<RequestId>{*ca, *cb}, q.data(), expected.data(), nullptr).ok());

      kv.k[(size_t(where) * 2 + 0) * 64 + 5] = float_to_bf16(bad);  // request a, kv head 0
      REQUIRE(cache.append(ids, counts, kv.k.data(), kv.v.data()).ok());
      std::vector<float> out(q.size());
      REQUIRE(cache.decode(0, ids, q.data(), out.data(), nullptr).ok());
      const size_t half = q.size() / 2;
      for (size_t i = half; i < q.size(); ++i) CHECK(out[i] == expected[i]);  // request b: bit-equal
      // Request a, heads reading kv head 0: the fault shows; heads of kv head 1: untouched.
      CHECK(std::isnan(out[0]));
      for (size_t i = 3 * 64; i < half; ++i) CHECK(out[i] == expected[i]);
    }
  }
}

TEST_CASE("several layers keep their own rotations and pools") {
  CacheConfig config = config_for(64, 3, 16, 8, 16);
  config.num_layers = 3;
  PagedCache cache = make_cache(config, true, 77);
  RowGenerator keys(29, 64), values(30, 64), queries(31, 64, 0);
  auto id = cache.add_request();
  append_in_chunks(cache, *id, 300, {120, 1}, keys, values);
  for (int layer = 0; layer < 3; ++layer) check_decode(cache, layer, {*id}, queries, kTol);
  CHECK(read_cache(cache, 0, *id)[0].keys != read_cache(cache, 1, *id)[0].keys);
}

TEST_CASE("accessors given a layer or page outside the cache return refusable null pools, not memory past it") {
  CacheConfig config = config_for(64, 3, 16, 8, 16);
  config.num_layers = 2;
  PagedCache cache = make_cache(config, true, 78);
  RowGenerator keys(29, 64), values(30, 64);
  auto id = cache.add_request();
  REQUIRE(id.ok());
  append_in_chunks(cache, *id, 40, {40}, keys, values);
  const RequestId ids[] = {*id};
  auto tables = cache.page_tables(ids);
  REQUIRE(tables.ok());
  CHECK(validate(cache.view(1, *tables)).ok());
  for (int32_t layer : {-1, 2, 1 << 30}) {
    CAPTURE(layer);
    CHECK(cache.int2_pool(layer, PagedCache::Tensor::kKeys).data == nullptr);
    CHECK(cache.bf16_pool(layer, PagedCache::Tensor::kValues).data == nullptr);
    const Status s = validate(cache.view(layer, *tables));
    CHECK(s.message().find("must not be null") != std::string::npos);
  }
  CHECK(cache.bf16_ref_count(0) == 1);  // the sink page of the one request
  for (int32_t page : {-1, config.num_int2_pages, 1 << 30}) {
    CHECK(cache.int2_ref_count(page) == -1);
  }
  CHECK(cache.bf16_ref_count(config.num_bf16_pages) == -1);
}

TEST_CASE("device pools: a books-only cache (host_pools = false) plans what the full cache plans") {
  CacheConfig config = config_for(64, 3, 16, 24, 40);
  config.num_layers = 2;
  PagedCache full = make_cache(config, true);
  CacheConfig books_config = config;
  books_config.host_pools = false;
  auto made = PagedCache::create(books_config, std::vector<host::LayerQuantizer>(config.num_layers));
  REQUIRE(made.ok());
  PagedCache books = std::move(made).value();
  CHECK(books.int2_pool(0, PagedCache::Tensor::kKeys).data == nullptr);  // no host memory for the pools
  CHECK(books.bf16_pool(1, PagedCache::Tensor::kValues).data == nullptr);

  RowGenerator keys(31, 64), values(32, 64);
  std::vector<RequestId> ids{*full.add_request(), *full.add_request()};
  REQUIRE(*books.add_request() == ids[0]);
  REQUIRE(*books.add_request() == ids[1]);
  auto same_tables = [&](const std::vector<RequestId>& batch) {
    auto a = full.page_tables(batch), b = books.page_tables(batch);
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    for (auto [x, y] : {std::pair{&a->sink, &b->sink}, {&a->int2, &b->int2}, {&a->recent, &b->recent}}) {
      CHECK(x->indptr == y->indptr);
      CHECK(x->indices == y->indices);
      CHECK(x->last_page_len == y->last_page_len);
    }
  };
  auto step = [&](const std::vector<RequestId>& batch, const std::vector<int32_t>& counts) {
    auto a = full.plan_append(batch, counts);
    auto b = books.plan_append(batch, counts);
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    CHECK(a->token_indptr == b->token_indptr);
    REQUIRE(a->slots.size() == b->slots.size());
    for (size_t i = 0; i < a->slots.size(); ++i) {
      CHECK(std::memcmp(&a->slots[i], &b->slots[i], sizeof(TokenSlot)) == 0);
    }
    REQUIRE(a->demotions.size() == b->demotions.size());
    for (size_t i = 0; i < a->demotions.size(); ++i) {
      CHECK(std::memcmp(&a->demotions[i], &b->demotions[i], sizeof(PageDemotion)) == 0);
    }
    CHECK(a->bf16_pages_to_release == b->bf16_pages_to_release);
    const int tokens = static_cast<int>(a->slots.size());
    const KvRows kv = random_kv(keys, values, config, tokens);
    const size_t layer_rows = size_t(tokens) * config.num_kv_heads * config.head_dim;
    for (int l = 0; l < config.num_layers; ++l) {
      REQUIRE(full.write(l, *a, kv.k.data() + l * layer_rows, kv.v.data() + l * layer_rows).ok());
    }
    CHECK(books.write(0, *b, kv.k.data(), kv.v.data()).code() == StatusCode::kFailedPrecondition);
    REQUIRE(full.finish(*a).ok());
    REQUIRE(books.finish(*b).ok());  // the device wrote the layers; the books cannot know
    same_tables(batch);
  };
  step(ids, {437, 30});  // prefill: mostly straight to INT2
  for (int i = 0; i < 20; ++i) step(ids, {1, 1});  // decode steps with demotions

  // A fork copies the partial BF16 pages: the books report them for the device to copy.
  std::vector<host::PageCopy> full_copies, book_copies;
  CHECK(books.fork_request(ids[0]).status().code() == StatusCode::kInvalidArgument);  // no list given
  auto child = full.fork_request(ids[0], &full_copies);
  auto book_child = books.fork_request(ids[0], &book_copies);
  REQUIRE(child.ok());
  REQUIRE(book_child.ok());
  CHECK(*child == *book_child);
  CHECK(full_copies.size() == 2);  // the partial sink page and the partial window page
  REQUIRE(book_copies.size() == full_copies.size());
  for (size_t i = 0; i < full_copies.size(); ++i) {
    CHECK(book_copies[i].from == full_copies[i].from);
    CHECK(book_copies[i].to == full_copies[i].to);
  }
  const std::vector<RequestId> all{ids[0], ids[1], *child};
  same_tables(all);
  for (int i = 0; i < 5; ++i) step(all, {1, 3, 17});
  CHECK(full.usage().bf16_pages_used == books.usage().bf16_pages_used);
  CHECK(full.usage().int2_pages_shared == books.usage().int2_pages_shared);

  std::vector<float> q(size_t(config.num_qo_heads) * 64, 0.5f), out(q.size());
  CHECK(books.decode(0, std::vector<RequestId>{ids[1]}, q.data(), out.data(), nullptr).code() ==
        StatusCode::kFailedPrecondition);
}

TEST_CASE("a write plan of another cache is refused, with or without host pools") {
  // Two caches (a draft and a target model's, say), each with its first step open: cache B
  // must not take cache A's plan, whose slots and pages index A's pools (B's are smaller).
  for (const bool host_pools : {true, false}) {
    CAPTURE(host_pools);
    CacheConfig big = config_for(64, 1, 8, 0, 0), small = big;
    big.num_int2_pages = 64;
    big.num_bf16_pages = 64;
    big.host_pools = host_pools;
    small.num_int2_pages = 2;
    small.num_bf16_pages = 2;
    small.host_pools = host_pools;
    PagedCache a = make_cache(big, false), b = make_cache(small, false);
    const std::vector<RequestId> a_ids{*a.add_request()}, b_ids{*b.add_request()};
    auto a_plan = a.plan_append(a_ids, std::vector<int32_t>{400});
    auto b_plan = b.plan_append(b_ids, std::vector<int32_t>{1});
    REQUIRE(a_plan.ok());
    REQUIRE(b_plan.ok());
    RowGenerator keys(1, 64), values(2, 64);
    const KvRows kv = random_kv(keys, values, big, 400);
    if (host_pools) {
      CHECK(b.write(0, *a_plan, kv.k.data(), kv.v.data()).code() == StatusCode::kFailedPrecondition);
    }
    CHECK(b.finish(*a_plan).code() == StatusCode::kFailedPrecondition);
    CHECK(b.cancel(*a_plan).code() == StatusCode::kFailedPrecondition);
    // Each cache still takes its own plan.
    if (host_pools) REQUIRE(b.write(0, *b_plan, kv.k.data(), kv.v.data()).ok());
    CHECK(b.finish(*b_plan).ok());
    CHECK(a.cancel(*a_plan).ok());
  }
}
