// GPU decode attention over the paged cache: our INT2 kernel, the same kernel on a BF16 cache
// (our BF16 baseline), and the copy bandwidth, in one run, cold L2. PyTorch SDPA on BF16 K/V
// of the same shapes is timed by bench/sdpa_baseline.py (run it in the same session).
//   build/bench/bench_attention_gpu --benchmark_min_time=0.2
// Sweep: {B=1: 32K, 128K; B=16: 32K; B=64: 8K} x {Hq=32 Hkv=8 d=128, Hq=9 Hkv=3 d=64}, page 16,
// INT2 with sink 64 / window 256 (the authors' sizes); page sizes 8..256 at B=16 32K.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_timer.cuh"
#include "oscar/attention/paged_attention.cuh"

namespace {

using namespace oscar;
using oscar::bench::check;

template <class T>
T* device_copy(const std::vector<T>& host) {
  T* p = nullptr;
  check(cudaMalloc(&p, std::max<size_t>(1, host.size()) * sizeof(T)), "cudaMalloc");
  if (!host.empty()) check(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return p;
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

struct HostTable {
  std::vector<int32_t> indptr{0}, indices, last;
};

// Paired column tiles for an extend: as the plan chooses, never, or whatever the chunk count.
enum { kPairedByPlan, kPairedNever, kPairedAlways };

// A batch of B requests of L tokens each, pages in shuffled order, random contents.
struct Problem {
  AttentionShape shape;
  AttentionPlan plan;
  PagedAttentionParams params;
  void* workspace = nullptr;
  double bytes = 0;  // K/V bytes the kernel must read, plus q and out
  int blocks_per_sm = 0;  // the plan's target
  std::vector<void*> allocations;

  Problem(int batch, int64_t length, int hq, int hkv, int d, int page, bool int2, int sink, int recent,
          int queries = 0, int paired = kPairedByPlan)
      : Problem(std::vector<int64_t>(batch, length), std::vector<int32_t>(queries > 0 ? batch : 0, queries), hq, hkv,
                d, page, int2, sink, recent, paired) {}

  // Request b holds length_of[b] cached tokens, its last queries_of[b] the queries (empty:
  // decode); split_mixed, mixed_split_min_bytes: AttentionPlanOptions' fields of those names.
  Problem(const std::vector<int64_t>& length_of, const std::vector<int32_t>& queries_of, int hq, int hkv, int d,
          int page, bool int2, int sink, int recent, int paired = kPairedByPlan,
          bool split_mixed = AttentionPlanOptions{}.split_mixed_batches,
          int64_t mixed_split_min_bytes = AttentionPlanOptions{}.mixed_split_min_bytes) {
    shape = {hq, hkv, d, d, page};
    std::mt19937_64 rng(7);
    const int batch = static_cast<int>(length_of.size());
    std::vector<SegmentCounts> lengths;
    for (int64_t length : length_of) {
      lengths.push_back(int2 ? segment_counts(length, sink, recent, page) : SegmentCounts{length, 0, 0});
    }
    HostTable t[3];
    int32_t pages[2] = {0, 0};  // BF16, INT2
    for (int b = 0; b < batch; ++b) {
      const int64_t n[3] = {lengths[b].sink, lengths[b].int2, lengths[b].recent};
      for (int s = 0; s < 3; ++s) {
        const int64_t np = (n[s] + page - 1) / page;
        for (int64_t i = 0; i < np; ++i) t[s].indices.push_back(pages[s == 1]++);
        t[s].indptr.push_back(static_cast<int32_t>(t[s].indices.size()));
        t[s].last.push_back(np == 0 ? 0 : static_cast<int32_t>(n[s] - (np - 1) * page));
      }
    }
    // A paged cache after churn: pages in shuffled order (within each table; sink and window
    // drew distinct ids from the shared BF16 pool, so they stay disjoint).
    // OSCAR_BENCH_PAGES_IN_ORDER=1 keeps each request's pages consecutive and ascending (an
    // allocator that never churned), to measure what the pages' order costs.
    if (env_int("OSCAR_BENCH_PAGES_IN_ORDER", 0) == 0) {
      for (auto& table : t) std::shuffle(table.indices.begin(), table.indices.end(), rng);
    }

    const Int2Layout layout{d, d, page};
    Int2PoolRef k_int2 = Int2PoolRef::packed(nullptr, std::max(1, pages[1]), hkv, layout);
    Bf16PoolRef k_bf16 = Bf16PoolRef::packed(nullptr, std::max(1, pages[0]), hkv, page, d);
    std::vector<uint8_t> int2_bytes(size_t(k_int2.num_pages) * k_int2.stride_page);
    // Cheap random contents (the timing does not depend on them; std::distributions on a
    // gigabyte of pool took most of the benchmark's run time).
    uint64_t state = 0x9E3779B97F4A7C15ull;
    auto next_word = [&state] {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      return state;
    };
    for (size_t i = 0; i + 8 <= int2_bytes.size(); i += 8) {
      const uint64_t w = next_word();
      std::memcpy(&int2_bytes[i], &w, 8);
    }
    // Valid metadata: scale ~ 0.05, offset ~ -0.1, written over the random bytes.
    for (int32_t p = 0; p < k_int2.num_pages; ++p)
      for (int h = 0; h < hkv; ++h)
        for (int s = 0; s < page; ++s) {
          QuantMeta* m = layout.meta(int2_bytes.data() + p * k_int2.stride_page + h * k_int2.stride_head, s);
          m->scale = float_to_fp16(0.05f);
          m->offset = float_to_fp16(-0.1f);
        }
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<bf16_t> bf16(size_t(k_bf16.num_pages) * k_bf16.stride_page);
    for (auto& x : bf16) x = float_to_bf16(0.3f * (float(next_word() >> 40) * 0x1p-24f * 2.0f - 1.0f));
    auto keep = [&](void* p) {
      allocations.push_back(p);
      return p;
    };
    params.kv.k_int2 = k_int2;
    params.kv.v_int2 = k_int2;
    if (env_int("OSCAR_BENCH_KV_INTERLEAVED", 0) != 0) {
      // One INT2 buffer, each (page, head)'s V block right after its K block (an engine's
      // interleaved allocation: no faster in the kernel, docs/benchmarks.md).
      const int64_t block = layout.block_bytes();
      std::vector<uint8_t> both(int2_bytes.size() * 2);
      for (size_t b = 0; b * block < int2_bytes.size(); ++b) {
        std::memcpy(&both[2 * b * block], &int2_bytes[b * block], block);
        std::memcpy(&both[(2 * b + 1) * block], &int2_bytes[b * block], block);
      }
      uint8_t* base = static_cast<uint8_t*>(keep(device_copy(both)));
      for (Int2PoolRef* pool : {&params.kv.k_int2, &params.kv.v_int2}) {
        pool->stride_head = 2 * block;
        pool->stride_page = int64_t{hkv} * 2 * block;
      }
      params.kv.k_int2.data = base;
      params.kv.v_int2.data = base + block;
    } else {
      params.kv.k_int2.data = static_cast<uint8_t*>(keep(device_copy(int2_bytes)));
      params.kv.v_int2.data = static_cast<uint8_t*>(keep(device_copy(int2_bytes)));
    }
    params.kv.k_bf16 = k_bf16;
    params.kv.v_bf16 = k_bf16;
    params.kv.k_bf16.data = static_cast<bf16_t*>(keep(device_copy(bf16)));
    params.kv.v_bf16.data = static_cast<bf16_t*>(keep(device_copy(bf16)));
    PageTableRef* refs[3] = {&params.kv.sink, &params.kv.int2, &params.kv.recent};
    for (int s = 0; s < 3; ++s) {
      *refs[s] = {static_cast<int32_t*>(keep(device_copy(t[s].indptr))),
                  static_cast<int32_t*>(keep(device_copy(t[s].indices))),
                  static_cast<int32_t*>(keep(device_copy(t[s].last))), batch, page};
    }
    // Decode (no queries_of): one query token per request; extend: the last queries_of[b] tokens.
    const bool decode = queries_of.empty();
    const int64_t query_rows = decode ? batch : std::accumulate(queries_of.begin(), queries_of.end(), int64_t{0});
    std::vector<bf16_t> q(size_t(query_rows) * hq * d);
    for (auto& x : q) x = float_to_bf16(normal(rng));
    params.num_qo_heads = hq;
    params.q = static_cast<bf16_t*>(keep(device_copy(q)));
    params.out = static_cast<bf16_t*>(keep(device_copy(q)));
    std::vector<float> r(size_t(d) * d, 0.0f);
    for (int i = 0; i < d; ++i) r[size_t(i) * d + i] = 1.0f;  // rotation cost is the same for any R
    params.q_rotation = static_cast<float*>(keep(device_copy(r)));
    params.output_unrotation = static_cast<float*>(keep(device_copy(r)));
    // OSCAR_BENCH_ENGINE_ROTATED=1: the engine rotated q and folds R_V^T into W_O; 2: the
    // engine rotated q only; 3: the engine folds R_V^T only (to time each rotation's share).
    const int engine_rotated = env_int("OSCAR_BENCH_ENGINE_ROTATED", 0);
    if (engine_rotated == 1 || engine_rotated == 2) params.q_rotation = nullptr;
    if (engine_rotated == 1 || engine_rotated == 3) params.output_unrotation = nullptr;

    const std::vector<int32_t>& query_tokens = queries_of;
    if (!decode) {  // extend: request b's query rows follow request b - 1's
      std::vector<int32_t> qo_indptr{0};
      for (int32_t n : queries_of) qo_indptr.push_back(qo_indptr.back() + n);
      params.qo_indptr = static_cast<int32_t*>(keep(device_copy(qo_indptr)));
    }
    // The device's SM count and resident blocks; OSCAR_BENCH_BLOCKS_PER_SM overrides the
    // split target, to tune it.
    auto device_options = attention_plan_options_for_device(d);
    if (!device_options.ok()) {
      std::fprintf(stderr, "plan options: %s\n", device_options.status().to_string().c_str());
      std::exit(1);
    }
    AttentionPlanOptions options = *device_options;
    if (const int bps = env_int("OSCAR_BENCH_BLOCKS_PER_SM", 0); bps > 0) {
      options.target_blocks_per_sm = bps;
      options.target_extend_blocks_per_sm = bps;
      options.target_paired_blocks_per_sm = bps;
    }
    // OSCAR_BENCH_MIN_CHUNK_KB overrides the shortest chunk (to tune it).
    if (const int kb = env_int("OSCAR_BENCH_MIN_CHUNK_KB", 0); kb > 0) options.min_chunk_bytes = int64_t{kb} * 1024;
    // OSCAR_BENCH_ROW_TILED=0 runs extend plans on the decode kernel's column tiles, =2 on the
    // row-tiled kernel whatever their rows (to find the crossover).
    if (const int rt = env_int("OSCAR_BENCH_ROW_TILED", 1); rt == 0) {
      options.row_tiled_min_rows = INT32_MAX;
    } else if (rt == 2) {
      options.row_tiled_min_rows = 0;
    }
    options.paired_column_tiles = paired != kPairedNever;
    if (paired == kPairedAlways) options.paired_max_chunks_per_tile = INT32_MAX;
    options.split_mixed_batches = split_mixed;
    options.mixed_split_min_bytes = mixed_split_min_bytes;
    auto made = make_attention_plan(shape, lengths, query_tokens, options);
    if (!made.ok()) {
      std::fprintf(stderr, "plan: %s\n", made.status().to_string().c_str());
      std::exit(1);
    }
    plan = std::move(made).value();
    blocks_per_sm = plan_target_blocks_per_sm(plan, options);
    check(cudaMalloc(&workspace, plan.workspace_bytes()), "workspace");
    allocations.push_back(workspace);
    const Status up = upload_attention_plan(plan, workspace, plan.workspace_bytes());
    if (!up.ok()) std::exit(1);
    check(cudaDeviceSynchronize(), "upload");
    for (const auto& l : lengths) {
      bytes += double(hkv) * (attention_tile_bytes(shape, true) / 16.0 * l.int2 +
                              attention_tile_bytes(shape, false) / 16.0 * (l.sink + l.recent));
    }
    bytes += 2.0 * q.size() * sizeof(bf16_t);
  }
  ~Problem() {
    for (void* p : allocations) cudaFree(p);
  }
  void run() {
    const Status s = paged_attention(plan, params, workspace, plan.workspace_bytes());
    if (!s.ok()) {
      std::fprintf(stderr, "paged_attention: %s\n", s.to_string().c_str());
      std::exit(1);
    }
  }
};

void BM_CopyBandwidth(benchmark::State& state) {
  const size_t bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  check(cudaMalloc(&a, bytes), "malloc");
  check(cudaMalloc(&b, bytes), "malloc");
  oscar::bench::time_kernel(state, 2.0 * bytes, [&] { check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice), "copy"); });
  oscar::bench::copy_gbps() = state.counters["GB/s"];
  cudaFree(a);
  cudaFree(b);
}

#ifdef OSCAR_ATTENTION_TIMELINE
// The decode kernel's phases in the last timed run (attention_timeline.cuh), on stderr: the
// stamps of the block that finished last, relative to the first block's start, then each
// phase's average over the blocks that stamped it. A stamp older than the run's first start
// is an earlier run's (a block's role, last to arrive or not, changes between runs).
void print_timeline(const char* what, int blocks) {
  using namespace oscar::attention_detail;
  static unsigned long long h[kTimelineBlocks][kTimelineMarks];
  check(cudaMemcpyFromSymbol(h, g_attention_timeline, sizeof(h)), "timeline copy");
  blocks = std::min(blocks, kTimelineBlocks);
  unsigned long long t0 = ~0ull, t_end = 0;
  int last = 0;
  for (int b = 0; b < blocks; ++b) t0 = std::min(t0, h[b][kMarkStart]);
  auto stamped = [&](int b, int m) { return h[b][m] >= t0; };
  for (int b = 0; b < blocks; ++b) {
    for (int m : {int(kMarkPublished), int(kMarkEnd)}) {
      if (stamped(b, m) && h[b][m] > t_end) t_end = h[b][m], last = b;
    }
  }
  static const char* const names[kTimelineMarks] = {"start",  "issued",    "q",         "rotated",       "fragments", "loop",
                                                    "tiles", "warps",     "published", "chunks merged", "end"};
  std::fprintf(stderr, "timeline %s: %d blocks, span %.2f us; last block:", what, blocks, (t_end - t0) / 1e3);
  for (int m = 0; m < kTimelineMarks; ++m) {
    if (stamped(last, m)) std::fprintf(stderr, " %s %.2f", names[m], (h[last][m] - t0) / 1e3);
  }
  std::fprintf(stderr, "; phase averages (us):");
  for (int m = 1; m < kTimelineMarks; ++m) {
    double sum = 0;
    int count = 0;
    for (int b = 0; b < blocks; ++b) {
      if (!stamped(b, m)) continue;
      int prev = m == kMarkChunksMerged ? int(kMarkWarpsMerged) : m - 1;  // the last block skips "published"
      while (prev > 0 && !stamped(b, prev)) --prev;
      sum += double(h[b][m] - h[b][prev]);
      ++count;
    }
    if (count > 0) std::fprintf(stderr, " %s %.2f", names[m], sum / count / 1e3);
  }
  std::fprintf(stderr, "\n");
}
#endif

// The counters every attention benchmark reports, after its timing.
void report(benchmark::State& state, const Problem& problem) {
  const double gbps = state.counters["GB/s"];
  if (oscar::bench::copy_gbps() > 0) state.counters["%copy"] = 100.0 * gbps / oscar::bench::copy_gbps();
  state.counters["items"] = double(problem.plan.total_items());
  if (problem.plan.column_part) {
    state.counters["column_part_items"] = double(problem.plan.column_part->items.size());
    state.counters["column_part_columns/tile"] = double(problem.plan.column_part->tile_columns);
  }
  state.counters["blocks/SM"] = double(problem.blocks_per_sm);
  state.counters["columns/tile"] = double(problem.plan.tile_columns);
}

void BM_Attention(benchmark::State& state, int batch, int64_t length, int hq, int hkv, int d, int page, bool int2,
                  int queries, int paired) {
  Problem problem(batch, length, hq, hkv, d, page, int2, 64, 256, queries, paired);
  oscar::bench::time_kernel(state, problem.bytes, [&] { problem.run(); });
  report(state, problem);
  if (problem.plan.row_tiled()) {
    // Whether the row-tiled path's extend and merge kernels start as programmatic dependents.
    bool pdl = false;
    if (d == 64) oscar::programmatic_launch_available(oscar::attention_detail::extend_merge_kernel<64>, pdl);
    if (d == 128) oscar::programmatic_launch_available(oscar::attention_detail::extend_merge_kernel<128>, pdl);
    state.counters["pdl"] = pdl ? 1.0 : 0.0;
  }
#ifdef OSCAR_ATTENTION_TIMELINE
  if (!problem.plan.row_tiled()) {
    const std::string what = "B" + std::to_string(batch) + " L" + std::to_string(length) + " d" + std::to_string(d) +
                             " Q" + std::to_string(queries) + (int2 ? " int2" : " bf16");
    print_timeline(what.c_str(), int(problem.plan.items.size()) * hkv);
  }
#endif
}

// A continuous-batching step with chunked prefill: one request appends a chunk of `chunk` tokens
// to a 32K prefix while `decodes` others decode one token each over `decode_length` tokens,
// hq/hkv/d heads, page 16. kMixedSplit: the decodes on the column kernel after the row-tiled
// kernel (AttentionPlan::column_part) however few bytes they read (the threshold at 0);
// kMixedWhole: the whole batch on the row-tiled kernel; kMixedDefault: as the default options
// plan it (counter `split`: which form that was).
enum MixedForm { kMixedSplit, kMixedWhole, kMixedDefault };
void BM_MixedBatch(benchmark::State& state, int hq, int hkv, int d, int decodes, int64_t decode_length, int chunk,
                   MixedForm form) {
  std::vector<int64_t> length_of(size_t(decodes) + 1, decode_length);
  std::vector<int32_t> queries_of(size_t(decodes) + 1, 1);
  length_of[0] = 32768 + chunk;
  queries_of[0] = chunk;
  Problem problem(length_of, queries_of, hq, hkv, d, 16, true, 64, 256, kPairedByPlan, form != kMixedWhole,
                  form == kMixedDefault ? AttentionPlanOptions{}.mixed_split_min_bytes : 0);
  state.counters["split"] = problem.plan.column_part ? 1 : 0;
  oscar::bench::time_kernel(state, problem.bytes, [&] { problem.run(); });
  report(state, problem);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::RegisterBenchmark("copy", BM_CopyBandwidth)->UseManualTime()->Unit(benchmark::kMicrosecond);
  struct Case {
    int batch;
    int64_t length;
  };
  const Case cases[] = {{1, 32768}, {1, 131072}, {16, 32768}, {64, 8192}};
  struct Heads {
    int hq, hkv, d;
  };
  const Heads heads[] = {{32, 8, 128}, {9, 3, 64}};
  for (const Heads& h : heads) {
    for (const Case& c : cases) {
      for (bool int2 : {true, false}) {
        const std::string name = std::string(int2 ? "int2" : "bf16") + "/hq" + std::to_string(h.hq) + "_hkv" +
                                 std::to_string(h.hkv) + "_d" + std::to_string(h.d) + "/B" + std::to_string(c.batch) +
                                 "/L" + std::to_string(c.length) + "/page16";
        benchmark::RegisterBenchmark(name.c_str(), BM_Attention, c.batch, c.length, h.hq, h.hkv, h.d, 16, int2, 0, kPairedByPlan)
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
  for (int page : {8, 64, 256}) {
    const std::string name = "int2/hq32_hkv8_d128/B16/L32768/page" + std::to_string(page);
    benchmark::RegisterBenchmark(name.c_str(), BM_Attention, 16, int64_t{32768}, 32, 8, 128, page, true, 0, kPairedByPlan)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
  // Extend (chunked prefill / speculative verification): Q new tokens over a 32K quantized
  // prefix. Target: within 1.5x of the time to read the prefix (%copy >= 67). Q = 4 is a
  // speculative verification step (16 rows at g = 4); Q >= 16 fills 64-row tiles.
  for (int queries : {4, 8, 16, 64, 256}) {
    const std::string name = "extend/hq32_hkv8_d128/B1/L32768/Q" + std::to_string(queries);
    benchmark::RegisterBenchmark(name.c_str(), BM_Attention, 1, int64_t{32768}, 32, 8, 128, 16, true, queries,
                                 kPairedByPlan)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
  // Speculative verification for a batch (each request 32K cached, its last Q tokens the
  // queries): at B = 16 the prefix takes the copy bandwidth to read, so these show what
  // verifying Q drafted tokens costs against a decode step of the same batch
  // (int2/hq32_hkv8_d128/B16/L32768/page16), where the B = 1 shapes are latency-bound.
  // "extend" runs the plan's choice of column tiles; "extend_single" and "extend_paired" force
  // single and paired 8-column tiles (the A/B that AttentionPlanOptions::paired_max_chunks_per_tile
  // stands on, in one run).
  struct Verification {
    int batch;
    int64_t length;
    int hq, hkv, d, queries;
  };
  for (const Verification& v : {Verification{1, 32768, 32, 8, 128, 4}, Verification{1, 32768, 32, 8, 128, 8},
                                Verification{1, 131072, 32, 8, 128, 4}, Verification{4, 32768, 32, 8, 128, 4},
                                Verification{16, 32768, 32, 8, 128, 2}, Verification{16, 32768, 32, 8, 128, 4},
                                Verification{16, 32768, 32, 8, 128, 8}, Verification{64, 8192, 32, 8, 128, 4},
                                Verification{16, 32768, 9, 3, 64, 4}, Verification{1, 131072, 9, 3, 64, 4}}) {
    const std::string shape = "/hq" + std::to_string(v.hq) + "_hkv" + std::to_string(v.hkv) + "_d" +
                              std::to_string(v.d) + "/B" + std::to_string(v.batch) + "/L" +
                              std::to_string(v.length) + "/Q" + std::to_string(v.queries);
    const bool one_tile = v.queries * (v.hq / v.hkv) <= kAttentionTileColumns;
    for (const int mode : {kPairedByPlan, kPairedNever, kPairedAlways}) {
      if (mode != kPairedByPlan && one_tile) continue;  // nothing to pair
      if (mode == kPairedByPlan && v.batch == 1 && v.length == 32768 && v.d == 128) continue;  // registered above
      const char* prefix = mode == kPairedByPlan ? "extend" : mode == kPairedNever ? "extend_single" : "extend_paired";
      benchmark::RegisterBenchmark((prefix + shape).c_str(), BM_Attention, v.batch, v.length, v.hq, v.hkv, v.d, 16,
                                   true, v.queries, mode)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  // Mixed batches (chunked prefill beside decodes): split in two launches as planned, and the
  // whole batch on the row-tiled kernel; the prefill chunk alone and the decodes alone (an
  // extend of one token each) in the same run, for the sum the split should approach.
  struct Mixed {
    int hq, hkv, d;
    int decodes;
    int64_t decode_length;
    int chunk;
  };
  // Past the first three of each head shape: few decode bytes, where the split's second launch
  // may cost more than the row-tiled kernel spends on them (the default rule,
  // AttentionPlanOptions::mixed_split_min_bytes < 0, decides by the row-tiled plan's chunks
  // and waves; at d = 128 one decode of 8K reads 5.8 MB over the 8 KV heads, 2 11.7, 3 17.5,
  // 4 23.4; at d = 64 with 3 KV heads ~1.2 MB).
  for (const Mixed& m : {Mixed{32, 8, 128, 31, 8192, 512}, Mixed{32, 8, 128, 63, 8192, 64},
                         Mixed{32, 8, 128, 15, 32768, 512}, Mixed{32, 8, 128, 1, 2048, 512},
                         Mixed{32, 8, 128, 1, 8192, 512}, Mixed{32, 8, 128, 2, 8192, 512},
                         Mixed{32, 8, 128, 3, 8192, 512}, Mixed{32, 8, 128, 4, 8192, 512},
                         Mixed{9, 3, 64, 63, 8192, 512}, Mixed{9, 3, 64, 1, 8192, 512}, Mixed{9, 3, 64, 8, 8192, 512},
                         Mixed{9, 3, 64, 16, 8192, 512}, Mixed{9, 3, 64, 24, 8192, 512}}) {
    const std::string shape = "/hq" + std::to_string(m.hq) + "_hkv" + std::to_string(m.hkv) + "_d" +
                              std::to_string(m.d) + "/chunk" + std::to_string(m.chunk) + "_L32768+B" +
                              std::to_string(m.decodes) + "_L" + std::to_string(m.decode_length);
    for (const MixedForm form : {kMixedSplit, kMixedWhole, kMixedDefault}) {
      const char* name = form == kMixedSplit ? "mixed" : form == kMixedWhole ? "mixed_whole" : "mixed_default";
      benchmark::RegisterBenchmark((name + shape).c_str(), BM_MixedBatch, m.hq, m.hkv, m.d, m.decodes, m.decode_length,
                                   m.chunk, form)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
    benchmark::RegisterBenchmark(("mixed_decodes_alone" + shape).c_str(), BM_Attention, m.decodes, m.decode_length,
                                 m.hq, m.hkv, m.d, 16, true, 1, kPairedByPlan)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("mixed_chunk_alone" + shape).c_str(), BM_Attention, 1, int64_t{32768} + m.chunk,
                                 m.hq, m.hkv, m.d, 16, true, m.chunk, kPairedByPlan)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
