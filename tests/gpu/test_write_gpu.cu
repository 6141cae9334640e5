// GPU append / demote against the CPU reference cache, byte for byte: the same codes, the same
// fp16 metadata, the same bf16 window rows, in every layer, for fresh random inputs with
// outlier channels (and a NaN row). Bad arguments write nothing.
#include "common/gpu_test_main.hpp"

#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "common/device_pools.hpp"
#include "common/device_write_step.hpp"
#include "common/random.hpp"
#include "common/tensor_core_append.hpp"
#include "host/cache_test_util.hpp"
#include "oscar/kv/write.cuh"

using namespace oscar;
using namespace oscar::testing;
using host::CacheConfig;
using host::PagedCache;
using host::RequestId;

namespace {

CacheConfig write_config(int d, int group, int page, int sink, int recent, int layers) {
  CacheConfig c;
  c.num_layers = layers;
  c.num_kv_heads = 2;
  c.num_qo_heads = 2;
  c.head_dim = d;
  c.quant_group_size = group;
  c.page_size = page;
  c.sink_tokens = sink;
  c.recent_tokens = recent;
  c.num_int2_pages = 2048 / page + 16;
  c.num_bf16_pages = 2048 / page + 16;
  c.max_requests = 4;
  return c;
}

// One append step on both sides; returns the number of differing bytes.
size_t step_both(PagedCache& cache, DevicePools& device, const std::vector<RequestId>& ids,
                 const std::vector<int32_t>& counts, RowGenerator& keys, RowGenerator& values, bool poison_nan,
                 size_t* demotions = nullptr) {
  const CacheConfig& c = cache.config();
  auto plan = cache.plan_append(ids, counts);
  REQUIRE_MESSAGE(plan.ok(), plan.status().to_string());
  if (demotions) *demotions += plan->demotions.size();
  device.upload(cache);  // the pre-step state (what was written in earlier steps)
  const int tokens = static_cast<int>(plan->slots.size());
  KvRows kv = random_kv(keys, values, c, tokens);
  if (poison_nan && tokens > 3) kv.k[(size_t(3) * c.num_kv_heads + 1) * c.head_dim + 7] = float_to_bf16(std::nanf(""));

  device_write_step(device, c, *plan, kv.k, kv.v);

  const size_t layer_stride = size_t(tokens) * c.num_kv_heads * c.head_dim;
  for (int l = 0; l < c.num_layers; ++l) {
    REQUIRE(cache.write(l, *plan, kv.k.data() + l * layer_stride, kv.v.data() + l * layer_stride).ok());
  }
  REQUIRE(cache.finish(*plan).ok());
  return device.count_differences(cache);
}

}  // namespace

TEST_CASE("append and demote are bit-exact with the CPU reference") {
  struct Shape {
    int d, group, page, sink, recent;
  };
  const Shape shapes[] = {{64, 64, 8, 4, 16},    {64, 32, 16, 0, 0},     {128, 128, 16, 64, 256},
                          {128, 64, 32, 8, 40},   {128, 32, 256, 0, 256}, {256, 256, 16, 16, 32},
                          {256, 128, 64, 0, 64},  {256, 32, 8, 3, 5}};
  for (const Shape& s : shapes) {
    for (bool prerotated : {false, true}) {
      CAPTURE(s.d);
      CAPTURE(s.group);
      CAPTURE(s.page);
      CAPTURE(prerotated);
      CacheConfig config = write_config(s.d, s.group, s.page, s.sink, s.recent, 2);
      config.values_prerotated = prerotated;
      PagedCache cache = make_cache(config, true, s.d + s.page);
      DevicePools device(cache);
      RowGenerator keys(s.d, s.d), values(s.d + 1, s.d);
      std::vector<RequestId> ids;
      for (int i = 0; i < 3; ++i) ids.push_back(*cache.add_request());
      // A prefill-sized step (direct INT2 writes), then decode-sized steps (window appends
      // and demotions of pages written earlier), then a mixed chunk.
      const std::vector<std::vector<int32_t>> steps{{700, 33, 1}, {1, 1, 1}, {1, 1, 1}, {40, 1, 300}};
      for (size_t i = 0; i < steps.size(); ++i) {
        CHECK(step_both(cache, device, ids, steps[i], keys, values, i == 0) == 0);
      }
    }
  }
}

TEST_CASE("bulk append on tensor cores: rotation within one bf16 step, quantization bit-exact") {
  const TensorCoreAppendShape shapes[] = {
      {2, 3, 64, 64, 16, 700, false}, {2, 3, 64, 32, 8, 333, true}, {2, 8, 128, 128, 16, 1000, false},
      {2, 2, 128, 32, 32, 517, true}, {1, 4, 128, 64, 256, 90, false},
      // Token strides past heads * d (an engine's packed QKV rows; the padding is poisoned) and
      // head counts of 1 and 16 (the tile loads' head step is 0, or a warp holds one token).
      {2, 1, 128, 128, 16, 300, false, 24}, {1, 16, 64, 64, 8, 200, false, 64}, {1, 3, 128, 128, 16, 250, false, 8},
      // Decode-sized appends (kTensorCores insists on tensor cores below kAuto's 4096 rows):
      // one token of 8 heads (8 rows of one warpgroup's 64), and 64 tokens (8 warpgroups' rows
      // per plane).
      {2, 8, 128, 128, 16, 1, false}, {2, 8, 128, 128, 16, 64, false},
      // Enough rows that every warpgroup of a launch (one wave) loops over several units of 64
      // rows, the last one partial: its two row buffers alternate, each reused.
      {1, 8, 128, 128, 16, 8200, false}, {1, 4, 64, 32, 16, 9001, true}};
  // The authors' clip ratios (clip distances within the sorted top-8 / top-16 selections);
  // 0.85 / 0.80 (distances 20 and 26 at d = 128: the top-32 selection); 0.75 / 0.70 (32, the
  // top-32's last, and 39: the bitwise search, its counts exchanged within each pair of lanes
  // while the NaN row's pair has returned). Each under the hint an engine sets (nullopt: the
  // ranks' widest distance), and under hints that run the other compiled form: -1 (unknown:
  // the form with the top-32 selection) and 16 (the form without it: the search serves 20
  // and 26). The bytes must not depend on the hint.
  struct Clip {
    float rho_k, rho_v;
    std::optional<int32_t> hint;
  };
  for (const Clip& clip : {Clip{0.96f, 0.92f, std::nullopt}, Clip{0.96f, 0.92f, -1}, Clip{0.85f, 0.80f, std::nullopt},
                           Clip{0.85f, 0.80f, 16}, Clip{0.75f, 0.70f, std::nullopt}}) {
    const float rho_k = clip.rho_k, rho_v = clip.rho_v;
    for (const TensorCoreAppendShape& s : shapes) {
      CAPTURE(rho_k);
      CAPTURE(clip.hint.value_or(-2));
      CAPTURE(s.head_dim);
      CAPTURE(s.group);
      CAPTURE(s.heads);
      CAPTURE(s.tokens);
      CAPTURE(s.values_prerotated);
      CAPTURE(s.token_padding);
      TensorCoreAppendInputs in;
      const size_t rows = size_t(s.layers) * s.tokens * s.heads;
      in.k.resize(rows * s.head_dim);
      in.v.resize(in.k.size());
      RowGenerator(11 + s.head_dim, s.head_dim).fill_bf16(in.k.data(), rows);
      RowGenerator(12 + s.head_dim, s.head_dim).fill_bf16(in.v.data(), rows);
      in.k[size_t(5) * s.head_dim + 3] = float_to_bf16(std::nanf(""));  // a NaN row (layer 0)
      for (int l = 0; l < s.layers; ++l) {
        const std::vector<float> rk = random_orthogonal(s.head_dim, 100 + l), rv = random_orthogonal(s.head_dim, 200 + l);
        in.k_rotation.insert(in.k_rotation.end(), rk.begin(), rk.end());
        in.v_rotation.insert(in.v_rotation.end(), rv.begin(), rv.end());
        in.k_rank.push_back(clip_rank(rho_k, s.head_dim));
        in.v_rank.push_back(l == 0 ? clip_rank(rho_v, s.head_dim) : -1);
      }
      in.max_clip_distance = clip.hint;
      const TensorCoreAppendReport r = run_tensor_core_append(s, in);
      MESSAGE("d " << s.head_dim << " heads " << s.heads << ": of " << r.elements << " rotated elements, "
                   << r.one_step_off << " one bf16 step from the FMA path's, " << r.further_off << " further");
      CHECK(r.outside_bound == 0);
      // Apart from cancelling sums, an element differs from the FMA path's only within ~2^-18
      // relative of a bf16 rounding boundary (2^-9 apart): measured ~0.2% of elements on the H200;
      // 1% catches a wrong split or a lost term that the bound alone could miss on large sums.
      CHECK((r.one_step_off + r.further_off) * 100 <= r.elements);
      CHECK(r.int2_mismatches == 0);
      CHECK(r.mixed_mismatches == 0);
    }
  }
}

TEST_CASE("unrotated cache and a single layer") {
  CacheConfig config = write_config(128, 128, 16, 16, 32, 1);
  PagedCache cache = make_cache(config, false);
  DevicePools device(cache);
  RowGenerator keys(5, 128), values(6, 128);
  const std::vector<RequestId> ids{*cache.add_request()};
  CHECK(step_both(cache, device, ids, {500}, keys, values, false) == 0);
  CHECK(step_both(cache, device, ids, {17}, keys, values, false) == 0);
}

TEST_CASE("BF16 pools aligned to 2 bytes only: the element-wise fallbacks are bit-exact") {
  // demote_kv stages rows with 16-byte copies (demote_rows_kernel) only from 16-byte aligned
  // BF16 pools; here it must take the warp-per-row demote_kernel, at every head_dim it serves.
  for (int d : {64, 128}) {
    CAPTURE(d);
    CacheConfig config = write_config(d, d, 16, 16, 32, 2);
    PagedCache cache = make_cache(config, true, d + 3);
    DevicePools device(cache, 1);
    REQUIRE(reinterpret_cast<uintptr_t>(device.view().k_bf16.data) % 16 != 0);
    RowGenerator keys(d + 5, d), values(d + 6, d);
    std::vector<RequestId> ids;
    for (int i = 0; i < 2; ++i) ids.push_back(*cache.add_request());
    // Window appends, then steps whose window overflows a page: demotions.
    const std::vector<std::vector<int32_t>> steps{{40, 47}, {1, 1}, {30, 16}, {1, 1}, {17, 1}, {1, 20}};
    size_t demotions = 0;
    for (const auto& step : steps) CHECK(step_both(cache, device, ids, step, keys, values, false, &demotions) == 0);
    CHECK(demotions >= 3);
  }
}

TEST_CASE("demotion of NaN rows and at clip distances past 16 and 32 is bit-exact in either quantizer form") {
  // A NaN row in the window (no sink, so token 3 is there) is demoted beside finite rows of its
  // warp. Clip ratios 0.85 / 0.80 put the clip distances at 20 and 26 at d = 128 (10 and 13 at
  // d = 64), 0.75 / 0.70 at 32 and 39 (16 and 20): the top-32 selection and the bitwise
  // search. Each under the engine's hint (the ranks' widest distance: no override), an unknown one
  // (-1: the compiled form with the top-32 selection) and 16 (the form without it, whose
  // bitwise search then serves distances 17-32): the same bytes whichever form runs.
  struct Case {
    int d;
    float rho_k, rho_v;
    std::optional<int32_t> hint;
  };
  std::vector<Case> cases;
  for (int d : {64, 128}) {
    for (const auto& [rho_k, rho_v] : {std::pair{0.85f, 0.80f}, std::pair{0.75f, 0.70f}}) {
      for (const std::optional<int32_t> hint : {std::optional<int32_t>{}, std::optional<int32_t>{-1}, std::optional<int32_t>{16}}) {
        cases.push_back({d, rho_k, rho_v, hint});
      }
    }
  }
  for (const Case& c : cases) {
    const int d = c.d;
    const float rho_k = c.rho_k, rho_v = c.rho_v;
    CAPTURE(d);
    CAPTURE(rho_k);
    CAPTURE(c.hint.value_or(-2));
    CacheConfig config = write_config(d, d == 64 ? 32 : d, 16, 0, 32, 2);
    PagedCache cache = make_cache(config, true, d + 9, rho_k, rho_v);
    DevicePools device(cache);
    if (c.hint) device.set_max_clip_distance(*c.hint);
    RowGenerator keys(d + 7, d), values(d + 8, d);
    std::vector<RequestId> ids;
    for (int i = 0; i < 2; ++i) ids.push_back(*cache.add_request());
    const std::vector<std::vector<int32_t>> steps{{40, 47}, {30, 16}, {1, 1}, {17, 1}};
    size_t demotions = 0;
    for (size_t i = 0; i < steps.size(); ++i) {
      CHECK(step_both(cache, device, ids, steps[i], keys, values, i == 0, &demotions) == 0);
    }
    CHECK(demotions >= 3);
  }
}

TEST_CASE("one launch demotes 128 pages of 8 layers bit-exactly") {
  // The cases above demote a few pages per launch; an engine's step can demote many (every
  // request whose window overflows, in every layer at once). Here 8 layers (16 K/V planes)
  // demote 2048 tokens x 4 heads each in one demote_kv: 8192 rows per plane, 256 warps' batches
  // of 32 rows, blocks from many planes resident together.
  CacheConfig config = write_config(128, 128, 16, 0, 2048, 8);
  config.num_kv_heads = 4;
  config.num_qo_heads = 4;
  config.num_int2_pages = 160;
  config.num_bf16_pages = 272;
  PagedCache cache = make_cache(config, true, 41);
  DevicePools device(cache);
  RowGenerator keys(43, 128), values(44, 128);
  const std::vector<RequestId> ids{*cache.add_request()};
  size_t demotions = 0;
  CHECK(step_both(cache, device, ids, {2048}, keys, values, true, &demotions) == 0);  // with a NaN row
  CHECK(demotions == 0);
  CHECK(step_both(cache, device, ids, {2048}, keys, values, false, &demotions) == 0);
  CHECK(demotions == 128);  // the first step's 2048 tokens leave the window: 128 pages of 16
}

TEST_CASE("bad arguments are refused and a bad slot writes nothing") {
  CacheConfig config = write_config(128, 128, 16, 0, 16, 2);
  PagedCache cache = make_cache(config, true);
  DevicePools device(cache);
  device.upload(cache);
  const int tokens = 300;  // above the in-block check limit: the pre-pass kernel checks
  std::vector<TokenSlot> slots(tokens);
  for (int t = 0; t < tokens; ++t) slots[t] = {t / 16, t % 16, t % 2};
  std::vector<bf16_t> k(size_t(2) * tokens * 2 * 128, float_to_bf16(1.0f)), v = k;
  DeviceArray<bf16_t> d_k(k.size()), d_v(v.size());
  d_k.upload(k);
  d_v.upload(v);
  DeviceArray<int32_t> d_flag(1);

  AppendParams p;
  p.pools = device.view();
  p.k = d_k.ptr;
  p.v = d_v.ptr;
  p.in_stride_token = 2 * 128;
  p.in_stride_layer = p.in_stride_token * tokens;
  p.error_flag = d_flag.ptr;
  // A launch with one bad entry: accepted by the launcher, refused on the device (the flag),
  // and nothing written.
  const auto before = device.snapshot();
  const auto expect_refused_on_device = [&](auto launch) {
    d_flag.fill_bytes(0);
    REQUIRE(launch().ok());
    CUDA_REQUIRE(cudaDeviceSynchronize());
    CHECK(d_flag.download()[0] == kWriteErrorSlotOutOfRange);
    CHECK(device.snapshot() == before);
  };

  // Both rotations: under kAuto these 600 rows take the exact path, so the tensor-core
  // kernel's checks need their own run.
  for (const AppendRotation rotation : {AppendRotation::kAuto, AppendRotation::kTensorCores}) {
    CAPTURE(int(rotation));
    p.rotation = rotation;
    for (int count : {tokens, 5}) {  // pre-pass check and in-block check
      for (TokenSlot bad : {TokenSlot{100000, 0, 0}, TokenSlot{0, 16, 1}, TokenSlot{-1, 0, 1}, TokenSlot{0, 0, 2}}) {
        std::vector<TokenSlot> broken(slots.begin(), slots.begin() + count);
        broken[count / 2] = bad;
        DeviceArray<TokenSlot> d_slots(broken.size());
        d_slots.upload(broken);
        p.slots = d_slots.ptr;
        p.num_tokens = count;
        expect_refused_on_device([&] { return append_kv(p); });
      }
    }
  }

  p.rotation = AppendRotation::kAuto;
  AppendParams q = p;
  q.k = nullptr;
  CHECK(append_kv(q).message().find("must not be null") != std::string::npos);
  q = p;
  q.error_flag = nullptr;
  CHECK(append_kv(q).message().find("error_flag") != std::string::npos);
  q = p;
  q.pools.k_int2.layout.head_dim = 96;
  CHECK(append_kv(q).code() == StatusCode::kUnsupported);
  q = p;
  q.pools.k_int2.data += 4;
  CHECK(append_kv(q).message().find("16-byte aligned") != std::string::npos);
  q = p;
  q.pools.int2_stride_layer = 16;
  CHECK(append_kv(q).message().find("layers overlap") != std::string::npos);
  q = p;
  q.in_stride_token = 100;
  CHECK(append_kv(q).message().find("in_stride_token") != std::string::npos);
  q = p;
  q.rotation = AppendRotation::kTensorCores;
  q.k = d_k.ptr + 1;  // misaligned rows: the tensor-core path refuses, the exact one takes them
  CHECK(append_kv(q).message().find("16-byte aligned for the tensor-core rotation") != std::string::npos);
  q.rotation = AppendRotation::kAuto;
  q.k = d_k.ptr;
  q.pools.k_rotation += 1;
  CHECK(append_kv(q).message().find("k_rotation and v_rotation must be 16-byte aligned") != std::string::npos);
  q.pools.k_rotation -= 1;
  q.rotation = static_cast<AppendRotation>(7);
  CHECK(append_kv(q).message().find("rotation must be") != std::string::npos);
  q = p;
  q.pools.k_clip_rank = nullptr;
  CHECK(append_kv(q).message().find("clip_rank") != std::string::npos);

  DemoteParams dp;
  dp.pools = device.view();
  dp.error_flag = d_flag.ptr;
  // Each bad field, with the in-block check (2 demotions) and the pre-pass check (300):
  // nothing may be written, and no read may leave the pools (memcheck).
  for (int count : {2, 300}) {
    for (PageDemotion bad : {PageDemotion{1, 999999, 16}, PageDemotion{-1, 0, 16}, PageDemotion{999999, 0, 16},
                             PageDemotion{0, 0, 17}, PageDemotion{0, -1, 16}}) {
      CAPTURE(count);
      CAPTURE(bad.bf16_page);
      CAPTURE(bad.int2_page);
      CAPTURE(bad.rows);
      std::vector<PageDemotion> demotions(count, PageDemotion{0, 0, 16});
      demotions[count / 2] = bad;
      DeviceArray<PageDemotion> d_dem(demotions.size());
      d_dem.upload(demotions);
      dp.demotions = d_dem.ptr;
      dp.num_demotions = count;
      expect_refused_on_device([&] { return demote_kv(dp); });
    }
  }
  dp.demotions = nullptr;
  CHECK(demote_kv(dp).message().find("demotions must not be null") != std::string::npos);
}

TEST_CASE("append is CUDA-graph capturable and replays to the same bytes") {
  CacheConfig config = write_config(128, 128, 16, 4, 8, 2);
  PagedCache cache = make_cache(config, true);
  DevicePools device(cache);
  RowGenerator keys(7, 128), values(8, 128);
  const std::vector<RequestId> ids{*cache.add_request(), *cache.add_request()};
  CHECK(step_both(cache, device, ids, {100, 60}, keys, values, false) == 0);

  // Capture one decode step's append, replay it into a fresh upload of the pre-step state.
  auto plan = cache.plan_append(ids, std::vector<int32_t>{1, 1});
  REQUIRE(plan.ok());
  device.upload(cache);
  const KvRows kv = random_kv(keys, values, config, 2);
  DeviceArray<bf16_t> d_k(kv.k.size()), d_v(kv.v.size());
  d_k.upload(kv.k);
  d_v.upload(kv.v);
  DeviceArray<TokenSlot> d_slots(plan->slots.size());
  d_slots.upload(plan->slots);
  DeviceArray<int32_t> d_flag(1);
  d_flag.fill_bytes(0);
  AppendParams p;
  p.pools = device.view();
  p.k = d_k.ptr;
  p.v = d_v.ptr;
  p.in_stride_token = 2 * 128;
  p.in_stride_layer = p.in_stride_token * 2;
  p.num_tokens = 2;
  p.slots = d_slots.ptr;
  p.error_flag = d_flag.ptr;
  REQUIRE(plan->demotions.empty());  // a decode step that demotes nothing here

  cudaStream_t stream;
  CUDA_REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status s = append_kv(p, stream);
  CUDA_REQUIRE(cudaStreamEndCapture(stream, &graph));
  REQUIRE_MESSAGE(s.ok(), s.to_string());
  CUDA_REQUIRE(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_REQUIRE(cudaGraphLaunch(exec, stream));
  CUDA_REQUIRE(cudaStreamSynchronize(stream));
  for (int l = 0; l < 2; ++l) REQUIRE(cache.write(l, *plan, kv.k.data() + l * 2 * 256, kv.v.data() + l * 2 * 256).ok());
  REQUIRE(cache.finish(*plan).ok());
  CHECK(device.count_differences(cache) == 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The launchers opt their kernels in to more than 48 KB of shared memory (append_kernel's R at
// d = 128, the bulk tensor-core kernels' tiles). That attribute belongs to the device's
// context: cudaDeviceReset drops it, as a second device never had it, so a launcher that opted
// in once per process fails its next launch with "invalid argument". Every write kernel runs
// before and after a reset here (the last case of the file: nothing else is allocated then).
TEST_CASE("append and demote still launch after cudaDeviceReset") {
  const auto run_all_kernels = [] {
    {
      // 734 and 341 tokens of 2 heads at d = 128: append_kernel (R staged in 64 KB), with
      // window appends and demotions in between.
      CacheConfig config = write_config(128, 128, 16, 8, 40, 2);
      PagedCache cache = make_cache(config, true, 128 + 16);
      DevicePools device(cache);
      RowGenerator keys(21, 128), values(22, 128);
      const std::vector<RequestId> ids{*cache.add_request(), *cache.add_request(), *cache.add_request()};
      for (const std::vector<int32_t>& step : {std::vector<int32_t>{700, 33, 1}, {1, 1, 1}, {40, 1, 300}}) {
        CHECK(step_both(cache, device, ids, step, keys, values, false) == 0);
      }
    }
    // A bulk append on tensor cores (the rotating producer kernel on sm_90a).
    const TensorCoreAppendShape s{1, 8, 128, 128, 16, 600, false};
    TensorCoreAppendInputs in;
    const size_t rows = size_t(s.layers) * s.tokens * s.heads;
    in.k.resize(rows * s.head_dim);
    in.v.resize(in.k.size());
    RowGenerator(31, s.head_dim).fill_bf16(in.k.data(), rows);
    RowGenerator(32, s.head_dim).fill_bf16(in.v.data(), rows);
    in.k_rotation = random_orthogonal(s.head_dim, 300);
    in.v_rotation = random_orthogonal(s.head_dim, 301);
    in.k_rank.push_back(clip_rank(0.96f, s.head_dim));
    in.v_rank.push_back(clip_rank(0.92f, s.head_dim));
    const TensorCoreAppendReport r = run_tensor_core_append(s, in);
    CHECK(r.outside_bound == 0);
    CHECK(r.int2_mismatches == 0);
    CHECK(r.mixed_mismatches == 0);
  };
  run_all_kernels();
  CUDA_REQUIRE(cudaDeviceReset());
  run_all_kernels();
}
