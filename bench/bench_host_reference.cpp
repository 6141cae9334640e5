// CPU cost of the reference path: the row quantizer and decode over a paged cache.
#include <benchmark/benchmark.h>

#include <vector>

#include "common/random.hpp"
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

void BM_ReferenceDecode(benchmark::State& state) {
  const int context = static_cast<int>(state.range(0));
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
  const std::vector<oscar::host::RequestId> ids{*id};
  if (!cache->append(ids, std::vector<int32_t>{context}, k.data(), v.data()).ok()) {
    state.SkipWithError("append failed");
    return;
  }
  std::vector<float> q(32 * 128, 0.01f), out(q.size());
  for (auto _ : state) {
    if (!cache->decode(0, ids, q.data(), out.data(), nullptr).ok()) state.SkipWithError("decode failed");
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["tokens/s"] = benchmark::Counter(double(state.iterations()) * context, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_ReferenceDecode)->Arg(4096)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
