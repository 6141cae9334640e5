// The GPU write and attention kernels on a real model's activations: post-RoPE q/k/v of
// SmolLM2-135M (layers 0, 5, 15, 29 of a KJV passage, `oscar-decode dump`) in a cache whose
// rotations and clip ratios come from a plan calibrated on a different KJV passage
// (`oscar-decode calibrate`). Real keys have the outlier channels and heavy-headed rows that
// random data only imitates. Checked:
//   - append + demote on the device are byte-for-byte the CPU reference's pages (prefill in
//     chunks, then token-by-token decode steps that demote window pages);
//   - decode and extend (the column and the row-tiled kernel) read those pages within the
//     tolerance of test_attention_gpu (the derivation is there: 2% of max|v| worst element,
//     0.3% mean, lse 2e-3 relative).
// The data is made by scripts/make-real-activations.sh; the test looks for it in
// $OSCAR_REAL_ACTIVATIONS_DIR (activations.safetensors, plan.safetensors) and exits 77
// (skipped, never passed) when it is not there.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "common/attention_errors.hpp"
#include "common/cuda_check.hpp"
#include "common/cuda_device.hpp"
#include "common/device_attention.hpp"
#include "common/device_pools.hpp"
#include "common/device_write_step.hpp"
#include "common/tensor_core_append.hpp"
#include "host/cache_test_util.hpp"
#include "gpu/real_activations_data.hpp"
#include "oscar/kv/write.cuh"

using namespace oscar;
using namespace oscar::testing;
using host::CacheConfig;
using host::PagedCache;
using host::RequestId;

namespace {

const int kLayers[] = {0, 5, 15, 29};
constexpr int kNumLayers = 4;

std::string data_dir() {
  const char* dir = std::getenv("OSCAR_REAL_ACTIVATIONS_DIR");
  return dir != nullptr ? dir : "";
}

struct Fixture {
  RealActivations acts;
  CacheConfig config;

  Fixture() {
    const std::string error = load_real_activations(data_dir(), {std::begin(kLayers), std::end(kLayers)}, acts);
    REQUIRE_MESSAGE(error.empty(), error);
    config.num_layers = kNumLayers;
    config.num_qo_heads = acts.num_qo_heads;
    config.num_kv_heads = acts.num_kv_heads;
    config.head_dim = acts.head_dim;
    config.quant_group_size = acts.head_dim;
    config.page_size = 16;
    config.sink_tokens = 16;
    config.recent_tokens = 64;
    config.num_int2_pages = 3 * int(acts.tokens / 16 + 4);
    config.num_bf16_pages = 3 * 16;
    config.max_requests = 4;
  }

  PagedCache make() const {
    auto cache = PagedCache::create(config, acts.quantizers);
    REQUIRE_MESSAGE(cache.ok(), cache.status().to_string());
    return std::move(*cache);
  }

  // bf16 K or V rows of `count` tokens from token `from`, layer-strided [layer][token][head][d].
  std::vector<bf16_t> rows(const std::vector<std::vector<float>>& x, int64_t from, int count) const {
    const size_t row = size_t(acts.num_kv_heads) * acts.head_dim;
    std::vector<bf16_t> out(size_t(kNumLayers) * count * row);
    for (int l = 0; l < kNumLayers; ++l)
      for (size_t i = 0; i < size_t(count) * row; ++i)
        out[size_t(l) * count * row + i] = float_to_bf16(x[size_t(l)][size_t(from) * row + i]);
    return out;
  }
};

// One append step of `counts[b]` tokens for each request (request b's tokens start at
// `next[b]` of the dump), on the device and on the CPU reference; returns differing bytes.
size_t step_both(const Fixture& f, PagedCache& cache, DevicePools& device, const std::vector<RequestId>& ids,
                 std::vector<int64_t>& next, const std::vector<int32_t>& counts) {
  auto plan = cache.plan_append(ids, counts);
  REQUIRE_MESSAGE(plan.ok(), plan.status().to_string());
  device.upload(cache);
  const int tokens = static_cast<int>(plan->slots.size());
  // The slots of a step are request by request in order, so the rows are concatenated too.
  const size_t row = size_t(f.acts.num_kv_heads) * f.acts.head_dim;
  std::vector<bf16_t> k(size_t(kNumLayers) * tokens * row), v(k.size());
  int at = 0;
  for (size_t b = 0; b < ids.size(); ++b) {
    const std::vector<bf16_t> kb = f.rows(f.acts.k, next[b], counts[b]), vb = f.rows(f.acts.v, next[b], counts[b]);
    for (int l = 0; l < kNumLayers; ++l) {
      std::memcpy(&k[(size_t(l) * tokens + at) * row], &kb[size_t(l) * counts[b] * row], counts[b] * row * sizeof(bf16_t));
      std::memcpy(&v[(size_t(l) * tokens + at) * row], &vb[size_t(l) * counts[b] * row], counts[b] * row * sizeof(bf16_t));
    }
    at += counts[b];
    next[b] += counts[b];
  }
  device_write_step(device, cache.config(), *plan, k, v);
  for (int l = 0; l < kNumLayers; ++l) {
    REQUIRE(cache.write(l, *plan, k.data() + size_t(l) * tokens * row, v.data() + size_t(l) * tokens * row).ok());
  }
  REQUIRE(cache.finish(*plan).ok());
  return device.count_differences(cache);
}

using Errors = AttentionErrors;

// The kernel (rotating q itself, un-rotating the output) against cache.decode / extend with the
// model's own queries: those of each request's newest `queries[b]` tokens (decode: 1).
Errors attend(const Fixture& f, const PagedCache& cache, int layer, const std::vector<RequestId>& ids,
              const std::vector<int64_t>& lengths, const std::vector<int32_t>& query_tokens,
              int32_t row_tiled_min_rows = kAttentionRowTiledMinRows, bool paired_column_tiles = true,
              bool split_mixed = false) {
  const CacheConfig& c = cache.config();
  const int d = c.head_dim;
  const bool decode = query_tokens.empty();
  std::vector<int32_t> qo_indptr{0};
  std::vector<bf16_t> q16;
  std::vector<float> q;
  for (size_t b = 0; b < ids.size(); ++b) {
    const int n = decode ? 1 : query_tokens[b];
    for (int64_t t = lengths[b] - n; t < lengths[b]; ++t) {
      for (int i = 0; i < c.num_qo_heads * d; ++i) {
        const bf16_t x = float_to_bf16(f.acts.q[size_t(layer)][size_t(t) * c.num_qo_heads * d + i]);
        q16.push_back(x);
        q.push_back(bf16_to_float(x));
      }
    }
    qo_indptr.push_back(qo_indptr.back() + n);
  }
  const int32_t rows = qo_indptr.back();
  std::vector<float> ref(q.size()), ref_lse(size_t(rows) * c.num_qo_heads);
  const Status rs = decode ? cache.decode(layer, ids, q.data(), ref.data(), ref_lse.data())
                           : cache.extend(layer, ids, query_tokens, q.data(), ref.data(), ref_lse.data());
  REQUIRE_MESSAGE(rs.ok(), rs.to_string());

  auto tables = cache.page_tables(ids);
  REQUIRE(tables.ok());
  DeviceLayer dev(cache, layer, *tables);
  AttentionShape shape{c.num_qo_heads, c.num_kv_heads, d, c.quant_group_size, c.page_size};
  AttentionPlanOptions options;
  options.min_chunk_bytes = 4096;  // split these ~1K-token requests into several chunks
  options.row_tiled_min_rows = row_tiled_min_rows;
  options.paired_column_tiles = paired_column_tiles;
  options.paired_max_chunks_per_tile = INT32_MAX;  // paired however many chunks the small min_chunk_bytes makes
  options.split_mixed_batches = split_mixed;
  options.mixed_split_min_bytes = 0;  // split_mixed: however few bytes the short requests read
  auto plan = make_attention_plan(shape, segment_lengths(*tables), query_tokens, options);
  REQUIRE_MESSAGE(plan.ok(), plan.status().to_string());
  DeviceArray<uint8_t> workspace(std::max<size_t>(plan->workspace_bytes(), 256));
  workspace.fill_bytes(0xA5);
  REQUIRE(upload_attention_plan(*plan, workspace.ptr, workspace.count).ok());
  DeviceArray<bf16_t> d_q(q16.size()), d_out(q16.size());
  DeviceArray<float> d_lse(ref_lse.size());
  DeviceArray<int32_t> d_qo(qo_indptr.size());
  d_q.upload(q16);
  d_qo.upload(qo_indptr);
  d_out.fill_bytes(0xFF);  // NaN
  d_lse.fill_bytes(0xFF);
  PagedAttentionParams p;
  p.kv = dev.kv();
  p.num_qo_heads = c.num_qo_heads;
  p.q = d_q.ptr;
  p.qo_indptr = decode ? nullptr : d_qo.ptr;
  p.q_rotation = dev.k_rotation();
  p.output_unrotation = dev.v_rotation();
  p.out = d_out.ptr;
  p.lse = d_lse.ptr;
  const Status s = paged_attention(*plan, p, workspace.ptr, workspace.count);
  REQUIRE_MESSAGE(s.ok(), s.to_string());
  CUDA_REQUIRE(cudaDeviceSynchronize());
  const std::vector<bf16_t> out = d_out.download();
  const std::vector<float> lse = d_lse.download();
  return attention_errors(cache, layer, ids, qo_indptr, out, lse, ref, ref_lse);
}

}  // namespace

TEST_CASE("real SmolLM2 activations: device pages are the reference's, attention matches") {
  Fixture f;
  REQUIRE(f.acts.tokens >= 600);
  PagedCache cache = f.make();
  DevicePools device(cache);
  std::vector<RequestId> ids;
  for (int i = 0; i < 2; ++i) ids.push_back(*cache.add_request());
  // Request 0 reads the text from its start, request 1 from token 200 (a different prefix).
  std::vector<int64_t> next = {0, 200};
  const int prefill0 = int(f.acts.tokens) - 40 - 8, prefill1 = 300;
  CHECK(step_both(f, cache, device, ids, next, {prefill0 - 200, prefill1}) == 0);  // bulk, mostly straight to INT2
  CHECK(step_both(f, cache, device, ids, next, {200, 33}) == 0);                    // a second chunk
  for (int step = 0; step < 40; ++step) {                                            // decode steps: demotions
    CHECK(step_both(f, cache, device, ids, next, {1, 1}) == 0);
  }
  const std::vector<int64_t> lengths = {next[0], next[1] - 200};
  CHECK(cache.length(ids[0]) == lengths[0]);
  for (int li = 0; li < kNumLayers; ++li) {
    CAPTURE(kLayers[li]);
    const Errors dec = attend(f, cache, li, ids, lengths, {});
    check_attention_errors(dec);
    // 24 rows: the column kernel, its two 8-column tiles paired in one pass (the default) and
    // each in its own.
    const Errors ext = attend(f, cache, li, ids, lengths, {8, 3});
    check_attention_errors(ext);
    const Errors ext_single = attend(f, cache, li, ids, lengths, {8, 3}, kAttentionRowTiledMinRows, false);
    check_attention_errors(ext_single);
    // The row-tiled extend kernel: the same short extend forced onto row tiles (one 16-row
    // group, warps splitting the tiles), and 40 tokens (120 rows, two 64-row tiles) by default.
    const Errors ext_rows = attend(f, cache, li, ids, lengths, {8, 3}, 8);
    check_attention_errors(ext_rows);
    const Errors ext_long = attend(f, cache, li, ids, lengths, {40, 3});
    check_attention_errors(ext_long);
    // The same batch split in two launches (a mixed batch: request 0's 120 rows on row tiles,
    // request 1's 9 on paired column tiles after them), however few bytes request 1 reads.
    const Errors ext_mixed = attend(f, cache, li, ids, lengths, {40, 3}, kAttentionRowTiledMinRows, true, true);
    check_attention_errors(ext_mixed);
    MESSAGE("layer " << kLayers[li] << ": decode worst " << dec.worst << " mean " << dec.mean << ", extend worst "
                     << ext.worst << " mean " << ext.mean << " (single tiles " << ext_single.worst
                     << "), row-tiled extend worst " << ext_rows.worst << " / " << ext_long.worst << " (split "
                     << ext_mixed.worst << ")");
  }
}

TEST_CASE("real SmolLM2 activations: the tensor-core bulk append") {
  Fixture f;
  TensorCoreAppendShape s;
  s.layers = kNumLayers;
  s.heads = f.acts.num_kv_heads;
  s.head_dim = f.acts.head_dim;
  s.group = f.acts.head_dim;
  s.page = 16;
  s.tokens = static_cast<int>(f.acts.tokens);
  TensorCoreAppendInputs in;
  in.k = f.rows(f.acts.k, 0, s.tokens);
  in.v = f.rows(f.acts.v, 0, s.tokens);
  for (const host::LayerQuantizer& q : f.acts.quantizers) {
    in.k_rotation.insert(in.k_rotation.end(), q.k_rotation.begin(), q.k_rotation.end());
    in.v_rotation.insert(in.v_rotation.end(), q.v_rotation.begin(), q.v_rotation.end());
    in.k_rank.push_back(clip_rank(q.k_clip_ratio, s.head_dim));
    in.v_rank.push_back(clip_rank(q.v_clip_ratio, s.head_dim));
  }
  const TensorCoreAppendReport r = run_tensor_core_append(s, in);
  MESSAGE("of " << r.elements << " rotated elements, " << r.one_step_off << " one bf16 step from the FMA path's, "
               << r.further_off << " further");
  CHECK(r.outside_bound == 0);
  CHECK((r.one_step_off + r.further_off) * 100 <= r.elements);  // argued in test_write_gpu.cu
  CHECK(r.int2_mismatches == 0);
  CHECK(r.mixed_mismatches == 0);
}

int main(int argc, char** argv) {
  if (!cuda_device_visible()) return 77;
  const std::string dir = data_dir();
  if (dir.empty() || !std::filesystem::exists(dir + "/activations.safetensors") ||
      !std::filesystem::exists(dir + "/plan.safetensors")) {
    std::printf("SKIPPED: no real activations (set OSCAR_REAL_ACTIVATIONS_DIR to the output of "
                "scripts/make-real-activations.sh)\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
