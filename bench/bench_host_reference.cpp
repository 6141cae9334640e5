// CPU cost of the host paths: the row quantizer, and decode / extend over a paged cache through
// the scalar reference (the GPU oracle) and the blocked path (host/attention_blocked.hpp, the
// usable CPU path). Arg 1 of the attention benchmarks: 0 reference, 1 blocked.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "common/random.hpp"
#include "oscar/host/attention_blocked.hpp"
#include "oscar/host/paged_cache.hpp"
#include "oscar/quant/row.hpp"

namespace {

void BM_QuantizeRow(benchmark::State& state) {
  const int d = static_cast<int>(state.range(0));
  oscar::testing::RowGenerator gen(1, d);
  std::vector<std::vector<float>> rows;
  for (int i = 0; i < 256; ++i) rows.push_back(gen.row());
  std::vector<uint8_t> packed(d / 4);
  std::vector<oscar::QuantMeta> meta(1);
  const int k = oscar::clip_rank(0.96f, d);
  size_t i = 0;
  for (auto _ : state) {
    oscar::quantize_row(rows[i++ % rows.size()].data(), d, d, k, packed.data(), meta.data());
    benchmark::DoNotOptimize(packed.data());
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["rows/s"] = benchmark::Counter(double(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_QuantizeRow)->Arg(64)->Arg(128)->Arg(256);

// A one-layer cache of `context` tokens (Hq = 32, Hkv = 8, d = 128: the headline GPU shape),
// random rows, default geometry (BF16 sink and window, INT2 pages between).
struct HostCache {
  std::unique_ptr<oscar::host::PagedCache> cache;
  std::vector<oscar::host::RequestId> ids;
};

HostCache make_cache(int context) {
  oscar::host::CacheConfig config;
  config.num_qo_heads = 32;
  config.num_kv_heads = 8;
  config.head_dim = 128;
  config.num_int2_pages = context / 16 + 1;
  config.num_bf16_pages = 32;
  auto cache = oscar::host::PagedCache::create(config, std::vector<oscar::host::LayerQuantizer>(1));
  auto id = cache->add_request();
  oscar::testing::RowGenerator gen(2, 128);
  std::vector<oscar::bf16_t> k(size_t(context) * 8 * 128), v(k.size());
  gen.fill_bf16(k.data(), size_t(context) * 8);
  gen.fill_bf16(v.data(), size_t(context) * 8);
  HostCache h{std::make_unique<oscar::host::PagedCache>(std::move(*cache)), {*id}};
  if (!h.cache->append(h.ids, std::vector<int32_t>{context}, k.data(), v.data()).ok()) h.cache.reset();
  return h;
}

oscar::host::AttentionOptions path_options(int64_t path) {
  oscar::host::AttentionOptions options;
  if (path == 1) options.path = oscar::host::blocked_attention();
  return options;
}

void BM_Decode(benchmark::State& state) {
  const int context = static_cast<int>(state.range(0));
  HostCache h = make_cache(context);
  if (!h.cache) return state.SkipWithError("append failed");
  const auto options = path_options(state.range(1));
  std::vector<float> q(32 * 128, 0.01f), out(q.size());
  for (auto _ : state) {
    if (!h.cache->decode(0, h.ids, q.data(), out.data(), nullptr, options).ok()) state.SkipWithError("decode failed");
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["tokens/s"] = benchmark::Counter(double(state.iterations()) * context, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Decode)->ArgsProduct({{4096}, {0, 1}})->ArgNames({"context", "blocked"})->Unit(benchmark::kMillisecond);

// The cache's last 16 tokens as the queries of one extend step (chunked prefill over a
// quantized prefix: what oscar-decode perplexity --chunk 16 does every step).
void BM_Extend16(benchmark::State& state) {
  const int context = static_cast<int>(state.range(0));
  HostCache h = make_cache(context);
  if (!h.cache) return state.SkipWithError("append failed");
  const auto options = path_options(state.range(1));
  constexpr int kQueries = 16;
  std::vector<float> q(size_t(kQueries) * 32 * 128), out(q.size());
  oscar::testing::RowGenerator gen(3, 128);
  for (int r = 0; r < kQueries * 32; ++r) {
    const auto row = gen.row();
    std::copy(row.begin(), row.end(), q.begin() + size_t(r) * 128);
  }
  const std::vector<int32_t> counts{kQueries};
  for (auto _ : state) {
    if (!h.cache->extend(0, h.ids, counts, q.data(), out.data(), nullptr, options).ok()) {
      state.SkipWithError("extend failed");
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["queries/s"] = benchmark::Counter(double(state.iterations()) * kQueries, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Extend16)->ArgsProduct({{4096}, {0, 1}})->ArgNames({"context", "blocked"})->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
