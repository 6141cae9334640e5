// SmolLM2-135M (d = 64, 9 query / 3 KV heads: the decode issue's small headline shape) with its
// KV cache on the GPU (oscar-decode's @gpu caches: device pools written by append_kv /
// demote_kv and read by paged_attention), against the same method's CPU cache, token by
// token. The steps cover every kernel path a real model meets: a prefill chunk of 80 tokens
// (most rows straight to INT2; the row-tiled extend), extends of 8 tokens over the quantized
// prefix (the column kernel), then single-token decodes with window demotions.
//
// A `gpu` test: exit 77 (skipped) without a CUDA device or without the model file.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "cache_methods.hpp"
#include "common/cuda_device.hpp"
#include "model/smollm2_model.hpp"
#include "oscar/io/plan_file.hpp"

using namespace oscar::decode;
using namespace oscar::decode::testing;

namespace {

// 80-token prefill, extends of 8 up to 240 tokens, then decodes: 320 tokens in all.
const std::vector<size_t> kSchedule = {80, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 1};
constexpr size_t kTokens = 320;

struct Compared {
  LogitGap gap;
  size_t tokens = 0;
};

// The same method, the same steps, on the CPU and on the GPU.
Compared cpu_against_gpu(CacheMethod method, CacheOptions options, const oscar::io::Plan* plan) {
  std::vector<int32_t> ids = model().tokenizer.encode(read_text(), false);
  REQUIRE(ids.size() >= kTokens);
  ids.resize(kTokens);
  options.capacity = static_cast<int64_t>(ids.size());
  const LlamaConfig& c = model().weights.config;
  auto cpu = make_cache(CacheSpec(method, false), c, options, plan);
  auto gpu = make_cache(CacheSpec(method, true), c, options, plan);
  REQUIRE_MESSAGE(cpu.ok(), cpu.status().to_string());
  REQUIRE_MESSAGE(gpu.ok(), gpu.status().to_string());
  const auto a = run(**cpu, ids, kSchedule);
  const auto b = run(**gpu, ids, kSchedule);
  return {logit_gap(a, b), ids.size()};
}

// What the GPU cache may differ by: the kernels round each attention output to bf16 (2^-9 of
// it; the CPU cache keeps float32) and sum in another order; the stored K/V bytes are the CPU
// cache's (the appends of these steps are below the tensor-core rotation's 4096 rows). The
// outputs' 2^-9 moves the final logits (|z| up to ~30) by a few 1e-2 at most, so KL <=
// delta_max^2 / 2 ~ 1e-3, as for the bf16 cache against the exact one (test_smollm2). A wrong
// page, slot, scale or segment instead gives KL of 0.1 to 1 and other argmaxes.
void check_close(const Compared& r, const char* what) {
  MESSAGE(what << ": mean KL(cpu || gpu) " << r.gap.mean_kl << ", max " << r.gap.max_kl << ", max |logit diff| "
               << r.gap.worst_logit << ", top-1 agreement " << r.gap.same_top1 << "/" << r.tokens);
  CHECK(r.gap.mean_kl <= 1e-3);
  CHECK(r.gap.max_kl <= 1e-2);
  CHECK(r.gap.worst_logit <= 0.5);
  CHECK(r.gap.same_top1 >= static_cast<int>(r.tokens) * 95 / 100);
}

}  // namespace

TEST_CASE("SmolLM2 on the GPU: oscar-fit (the shipped plan) follows the CPU cache") {
  auto plan = oscar::io::load_plan(OSCAR_DECODE_DEFAULT_PLAN);
  REQUIRE_MESSAGE(plan.ok(), plan.status().to_string());
  CacheOptions options;
  options.sink_tokens = 16;
  options.recent_tokens = 64;
  options.page_size = 16;
  check_close(cpu_against_gpu(CacheMethod::kOscarFit, options, &*plan), "oscar-fit, page 16");
}

TEST_CASE("SmolLM2 on the GPU: int2-hadamard in pages of 8 and bf16 follow the CPU cache") {
  CacheOptions options;
  options.sink_tokens = 8;
  options.recent_tokens = 32;
  options.page_size = 8;
  check_close(cpu_against_gpu(CacheMethod::kInt2Hadamard, options, nullptr), "int2-hadamard, page 8");
  options.page_size = 32;
  check_close(cpu_against_gpu(CacheMethod::kBf16, options, nullptr), "bf16, page 32");
}

TEST_CASE("SmolLM2 on the GPU: a full context is refused and the cache goes on") {
  const LlamaConfig& c = model().weights.config;
  CacheOptions options;
  options.capacity = 40;
  options.sink_tokens = 4;
  options.recent_tokens = 16;
  auto gpu = make_cache(CacheSpec(CacheMethod::kInt2Hadamard, true), c, options, nullptr);
  REQUIRE(gpu.ok());
  std::vector<int32_t> ids = model().tokenizer.encode(read_text(), false);
  ids.resize(41);
  auto first = forward(model().weights, **gpu, std::vector<int32_t>(ids.begin(), ids.begin() + 32));
  REQUIRE(first.ok());
  const auto full = forward(model().weights, **gpu, std::vector<int32_t>(ids.begin() + 32, ids.end()));
  CHECK(full.status().code() == oscar::StatusCode::kResourceExhausted);
  CHECK((*gpu)->length() == 32);
  auto next = forward(model().weights, **gpu, std::vector<int32_t>(ids.begin() + 32, ids.begin() + 40));
  CHECK_MESSAGE(next.ok(), next.status().to_string());
}

int main(int argc, char** argv) {
  if (!cuda_device_visible() || !smollm2_model_present()) return 77;
  doctest::Context context(argc, argv);
  return context.run();
}
