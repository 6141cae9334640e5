// GPU paged attention (decode and extend) against the CPU reference, host::PagedCache::decode /
// extend, on the same cache bytes: every head dim, GQA groups 1..8, page sizes 8..256, segment
// mixes (sink and window zero or not, BF16-only requests, empty INT2 segments), ragged
// batches, split-KV with many chunks, forked requests sharing prefix pages, rotation in the
// kernel or by the engine, a NaN key that must stay in its own request, graph replay, and
// argument errors. Outputs are poisoned (NaN) before every run.
//
// Tolerance. The reference computes in float from float q; the kernel rounds q to fp16 for
// INT2 keys (relative 2^-11) and to bf16 hi+lo (~2^-16) for BF16 keys, rounds probabilities to
// fp16 (INT2 values, already scaled by the value scale) or bf16 (BF16 values, 2^-9), and
// rounds the output to bf16 (2^-9 relative). With scores of magnitude S, a relative q error e
// moves a score by about e·S, so p moves by e·S relatively: for these test inputs (outlier
// channels x12, S up to ~30) that is up to ~1.5% for a single key, but errors of independent
// keys average out in o. We bound the worst element by 2% of max|v| of the request (the
// scale of o) and the mean by 0.3%; a wrong fragment order, a missing offset term, a
// dropped segment or a bad merge gives errors of 10-100% of max|v| (see the "broken inputs
// are caught" case, which moves one token's metadata and checks the bound fails).
#include "common/gpu_test_main.hpp"

#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "common/attention_errors.hpp"
#include "common/device_attention.hpp"
#include "common/random.hpp"
#include "host/cache_test_util.hpp"

using namespace oscar;
using namespace oscar::testing;
using host::CacheConfig;
using host::PagedCache;
using host::RequestId;

namespace {

struct Shape {
  int d, hq, hkv, page, sink, recent;
};

CacheConfig config_for(const Shape& s, int max_tokens, int requests) {
  CacheConfig c;
  c.num_layers = 1;
  c.num_qo_heads = s.hq;
  c.num_kv_heads = s.hkv;
  c.head_dim = s.d;
  c.quant_group_size = s.d;
  c.page_size = s.page;
  c.sink_tokens = s.sink;
  c.recent_tokens = s.recent;
  c.num_int2_pages = requests * (max_tokens / s.page + 2) + 4;
  c.num_bf16_pages = requests * ((s.sink + s.recent) / s.page + 6) + 4;
  c.max_requests = requests + 2;
  return c;
}

std::vector<bf16_t> to_bf16(const std::vector<float>& x) {
  std::vector<bf16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = float_to_bf16(x[i]);
  return out;
}

using Errors = AttentionErrors;

// How run_and_compare runs the kernel (designated initializers at the call sites name what a
// case changes).
struct RunOptions {
  bool kernel_rotates = true;  // q rotated by R_K in the kernel; false: by the engine
  AttentionPlanOptions plan;
  int replays = 1;
  void (*corrupt)(const PagedKvRef&) = nullptr;  // damages the device pools before the run
  // Captures the launch on a stream into a CUDA graph and replays that (the row-tiled extend's
  // three kernels are chained by programmatic launches, which capture must keep).
  bool via_graph = false;
  bool interleave_int2 = false;  // one INT2 buffer, each (page, head)'s V block after its K block
};

// Runs the kernel for `ids` (query_tokens empty: decode) and compares with the reference.
Errors run_and_compare(const PagedCache& cache, const std::vector<RequestId>& ids,
                       const std::vector<int32_t>& query_tokens, RowGenerator& qgen, const RunOptions& run = {}) {
  const auto& [kernel_rotates, options, replays, corrupt, via_graph, interleave_int2] = run;
  const CacheConfig& c = cache.config();
  const int d = c.head_dim;
  auto tables = cache.page_tables(ids);
  REQUIRE(tables.ok());
  const bool decode = query_tokens.empty();
  int32_t rows = 0;
  std::vector<int32_t> qo_indptr{0};
  for (size_t b = 0; b < ids.size(); ++b) {
    rows += decode ? 1 : query_tokens[b];
    qo_indptr.push_back(rows);
  }
  // Queries as bf16 (what the kernel takes), the reference gets the same values in float.
  std::vector<float> q = random_queries(qgen, size_t(rows) * c.num_qo_heads);
  const std::vector<bf16_t> q16 = to_bf16(q);
  for (size_t i = 0; i < q.size(); ++i) q[i] = bf16_to_float(q16[i]);
  const bool rotated = !cache.layer_quantizer(0).k_rotation.empty();

  // The engine-rotated variant: the engine hands the kernel bf16(q·R_K); the reference gets
  // exactly those values with q_rotated set, so both see the same query.
  host::AttentionOptions ref_options;
  std::vector<bf16_t> q_in = q16;
  if (rotated && !kernel_rotates) {
    const auto& rk = cache.layer_quantizer(0).k_rotation;
    std::vector<float> q_engine(q.size());
    for (int32_t row = 0; row < rows * c.num_qo_heads; ++row) {
      rotate_row(q.data() + size_t(row) * d, rk.data(), d, q_engine.data() + size_t(row) * d);
    }
    q_in = to_bf16(q_engine);
    for (size_t i = 0; i < q.size(); ++i) q[i] = bf16_to_float(q_in[i]);
    ref_options.q_rotated = true;
  }
  std::vector<float> ref(q.size()), ref_lse(size_t(rows) * c.num_qo_heads);
  const Status rs = decode ? cache.decode(0, ids, q.data(), ref.data(), ref_lse.data(), ref_options)
                           : cache.extend(0, ids, query_tokens, q.data(), ref.data(), ref_lse.data(), ref_options);
  REQUIRE_MESSAGE(rs.ok(), rs.to_string());

  DeviceLayer dev(cache, 0, *tables);
  if (corrupt) corrupt(dev.kv());
  AttentionShape shape{c.num_qo_heads, c.num_kv_heads, d, c.quant_group_size, c.page_size};
  const auto lengths = segment_lengths(*tables);
  auto plan = make_attention_plan(shape, lengths, query_tokens, options);
  REQUIRE_MESSAGE(plan.ok(), plan.status().to_string());
  DeviceArray<uint8_t> workspace(std::max<size_t>(plan->workspace_bytes(), 256));
  workspace.fill_bytes(0xA5);  // garbage everywhere but what upload writes
  REQUIRE(upload_attention_plan(*plan, workspace.ptr, workspace.count).ok());

  DeviceArray<bf16_t> d_q(q_in.size()), d_out(q_in.size());
  DeviceArray<float> d_lse(ref_lse.size());
  DeviceArray<int32_t> d_qo(qo_indptr.size());
  d_q.upload(q_in);
  d_qo.upload(qo_indptr);

  PagedAttentionParams p;
  p.kv = dev.kv();
  // An engine's interleaved allocation: one INT2 buffer, each (page, head)'s V block right
  // after its K block; the kernels see only the pools' data pointers and strides.
  DeviceArray<uint8_t> interleaved;
  if (interleave_int2) {
    const int64_t block = p.kv.k_int2.layout.block_bytes();
    const size_t blocks = size_t(p.kv.k_int2.num_pages) * p.kv.k_int2.num_kv_heads;
    REQUIRE(p.kv.k_int2.stride_head == block);  // DeviceLayer's pools are packed
    REQUIRE(p.kv.k_int2.stride_page == block * p.kv.k_int2.num_kv_heads);
    interleaved = DeviceArray<uint8_t>(2 * blocks * size_t(block));
    CUDA_REQUIRE(cudaMemcpy2D(interleaved.ptr, 2 * block, p.kv.k_int2.data, block, block, blocks,
                              cudaMemcpyDeviceToDevice));
    CUDA_REQUIRE(cudaMemcpy2D(interleaved.ptr + block, 2 * block, p.kv.v_int2.data, block, block, blocks,
                              cudaMemcpyDeviceToDevice));
    for (Int2PoolRef* pool : {&p.kv.k_int2, &p.kv.v_int2}) {
      pool->stride_head = 2 * block;
      pool->stride_page = 2 * block * pool->num_kv_heads;
    }
    p.kv.k_int2.data = interleaved.ptr;
    p.kv.v_int2.data = interleaved.ptr + block;
  }
  p.num_qo_heads = c.num_qo_heads;
  p.q = d_q.ptr;
  p.qo_indptr = decode ? nullptr : d_qo.ptr;
  p.q_rotation = kernel_rotates ? dev.k_rotation() : nullptr;
  p.output_unrotation = dev.v_rotation();
  p.out = d_out.ptr;
  p.lse = d_lse.ptr;
  cudaStream_t stream = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (via_graph) {
    CUDA_REQUIRE(cudaStreamCreate(&stream));
    cudaGraph_t graph;
    CUDA_REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const Status s = paged_attention(*plan, p, workspace.ptr, workspace.count, stream);
    CUDA_REQUIRE(cudaStreamEndCapture(stream, &graph));
    REQUIRE_MESSAGE(s.ok(), s.to_string());
    CUDA_REQUIRE(cudaGraphInstantiate(&exec, graph, 0));
    cudaGraphDestroy(graph);
  }
  Errors e;
  for (int rep = 0; rep < replays; ++rep) {
    d_out.fill_bytes(0xFF);  // NaN
    d_lse.fill_bytes(0xFF);
    if (via_graph) {
      CUDA_REQUIRE(cudaGraphLaunch(exec, stream));
    } else {
      const Status s = paged_attention(*plan, p, workspace.ptr, workspace.count);
      REQUIRE_MESSAGE(s.ok(), s.to_string());
    }
    CUDA_REQUIRE(cudaDeviceSynchronize());
    const std::vector<bf16_t> out = d_out.download();
    const std::vector<float> lse = d_lse.download();
    // The worst of the replays: a race that shows in one replay only is not overwritten.
    const Errors r = attention_errors(cache, 0, ids, qo_indptr, out, lse, ref, ref_lse);
    e.worst = std::max(e.worst, r.worst);
    e.mean = std::max(e.mean, r.mean);
    e.worst_lse = std::max(e.worst_lse, r.worst_lse);
    e.finite = e.finite && r.finite;
  }
  if (via_graph) {
    cudaGraphExecDestroy(exec);
    cudaStreamDestroy(stream);
  }
  return e;
}

void check(const Errors& e) { check_attention_errors(e); }

// A batch of requests with the given lengths, appended in ragged chunks.
std::vector<RequestId> fill(PagedCache& cache, const std::vector<int>& lengths, uint64_t seed) {
  RowGenerator keys(seed, cache.config().head_dim), values(seed + 1, cache.config().head_dim);
  std::vector<RequestId> ids;
  for (int len : lengths) {
    auto id = cache.add_request();
    REQUIRE(id.ok());
    ids.push_back(*id);
    if (len > 0) append_in_chunks(cache, *id, len, {len > 100 ? 97 : 1, 5, 33}, keys, values);
  }
  return ids;
}

}  // namespace

TEST_CASE("decode matches the reference: head dims, GQA groups, page sizes, segment mixes") {
  const Shape shapes[] = {
      {128, 32, 8, 16, 16, 32},  // headline, g = 4
      {64, 9, 3, 8, 0, 0},       // SmolLM2, g = 3, everything old is INT2
      {64, 9, 3, 16, 4, 16},
      {256, 2, 2, 32, 32, 64},   // g = 1
      {128, 16, 2, 256, 0, 256},  // g = 8, large pages
      {128, 8, 4, 64, 64, 0},    // g = 2, sink only
  };
  for (const Shape& s : shapes) {
    for (bool rotate : {true, false}) {
      CAPTURE(s.d);
      CAPTURE(s.hq);
      CAPTURE(s.page);
      CAPTURE(s.sink);
      CAPTURE(s.recent);
      CAPTURE(rotate);
      const std::vector<int> lengths = {1, 3, 17, s.sink + s.recent + 1, 300, 1000, 2100};
      PagedCache cache = make_cache(config_for(s, 2200, int(lengths.size())), rotate, 7);
      const auto ids = fill(cache, lengths, 11);
      RowGenerator qgen(99, s.d);
      check(run_and_compare(cache, ids, {}, qgen));
      // Many short chunks: every request split, merged by the last block to arrive.
      AttentionPlanOptions many;
      many.min_chunk_bytes = 1;
      many.target_blocks_per_sm = 64;
      check(run_and_compare(cache, ids, {}, qgen, {.plan = many}));
      if (rotate) check(run_and_compare(cache, ids, {}, qgen, {.kernel_rotates = false}));
    }
  }
}

TEST_CASE("INT2 pools with each V block right after its K block (one buffer, interleaved)") {
  // The K and V pools of one buffer, strides twice a block (docs/gpu.md §1): every page size,
  // decode, split decode and a one-token extend read them as they read separate pools.
  const Shape shapes[] = {
      {128, 32, 8, 16, 16, 32},
      {64, 9, 3, 16, 4, 16},
      {256, 4, 2, 16, 0, 16},
      {128, 8, 2, 8, 8, 16},
      {128, 16, 2, 64, 0, 64},
  };
  for (const Shape& s : shapes) {
    CAPTURE(s.d);
    CAPTURE(s.page);
    const std::vector<int> lengths = {1, 3, 17, s.sink + s.recent + 1, 300, 1000, 2100};
    PagedCache cache = make_cache(config_for(s, 2200, int(lengths.size())), true, 7);
    const auto ids = fill(cache, lengths, 11);
    RowGenerator qgen(99, s.d);
    check(run_and_compare(cache, ids, {}, qgen, {.interleave_int2 = true}));
    AttentionPlanOptions many;
    many.min_chunk_bytes = 1;
    many.target_blocks_per_sm = 64;
    check(run_and_compare(cache, ids, {}, qgen, {.plan = many, .interleave_int2 = true}));
    const std::vector<int32_t> queries(lengths.size(), 1);  // a one-token extend: causal masks
    check(run_and_compare(cache, ids, queries, qgen, {.interleave_int2 = true}));
  }
}

TEST_CASE("a BF16-only cache (the BF16 baseline) and empty INT2 segments") {
  const Shape s{128, 32, 8, 16, 4096, 0};  // the sink covers every token: no INT2 page
  PagedCache cache = make_cache(config_for(s, 1200, 3), false, 3);
  const auto ids = fill(cache, {5, 700, 1100}, 5);
  auto tables = cache.page_tables(ids);
  for (const auto& l : segment_lengths(*tables)) CHECK(l.int2 == 0);
  RowGenerator qgen(4, 128);
  check(run_and_compare(cache, ids, {}, qgen));
}

TEST_CASE("forked requests read the shared prefix pages") {
  const Shape s{128, 32, 8, 16, 16, 32};
  PagedCache cache = make_cache(config_for(s, 1500, 4), true, 21);
  auto ids = fill(cache, {1000}, 8);
  RowGenerator keys(30, 128), values(31, 128);
  for (int f = 0; f < 2; ++f) {
    auto child = cache.fork_request(ids[0]);
    REQUIRE(child.ok());
    append_in_chunks(cache, *child, 40 + 130 * f, {7}, keys, values);
    ids.push_back(*child);
  }
  CHECK(cache.usage().int2_pages_shared > 0);
  RowGenerator qgen(32, 128);
  AttentionPlanOptions many;
  many.min_chunk_bytes = 1;
  many.target_blocks_per_sm = 32;
  check(run_and_compare(cache, ids, {}, qgen, {.plan = many}));
}

TEST_CASE("extend: causal queries over the quantized prefix, any chunking of the prompt") {
  // Plans with more than 64 rows (query tokens x group) in a request run the row-tiled extend
  // kernel at d <= 128 (64 rows per block; the 40-token request has 120-320 rows here, the
  // short ones' tiles split their keys over the warps); d = 256 and row_tiled_min_rows =
  // INT32_MAX run the decode kernel's 8-column tiles. A window shorter than the 40 new tokens puts queries' own keys in
  // INT2 pages, so the causal mask bites inside staged INT2 tiles too.
  for (const Shape& s : {Shape{128, 32, 8, 16, 16, 32}, Shape{64, 9, 3, 8, 4, 16}, Shape{128, 16, 2, 32, 0, 16},
                         Shape{256, 8, 2, 16, 16, 32}}) {
    CAPTURE(s.d);
    CAPTURE(s.hq);
    PagedCache cache = make_cache(config_for(s, 1400, 3), true, 41);
    RowGenerator keys(42, s.d), values(43, s.d), qgen(44, s.d);
    auto ids = fill(cache, {600, 17, 1200}, 45);
    // One extend step: request 0 gets 5 new tokens, 1 gets 1, 2 gets 40 (the step's tokens are
    // the query tokens, written before attention as an engine does).
    const std::vector<int32_t> n_new = {5, 1, 40};
    for (size_t b = 0; b < ids.size(); ++b) append_in_chunks(cache, ids[b], n_new[b], {n_new[b]}, keys, values);
    check(run_and_compare(cache, ids, n_new, qgen));
    check(run_and_compare(cache, ids, n_new, qgen, {.kernel_rotates = false}));  // q rotated by the engine
    // The whole batch on row tiles, whatever the default's split rule picks for this batch.
    AttentionPlanOptions whole;
    whole.split_mixed_batches = false;
    check(run_and_compare(cache, ids, n_new, qgen, {.plan = whole}));
    AttentionPlanOptions many;
    many.min_chunk_bytes = 1;
    many.target_blocks_per_sm = 64;
    check(run_and_compare(cache, ids, n_new, qgen, {.plan = many}));
    check(run_and_compare(cache, ids, n_new, qgen, {.plan = many, .replays = 2, .via_graph = true}));
    AttentionPlanOptions columns = many;  // the column kernel: paired 8-column tiles (d <= 128)
    columns.row_tiled_min_rows = INT32_MAX;
    columns.paired_max_chunks_per_tile = INT32_MAX;  // however many chunks
    check(run_and_compare(cache, ids, n_new, qgen, {.plan = columns}));
    AttentionPlanOptions single = columns;  // each 8-column tile its own pass
    single.paired_column_tiles = false;
    check(run_and_compare(cache, ids, n_new, qgen, {.plan = single}));
    // The mixed batch split in two parts (split however few bytes the short requests read):
    // request 2 on the row-tiled kernel, requests 0 and 1 on the column kernel after it
    // (15-40 rows: paired tiles where their chunk counts allow), each part with its own items,
    // counters and partial states.
    AttentionPlanOptions split;
    split.split_mixed_batches = true;
    split.mixed_split_min_bytes = 0;
    {
      auto tables = cache.page_tables(ids);
      REQUIRE(tables.ok());
      const AttentionShape shape{s.hq, s.hkv, s.d, s.d, s.page};
      auto plan = make_attention_plan(shape, segment_lengths(*tables), n_new, split);
      REQUIRE(plan.ok());
      CHECK((plan->column_part != nullptr) == (s.d <= kAttentionRowTiledMaxHeadDim));
    }
    check(run_and_compare(cache, ids, n_new, qgen, {.plan = split}));
    check(run_and_compare(cache, ids, n_new, qgen, {.kernel_rotates = false, .plan = split}));
    AttentionPlanOptions split_many = many;
    split_many.split_mixed_batches = true;
    split_many.mixed_split_min_bytes = 0;
    split_many.paired_max_chunks_per_tile = INT32_MAX;
    check(run_and_compare(cache, ids, n_new, qgen, {.plan = split_many, .replays = 2, .via_graph = true}));
  }
}

TEST_CASE("speculative verification: a few queries per request, two column tiles per pass") {
  // 2-4 new tokens per request, 6-40 rows per KV head: the default plan pairs two 8-column
  // tiles in one pass over the keys at d <= 128 (a request of 8 rows or fewer computes an empty
  // second tile); d = 256 keeps single tiles. Both against the reference, kernel- and
  // engine-rotated q, many chunks (paired whatever their count: the last block merges
  // 16-column partial states), and the same batch on single tiles.
  for (const Shape& s : {Shape{128, 32, 8, 16, 16, 32}, Shape{64, 9, 3, 8, 4, 16}, Shape{128, 16, 2, 32, 0, 16},
                         Shape{64, 8, 8, 16, 0, 0}, Shape{256, 8, 2, 16, 16, 32}}) {
    CAPTURE(s.d);
    CAPTURE(s.hq);
    CAPTURE(s.hkv);
    PagedCache cache = make_cache(config_for(s, 1400, 3), true, 61);
    RowGenerator keys(62, s.d), values(63, s.d), qgen(64, s.d);
    auto ids = fill(cache, {700, 9, 1100}, 65);
    const std::vector<int32_t> n_new = {4, 2, 3};
    for (size_t b = 0; b < ids.size(); ++b) append_in_chunks(cache, ids[b], n_new[b], {n_new[b]}, keys, values);
    const int g = s.hq / s.hkv;
    auto tables = cache.page_tables(ids);
    REQUIRE(tables.ok());
    const AttentionShape shape{s.hq, s.hkv, s.d, s.d, s.page};
    auto plan = make_attention_plan(shape, segment_lengths(*tables), n_new);  // these short requests: few chunks
    REQUIRE(plan.ok());
    CHECK(plan->tile_columns == (4 * g > kAttentionTileColumns && s.d <= kAttentionPairedTilesMaxHeadDim
                                     ? kAttentionPairedTileColumns
                                     : kAttentionTileColumns));
    check(run_and_compare(cache, ids, n_new, qgen));
    check(run_and_compare(cache, ids, n_new, qgen, {.kernel_rotates = false}));
    AttentionPlanOptions many;
    many.min_chunk_bytes = 1;
    many.target_paired_blocks_per_sm = 64;
    many.target_blocks_per_sm = 64;
    many.paired_max_chunks_per_tile = INT32_MAX;
    check(run_and_compare(cache, ids, n_new, qgen, {.plan = many}));
    check(run_and_compare(cache, ids, n_new, qgen, {.plan = many, .replays = 2, .via_graph = true}));
    AttentionPlanOptions single = many;
    single.paired_column_tiles = false;
    check(run_and_compare(cache, ids, n_new, qgen, {.plan = single}));
  }
}

TEST_CASE("a NaN key stays in its own request; graph replay reuses the counters") {
  const Shape s{128, 32, 8, 16, 0, 0};
  PagedCache cache = make_cache(config_for(s, 1200, 3), true, 51);
  RowGenerator keys(52, 128), values(53, 128);
  auto ids = fill(cache, {1000, 1000}, 54);
  // Request 1 gets a NaN key row (stored with NaN metadata) and then more tokens.
  {
    KvRows kv = random_kv(keys, values, cache.config(), 1);
    kv.k[5] = float_to_bf16(std::nanf(""));
    const int32_t one = 1;
    REQUIRE(cache.append(std::span<const RequestId>(&ids[1], 1), std::span<const int32_t>(&one, 1), kv.k.data(), kv.v.data()).ok());
    append_in_chunks(cache, ids[1], 64, {64}, keys, values);
  }
  const CacheConfig& c = cache.config();
  auto tables = cache.page_tables(ids);
  DeviceLayer dev(cache, 0, *tables);
  AttentionShape shape{c.num_qo_heads, c.num_kv_heads, 128, 128, 16};
  AttentionPlanOptions many;
  many.min_chunk_bytes = 1;
  many.target_blocks_per_sm = 32;
  auto plan = make_attention_plan(shape, segment_lengths(*tables), {}, many);
  REQUIRE(plan.ok());
  CHECK(plan->num_counters > 0);
  DeviceArray<uint8_t> ws(plan->workspace_bytes());
  REQUIRE(upload_attention_plan(*plan, ws.ptr, ws.count).ok());
  RowGenerator qgen(55, 128);
  std::vector<float> q = random_queries(qgen, 2 * c.num_qo_heads);
  const auto q16 = to_bf16(q);
  for (size_t i = 0; i < q.size(); ++i) q[i] = bf16_to_float(q16[i]);
  std::vector<float> ref(q.size());
  REQUIRE(cache.decode(0, ids, q.data(), ref.data(), nullptr).ok());
  DeviceArray<bf16_t> d_q(q.size()), d_out(q.size());
  d_q.upload(q16);
  PagedAttentionParams p;
  p.kv = dev.kv();
  p.num_qo_heads = c.num_qo_heads;
  p.q = d_q.ptr;
  p.q_rotation = dev.k_rotation();
  p.output_unrotation = dev.v_rotation();
  p.out = d_out.ptr;

  cudaStream_t stream;
  CUDA_REQUIRE(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  CUDA_REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  REQUIRE(paged_attention(*plan, p, ws.ptr, ws.count, stream).ok());
  CUDA_REQUIRE(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_REQUIRE(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    d_out.fill_bytes(0xFF);
    CUDA_REQUIRE(cudaGraphLaunch(exec, stream));
    CUDA_REQUIRE(cudaStreamSynchronize(stream));
    const auto out = d_out.download();
    const double scale = value_scale(read_cache(cache, 0, ids[0]));
    double worst = 0;
    bool nan_in_1 = false;
    for (int h = 0; h < c.num_qo_heads; ++h) {
      for (int i = 0; i < 128; ++i) {
        const size_t o0 = size_t(h) * 128 + i, o1 = (size_t(c.num_qo_heads) + h) * 128 + i;
        worst = std::max(worst, std::abs(bf16_to_float(out[o0]) - ref[o0]) / scale);
        nan_in_1 = nan_in_1 || std::isnan(bf16_to_float(out[o1]));
      }
    }
    CHECK(worst <= 0.02);   // request 0 is untouched by request 1's NaN, in every replay
    CHECK(nan_in_1 == std::isnan(ref[size_t(c.num_qo_heads) * 128]));  // the fault shows where the reference shows it
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST_CASE("broken inputs are caught by the comparison") {
  // The bound must be able to fail: the same run with the device's INT2 value codes cleared
  // (the reference keeps them) is far outside it.
  const Shape s{128, 32, 8, 16, 0, 0};
  PagedCache cache = make_cache(config_for(s, 400, 1), true, 61);
  const auto ids = fill(cache, {320}, 62);
  RowGenerator qgen(63, 128);
  check(run_and_compare(cache, ids, {}, qgen));
  const Errors broken = run_and_compare(cache, ids, {}, qgen, {.corrupt = [](const PagedKvRef& kv) {
    CUDA_REQUIRE(cudaMemset(kv.v_int2.data, 0, size_t(kv.v_int2.num_pages) * kv.v_int2.stride_page));
  }});
  CHECK(broken.worst > 0.1);
}

TEST_CASE("launcher errors name the problem and launch nothing") {
  const Shape s{128, 32, 8, 16, 16, 32};
  PagedCache cache = make_cache(config_for(s, 300, 1), true, 71);
  const auto ids = fill(cache, {200}, 72);
  auto tables = cache.page_tables(ids);
  DeviceLayer dev(cache, 0, *tables);
  const CacheConfig& c = cache.config();
  AttentionShape shape{c.num_qo_heads, c.num_kv_heads, 128, 128, 16};
  auto plan = make_attention_plan(shape, segment_lengths(*tables));
  REQUIRE(plan.ok());
  DeviceArray<uint8_t> ws(plan->workspace_bytes());
  DeviceArray<bf16_t> d_q(size_t(c.num_qo_heads) * 128), d_out(d_q.count);
  PagedAttentionParams p;
  p.kv = dev.kv();
  p.num_qo_heads = c.num_qo_heads;
  p.q = d_q.ptr;
  p.out = d_out.ptr;
  auto has = [](const Status& st, const char* text) { return !st.ok() && st.message().find(text) != std::string::npos; };
  CHECK(has(paged_attention(*plan, p, ws.ptr, ws.count - 1), "smaller than"));
  PagedAttentionParams bad = p;
  bad.q = nullptr;
  CHECK(has(paged_attention(*plan, bad, ws.ptr, ws.count), "q and out must not be null"));
  bad = p;
  bad.q = d_q.ptr + 1;  // 2 bytes off: the kernels read q 16 bytes at a time
  CHECK(has(paged_attention(*plan, bad, ws.ptr, ws.count), "q must be 16-byte aligned"));
  bad = p;
  bad.num_qo_heads = 16;
  CHECK(has(paged_attention(*plan, bad, ws.ptr, ws.count), "disagree with the plan"));
  bad = p;
  bad.qo_indptr = reinterpret_cast<const int32_t*>(ws.ptr);
  CHECK(has(paged_attention(*plan, bad, ws.ptr, ws.count), "decode plan takes no qo_indptr"));
  // A column part that is not this plan's batch and shape (a forged or stale plan).
  AttentionPlan forged = *plan;
  AttentionPlan part = *plan;
  part.shape.head_dim = 64;
  forged.column_part = std::make_shared<const AttentionPlan>(part);
  DeviceArray<uint8_t> forged_ws(forged.workspace_bytes());
  CHECK(has(paged_attention(forged, p, forged_ws.ptr, forged_ws.count), "column part disagrees"));
  part = *plan;
  part.tile_columns = kAttentionRowTile;  // refused before the first part's kernels are queued
  forged.column_part = std::make_shared<const AttentionPlan>(part);
  DeviceArray<uint8_t> forged_rows_ws(forged.workspace_bytes());
  CHECK(has(paged_attention(forged, p, forged_rows_ws.ptr, forged_rows_ws.count), "column part disagrees"));
  // Plan-time errors.
  AttentionShape wrong = shape;
  wrong.head_dim = 96;
  CHECK(make_attention_plan(wrong, segment_lengths(*tables)).status().code() == StatusCode::kUnsupported);
  wrong = shape;
  wrong.quant_group_size = 64;
  CHECK(has(make_attention_plan(wrong, segment_lengths(*tables)).status(), "quant_group_size 64"));
  wrong = shape;
  wrong.num_qo_heads = 80;
  wrong.num_kv_heads = 8;
  CHECK(has(make_attention_plan(wrong, segment_lengths(*tables)).status(), "at most 8"));
  CUDA_REQUIRE(cudaDeviceSynchronize());
}

TEST_CASE("plan options for the device: its SM count and the kernel's resident blocks") {
  int device = 0, sms = 0;
  CUDA_REQUIRE(cudaGetDevice(&device));
  CUDA_REQUIRE(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  for (int d : {64, 128, 256}) {
    auto options = attention_plan_options_for_device(d);
    REQUIRE_MESSAGE(options.ok(), options.status().to_string());
    CHECK(options->num_sms == sms);
    CHECK(options->target_blocks_per_sm >= 1);
    CHECK(options->target_blocks_per_sm <= 8);  // 8 warps per block, 64 warps per SM
    CHECK(options->target_extend_blocks_per_sm >= 1);
    CHECK(options->target_extend_blocks_per_sm <= 16);  // 4 warps per block
    CHECK(options->target_paired_blocks_per_sm >= 1);
    CHECK(options->target_paired_blocks_per_sm <= options->target_blocks_per_sm);  // more registers per block
    MESSAGE("head_dim " << d << ": " << options->target_blocks_per_sm << " resident blocks per SM, extend "
                        << options->target_extend_blocks_per_sm << ", paired tiles "
                        << options->target_paired_blocks_per_sm);
  }
  CHECK(attention_plan_options_for_device(96).status().code() == StatusCode::kUnsupported);
}
