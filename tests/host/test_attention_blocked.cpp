// The blocked CPU attention path (host/attention_blocked.hpp) against the scalar reference
// (host/attention_reference.hpp), which the GPU kernels are checked against in turn.
//
// Tolerance. Both paths compute the same float32 arithmetic in different orders, with the
// same rotate_row / unrotate_row (the rotated q and the un-rotation are bit-identical). The
// differences, per query row with n visible keys (u = 2^-24):
//   - a score q·k: a length-d float32 dot product, in another order (Eigen's blocked product;
//     for INT2 keys the dequantized row instead of scale·Σq·c + offset·Σq), and sm_scale
//     applied to q instead of to the score: |Δs| <= δ = (2d + 4)·u·scale·‖q‖·max‖k‖
//     (the standard γ_d bound of each path, Cauchy-Schwarz for Σ|q_i||k_i|);
//   - weights exp(s - m)/l move by a relative factor within e^{±2δ}, so the convex
//     combination o = Σ p·v moves by <= (e^{2δ} - 1)·2·max|v| ≈ 4δ·max|v|;
//   - sums over the keys (l, P·V) and the online-softmax rescales, in another order and with
//     other block boundaries than split_tokens: <= 4(n + d)·u·max|v| (and relative in l).
// So |Δo| <= max|v|·(4δ + 4(n + d)·u) and |Δlse| <= 2δ + 4(n + d)·u·(1 + |lse|). These are
// worst-case bounds; the check reports how much of the bound was used, and the sensitivity
// test shows a 1% change of sm_scale or a swap of two GQA heads does not fit in it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "host/cache_test_util.hpp"
#include "oscar/host/attention_blocked.hpp"

using namespace oscar;
using namespace oscar::testing;
using host::CacheConfig;
using host::PagedCache;
using host::RequestId;

namespace {

constexpr double kU = 5.9604644775390625e-8;  // 2^-24

struct Shape {
  int head_dim = 64;
  int num_kv_heads = 2;
  int group = 2;  // query heads per KV head
  int page_size = 16;
  int sink = 16;
  int recent = 32;
  int quant_group_size = 0;
};

CacheConfig config_of(const Shape& s) {
  CacheConfig c;
  c.num_layers = 1;
  c.num_kv_heads = s.num_kv_heads;
  c.num_qo_heads = s.num_kv_heads * s.group;
  c.head_dim = s.head_dim;
  c.page_size = s.page_size;
  c.sink_tokens = s.sink;
  c.recent_tokens = s.recent;
  c.quant_group_size = s.quant_group_size;
  c.num_int2_pages = 512;
  c.num_bf16_pages = 256;
  c.max_requests = 8;
  return c;
}

double norm(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v * v;
  return std::sqrt(s);
}
double norm(const float* x, int d) {
  double s = 0;
  for (int i = 0; i < d; ++i) s += double{x[i]} * x[i];
  return std::sqrt(s);
}

struct Comparison {
  double used = 0;  // largest |difference| / bound over every output element and lse
  bool same_non_finite = true;
};

// Runs the reference and the blocked path on the same batch and compares every row against
// the bound above. num_query_tokens empty: decode. Outputs start as NaN, so a row the blocked
// path does not write fails.
Comparison compare(const PagedCache& cache, const std::vector<RequestId>& ids,
                   const std::vector<int32_t>& num_query_tokens, const std::vector<float>& q,
                   const host::AttentionOptions& base, const host::BlockedAttentionOptions& blocked,
                   float blocked_scale_factor = 1.0f, bool swap_heads = false) {
  const CacheConfig& c = cache.config();
  const int d = c.head_dim;
  const int group = c.num_qo_heads / c.num_kv_heads;
  const size_t rows = q.size() / d;
  std::vector<float> out_ref(q.size(), std::nanf("")), out_blk(q.size(), std::nanf(""));
  std::vector<float> lse_ref(rows, std::nanf("")), lse_blk(rows, std::nanf(""));
  host::AttentionOptions fast = base;
  fast.path = host::blocked_attention(blocked);
  if (blocked_scale_factor != 1.0f) {
    fast.sm_scale = (base.sm_scale > 0 ? base.sm_scale : 1.0f / std::sqrt(float(d))) * blocked_scale_factor;
  }
  Status s_ref, s_blk;
  if (num_query_tokens.empty()) {
    s_ref = cache.decode(0, ids, q.data(), out_ref.data(), lse_ref.data(), base);
    s_blk = cache.decode(0, ids, q.data(), out_blk.data(), lse_blk.data(), fast);
  } else {
    s_ref = cache.extend(0, ids, num_query_tokens, q.data(), out_ref.data(), lse_ref.data(), base);
    s_blk = cache.extend(0, ids, num_query_tokens, q.data(), out_blk.data(), lse_blk.data(), fast);
  }
  REQUIRE_MESSAGE(s_ref.ok(), s_ref.to_string());
  REQUIRE_MESSAGE(s_blk.ok(), s_blk.to_string());
  if (swap_heads) {  // a wrong GQA mapping: query heads 0 and 1 exchanged
    for (size_t r = 0; r + 1 < rows; r += c.num_qo_heads) {
      std::swap_ranges(out_blk.begin() + r * d, out_blk.begin() + (r + 1) * d, out_blk.begin() + (r + 1) * d);
      std::swap(lse_blk[r], lse_blk[r + 1]);
    }
  }

  const float sm_scale = base.sm_scale > 0 ? base.sm_scale : 1.0f / std::sqrt(float(d));
  Comparison result;
  size_t row = 0;
  for (size_t b = 0; b < ids.size(); ++b) {
    const auto heads = read_cache(cache, 0, ids[b]);
    const int64_t length = cache.length(ids[b]);
    const int n_q = num_query_tokens.empty() ? 1 : num_query_tokens[b];
    for (int t = 0; t < n_q; ++t) {
      const double visible = double(length - n_q + t + 1);
      for (int h = 0; h < c.num_qo_heads; ++h, ++row) {
        const DenseHead& head = heads[h / group];
        double max_k = 0, max_v = 0;
        for (const auto& k : head.keys) max_k = std::max(max_k, norm(k));
        for (const auto& v : head.values)
          for (double x : v) max_v = std::max(max_v, std::abs(x));
        const double delta = (2.0 * d + 4) * kU * sm_scale * norm(q.data() + row * d, d) * max_k;
        const double sums = 4.0 * (visible + d) * kU;
        const double bound_o = std::max(max_v, 1e-30) * (4 * delta + sums);
        for (int i = 0; i < d; ++i) {
          const float a = out_ref[row * d + i], x = out_blk[row * d + i];
          if (!std::isfinite(a) || !std::isfinite(x)) {
            result.same_non_finite &= std::isnan(a) == std::isnan(x) && (std::isnan(a) || a == x);
            continue;
          }
          result.used = std::max(result.used, std::abs(double{a} - x) / bound_o);
        }
        const float la = lse_ref[row], lx = lse_blk[row];
        if (!std::isfinite(la) || !std::isfinite(lx)) {
          result.same_non_finite &= std::isnan(la) == std::isnan(lx) && (std::isnan(la) || la == lx);
          continue;
        }
        const double bound_lse = 2 * delta + sums * (1 + std::abs(la));
        result.used = std::max(result.used, std::abs(double{la} - lx) / bound_lse);
      }
    }
  }
  return result;
}

void check_agrees(const PagedCache& cache, const std::vector<RequestId>& ids,
                  const std::vector<int32_t>& num_query_tokens, const std::vector<float>& q,
                  const host::AttentionOptions& base, const host::BlockedAttentionOptions& blocked) {
  const Comparison r = compare(cache, ids, num_query_tokens, q, base, blocked);
  CHECK(r.same_non_finite);
  CHECK_MESSAGE(r.used <= 1.0, "used ", r.used, " of the float32 summation-order bound");
  MESSAGE("worst difference: ", r.used, " of the bound");
}

// Requests of the given lengths, filled in ragged chunks so sink, INT2 and recent segments
// take every shape (empty included).
std::vector<RequestId> fill(PagedCache& cache, const std::vector<int>& lengths, uint64_t seed) {
  const int d = cache.config().head_dim;
  RowGenerator keys(seed, d), values(seed + 1, d);
  std::vector<RequestId> ids;
  for (int len : lengths) {
    auto id = cache.add_request();
    REQUIRE(id.ok());
    if (len > 0) append_in_chunks(cache, *id, len, {7, 1, 23, 16}, keys, values);
    ids.push_back(*id);
  }
  return ids;
}

}  // namespace

TEST_CASE("decode: blocked agrees with the reference across shapes") {
  struct Case {
    Shape shape;
    bool rotate;
    int block;
    int threads;
  };
  const std::vector<Case> cases = {
      {{64, 3, 3, 16, 64, 256, 0}, true, 64, 1},    // the SmolLM2 shape
      {{64, 2, 1, 8, 8, 16, 0}, false, 7, 1},       // MHA, blocks across page boundaries
      {{128, 2, 4, 16, 16, 32, 32}, true, 64, 2},   // several quantization groups, threads
      {{128, 1, 8, 32, 0, 0, 0}, true, 32, 1},      // no sink, no window: INT2 only
      {{256, 2, 2, 16, 32, 16, 0}, false, 128, 3},  // more threads than some batches need
      {{256, 1, 5, 64, 64, 64, 64}, true, 1, 1},    // one key per block
  };
  for (const Case& k : cases) {
    CAPTURE(k.shape.head_dim);
    CAPTURE(k.shape.group);
    CAPTURE(k.shape.page_size);
    CAPTURE(k.block);
    CAPTURE(k.rotate);
    const CacheConfig config = config_of(k.shape);
    PagedCache cache = make_cache(config, k.rotate, 11);
    // Empty, sink-only, sink + window, all three segments, long.
    const auto ids = fill(cache, {0, 5, 40, 137, 600}, 21);
    RowGenerator gen(31, config.head_dim, 0);
    const auto q = random_queries(gen, ids.size() * config.num_qo_heads);
    check_agrees(cache, ids, {}, q, {}, {k.block, k.threads});
  }
}

TEST_CASE("extend: blocked agrees with the reference on ragged causal batches") {
  for (int d : {64, 128, 256}) {
    for (int group : {1, 3, 8}) {
      for (bool rotate : {false, true}) {
        CAPTURE(d);
        CAPTURE(group);
        CAPTURE(rotate);
        Shape shape{d, 2, group, 16, 16, 48, 0};
        const CacheConfig config = config_of(shape);
        PagedCache cache = make_cache(config, rotate, 5);
        const auto ids = fill(cache, {1, 30, 97, 300}, 41);
        // Every request's newest tokens as queries: one, all of them, a block's worth, none.
        const std::vector<int32_t> n_q = {1, 30, 64, 0};
        RowGenerator gen(51, d, 0);
        const auto q = random_queries(gen, size_t(1 + 30 + 64) * config.num_qo_heads);
        for (int block : {16, 64}) check_agrees(cache, ids, n_q, q, {}, {block, 2});
      }
    }
  }
}

TEST_CASE("blocked: q_rotated, output_rotated, sm_scale and split_tokens behave as in the reference") {
  const CacheConfig config = config_of({128, 2, 2, 16, 16, 32, 0});
  PagedCache cache = make_cache(config, true, 3);
  const auto ids = fill(cache, {200, 77}, 61);
  RowGenerator gen(71, 128, 0);
  const auto q = random_queries(gen, size_t(2) * config.num_qo_heads);
  for (bool q_rotated : {false, true}) {
    for (bool output_rotated : {false, true}) {
      host::AttentionOptions base;
      base.q_rotated = q_rotated;
      base.output_rotated = output_rotated;
      base.sm_scale = 0.05f;
      base.split_tokens = 37;  // the reference merges partials; the blocked path has one state
      check_agrees(cache, ids, {}, q, base, {});
    }
  }
}

TEST_CASE("the tolerance is not vacuous: a 1% scale error or swapped GQA heads fail it") {
  const CacheConfig config = config_of({64, 3, 3, 16, 64, 256, 0});
  PagedCache cache = make_cache(config, true, 9);
  const auto ids = fill(cache, {500}, 81);
  RowGenerator gen(91, 64, 0);
  const auto q = random_queries(gen, size_t(16) * config.num_qo_heads);
  const std::vector<int32_t> n_q = {16};
  CHECK(compare(cache, ids, n_q, q, {}, {}).used <= 1.0);
  CHECK(compare(cache, ids, n_q, q, {}, {}, 1.01f).used > 1.0);
  CHECK(compare(cache, ids, n_q, q, {}, {}, 1.0f, true).used > 1.0);
}

TEST_CASE("a non-finite row shows in the same outputs as in the reference, and nowhere else") {
  // One Inf value in a token that later queries see and earlier ones do not: masked keys must
  // not be multiplied (0·Inf = NaN), INT2 rows read back as NaN.
  const CacheConfig config = config_of({64, 1, 3, 16, 16, 32, 0});
  for (int bad_token : {5, 40, 150}) {  // sink, INT2 (demoted), recent window
    CAPTURE(bad_token);
    PagedCache cache = make_cache(config, false, 13);
    auto id = cache.add_request();
    REQUIRE(id.ok());
    RowGenerator keys(101, 64), values(102, 64);
    const int length = 180;
    for (int t = 0; t < length; ++t) {
      KvRows kv = random_kv(keys, values, config, 1);
      if (t == bad_token) kv.v[3] = float_to_bf16(INFINITY);
      const int32_t one = 1;
      REQUIRE(cache.append(std::span<const RequestId>(&*id, 1), std::span<const int32_t>(&one, 1), kv.k.data(),
                           kv.v.data()).ok());
    }
    RowGenerator gen(103, 64, 0);
    const int n = length - std::min(bad_token, 100);  // queries from before the bad token on
    const auto q = random_queries(gen, size_t(n) * config.num_qo_heads);
    const Comparison r = compare(cache, {*id}, {n}, q, {}, {64, 1});
    CHECK(r.same_non_finite);
    CHECK(r.used <= 1.0);
  }
}

TEST_CASE("blocked: the same argument errors as the reference, and no output written") {
  const CacheConfig config = config_of({64, 2, 2, 16, 8, 16, 0});
  PagedCache cache = make_cache(config, true, 17);
  const auto ids = fill(cache, {50}, 111);
  RowGenerator gen(121, 64, 0);
  const std::vector<float> q = random_queries(gen, config.num_qo_heads);
  std::vector<float> out(q.size(), 123.0f);
  const std::vector<float> untouched = out;
  auto tables = cache.page_tables(ids);
  REQUIRE(tables.ok());

  auto both_fail_alike = [&](host::AttentionParams params, const std::string& text) {
    const Status ref = host::attention_reference(params);
    const Status blk = host::attention_blocked(params);
    CHECK_MESSAGE(!blk.ok(), text);
    CHECK(blk.code() == ref.code());
    CHECK(blk.message() == ref.message());
    CHECK_MESSAGE(blk.message().find(text) != std::string::npos, blk.message());
    CHECK(out == untouched);
  };
  host::AttentionParams good;
  good.kv = cache.view(0, *tables);
  good.num_qo_heads = config.num_qo_heads;
  good.q = q.data();
  good.out = out.data();
  REQUIRE(host::attention_blocked(good).ok());
  out = untouched;

  host::AttentionParams p = good;
  host::BatchTables broken = *tables;
  broken.int2.indices[0] = 9999;
  p.kv = cache.view(0, broken);
  both_fail_alike(p, "int2 page table: indices[0] = 9999 outside the pool");
  broken = *tables;
  broken.recent.last_page_len[0] = 17;
  p.kv = cache.view(0, broken);
  both_fail_alike(p, "last_page_len[0] = 17");
  p = good;
  p.kv.k_int2.data = nullptr;
  both_fail_alike(p, "k_int2 pool: data must not be null");
  p = good;
  p.num_qo_heads = 3;
  both_fail_alike(p, "num_qo_heads 3");
  p = good;
  p.split_tokens = 0;
  both_fail_alike(p, "split_tokens");
  p = good;
  p.q = nullptr;
  both_fail_alike(p, "must not be null");
  p = good;
  const int32_t too_many[2] = {0, 51};
  p.qo_indptr = too_many;
  both_fail_alike(p, "51 query tokens");
  const int32_t bad_start[2] = {1, 2};
  p.qo_indptr = bad_start;
  both_fail_alike(p, "qo_indptr[0]");

  // Its own options.
  Status s = host::attention_blocked(good, {0, 1});
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("block_tokens") != std::string::npos);
  s = host::attention_blocked(good, {64, 0});
  CHECK(s.message().find("num_threads") != std::string::npos);
  CHECK(out == untouched);

  // Through the cache, the hook reports the same errors as the default path.
  host::AttentionOptions fast;
  fast.path = host::blocked_attention();
  CHECK(cache.extend(0, ids, std::vector<int32_t>{51}, q.data(), out.data(), nullptr, fast).message() ==
        cache.extend(0, ids, std::vector<int32_t>{51}, q.data(), out.data(), nullptr).message());
  CHECK(out == untouched);
}
