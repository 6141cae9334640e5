// oscar-gpu-step: what an engine does with the GPU kernels, end to end (docs/gpu.md).
// A books-only host::PagedCache (host_pools = false) manages the pages of pools that live on
// the GPU; each step demotes and appends on the device, then decode attention reads the
// cache. A full CPU cache runs the same steps as the check: the device pools must hold its
// bytes exactly (exact rotation path) and the attention must match it to bf16 output rounding.
// Prints the error and exits 0; 1 on a mismatch; 77 where no GPU is visible.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <random>
#include <vector>

#include "oscar/attention/paged_attention.cuh"
#include "oscar/host/device_cache_layout.hpp"
#include "oscar/host/paged_cache.hpp"
#include "oscar/kv/write.cuh"
#include "oscar/rotate/hadamard.hpp"

using namespace oscar;

namespace {

#define CHECK_CUDA(call)                                                                   \
  do {                                                                                     \
    const cudaError_t e = (call);                                                          \
    if (e != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e));     \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)
#define CHECK_OK(expr)                                                                     \
  do {                                                                                     \
    const Status s = (expr);                                                               \
    if (!s.ok()) {                                                                         \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s.to_string().c_str());     \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

template <class T>
T* to_device(const std::vector<T>& host, size_t min_count = 1) {
  T* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max(host.size(), min_count) * sizeof(T)));
  if (!host.empty()) CHECK_CUDA(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}
template <class T>
std::vector<T> to_host(const T* p, size_t count) {
  std::vector<T> host(count);
  CHECK_CUDA(cudaMemcpy(host.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device visible\n");
    return 77;
  }
  host::CacheConfig config;
  config.num_layers = 2;
  config.num_qo_heads = 8;
  config.num_kv_heads = 2;
  config.head_dim = 128;
  config.page_size = 16;
  config.sink_tokens = 16;
  config.recent_tokens = 64;
  config.num_int2_pages = 256;
  config.num_bf16_pages = 64;
  const int d = config.head_dim, heads = config.num_kv_heads, layers = config.num_layers;

  // Rotations: a normalized Hadamard for keys and values (a fitted plan gives R_K, R_V).
  std::vector<float> hadamard(size_t(d) * d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) hadamard[size_t(i) * d + j] = hadamard_entry(i, j, d);
  std::vector<host::LayerQuantizer> quantizers(layers, {hadamard, hadamard, 0.96f, 0.92f});
  auto reference = host::PagedCache::create(config, quantizers);  // the CPU check
  host::CacheConfig books_config = config;
  books_config.host_pools = false;
  auto books = host::PagedCache::create(books_config, quantizers);  // the engine's page manager
  CHECK_OK(reference.status());
  CHECK_OK(books.status());

  // Device pools, layer-strided, and the per-layer rotations and clip ranks: the library
  // sizes them and stacks the arrays (host/device_cache_layout.hpp); the engine allocates and
  // uploads them, and gets back the view the launchers take.
  auto arrays = host::device_cache_arrays(config, quantizers);
  CHECK_OK(arrays.status());
  uint8_t *k_int2, *v_int2;
  bf16_t *k_bf16, *v_bf16;
  CHECK_CUDA(cudaMalloc(&k_int2, arrays->int2_pool_bytes));
  CHECK_CUDA(cudaMalloc(&v_int2, arrays->int2_pool_bytes));
  CHECK_CUDA(cudaMalloc(&k_bf16, arrays->bf16_pool_bytes));
  CHECK_CUDA(cudaMalloc(&v_bf16, arrays->bf16_pool_bytes));
  auto layered = host::layered_kv_pools(config, *arrays,
                                        {k_int2, v_int2, k_bf16, v_bf16, to_device(arrays->k_rotations),
                                         to_device(arrays->v_rotations), to_device(arrays->k_clip_ranks),
                                         to_device(arrays->v_clip_ranks)});
  CHECK_OK(layered.status());
  const LayeredKvPools pools = *layered;
  const Int2Layout layout = config.int2_layout();
  const size_t int2_layer = size_t(arrays->int2_stride_layer), bf16_layer = size_t(arrays->bf16_stride_layer);
  int32_t* error_flag = to_device(std::vector<int32_t>{0});

  std::vector<host::RequestId> ids{*books->add_request(), *books->add_request()};
  (void)reference->add_request(), (void)reference->add_request();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  auto random_bf16 = [&](size_t n) {
    std::vector<bf16_t> x(n);
    for (bf16_t& v : x) v = float_to_bf16(normal(rng));
    return x;
  };

  // One engine step: plan on the books, demote + append on the device, the same on the CPU.
  auto step = [&](const std::vector<int32_t>& counts) {
    auto plan = books->plan_append(ids, counts);
    CHECK_OK(plan.status());
    const size_t tokens = plan->slots.size();
    const std::vector<bf16_t> k = random_bf16(layers * tokens * heads * d), v = random_bf16(k.size());
    TokenSlot* d_slots = to_device(plan->slots);
    PageDemotion* d_demotions = to_device(plan->demotions);
    bf16_t *d_k = to_device(k), *d_v = to_device(v);
    DemoteParams demote;
    demote.pools = pools;
    demote.num_demotions = int32_t(plan->demotions.size());
    demote.demotions = d_demotions;
    demote.error_flag = error_flag;
    CHECK_OK(demote_kv(demote));
    AppendParams append;
    append.pools = pools;
    append.k = d_k;
    append.v = d_v;
    append.in_stride_token = int64_t(heads) * d;
    append.in_stride_layer = append.in_stride_token * int64_t(tokens);
    append.num_tokens = int32_t(tokens);
    append.slots = d_slots;
    append.rotation = AppendRotation::kExactFma;  // the CPU cache's bytes, to compare below
    append.error_flag = error_flag;
    CHECK_OK(append_kv(append));
    CHECK_OK(books->finish(*plan));
    CHECK_OK(reference->append(ids, counts, k.data(), v.data()));
    CHECK_CUDA(cudaDeviceSynchronize());
    for (void* p : {(void*)d_slots, (void*)d_demotions, (void*)d_k, (void*)d_v}) CHECK_CUDA(cudaFree(p));
  };
  step({300, 100});                             // prefill: most tokens straight to INT2
  for (int i = 0; i < 40; ++i) step({1, 1});    // decode steps: window appends and demotions
  if (to_host(error_flag, 1)[0] != 0) {
    std::fprintf(stderr, "a slot was out of range\n");
    return 1;
  }

  // The device pools hold the reference's bytes: every INT2 page and every stored BF16 row
  // the page tables reference.
  size_t differing = 0;
  auto books_tables = books->page_tables(ids);
  CHECK_OK(books_tables.status());
  for (int l = 0; l < layers; ++l) {
    using T = host::PagedCache::Tensor;
    const auto ki = to_host(k_int2 + l * int2_layer, int2_layer), vi = to_host(v_int2 + l * int2_layer, int2_layer);
    const uint8_t* rk = reference->int2_pool(l, T::kKeys).data;
    const uint8_t* rv = reference->int2_pool(l, T::kValues).data;
    for (int32_t page : books_tables->int2.indices) {
      for (size_t b = 0; b < size_t(heads) * layout.block_bytes(); ++b) {
        const size_t at = size_t(page) * heads * layout.block_bytes() + b;
        differing += (ki[at] != rk[at]) + (vi[at] != rv[at]);
      }
    }
    const auto kb = to_host(k_bf16 + l * bf16_layer, bf16_layer), vb = to_host(v_bf16 + l * bf16_layer, bf16_layer);
    const Bf16PoolRef rkb = reference->bf16_pool(l, T::kKeys), rvb = reference->bf16_pool(l, T::kValues);
    for (const host::BatchTables::Table* t : {&books_tables->sink, &books_tables->recent}) {
      for (size_t r = 0; r + 1 < t->indptr.size(); ++r) {
        for (int32_t i = t->indptr[r]; i < t->indptr[r + 1]; ++i) {
          const int32_t rows = i + 1 == t->indptr[r + 1] ? t->last_page_len[r] : config.page_size;
          for (int h = 0; h < heads; ++h) {
            for (int32_t s = 0; s < rows; ++s) {
              const size_t at = rkb.row(t->indices[i], h, s) - rkb.data;
              for (int e = 0; e < d; ++e) {
                differing += (kb[at + e].bits != rkb.data[at + e].bits) + (vb[at + e].bits != rvb.data[at + e].bits);
              }
            }
          }
        }
      }
    }
  }

  // Decode attention for layer 1 on the device, from the books' tables, against the CPU.
  const int layer = 1;
  const host::BatchTables& tables = *books_tables;
  std::vector<SegmentCounts> segments;
  for (auto id : ids) segments.push_back(books->segments(id));
  auto options = attention_plan_options_for_device(d);
  CHECK_OK(options.status());
  const AttentionShape shape{config.num_qo_heads, heads, d, layout.quant_group_size, config.page_size};
  auto plan = make_attention_plan(shape, segments, {}, *options);
  CHECK_OK(plan.status());
  void* workspace = nullptr;
  CHECK_CUDA(cudaMalloc(&workspace, std::max<size_t>(plan->workspace_bytes(), 256)));
  CHECK_OK(upload_attention_plan(*plan, workspace, plan->workspace_bytes()));
  auto upload_table = [&](const host::BatchTables::Table& t) {
    return PageTableRef{to_device(t.indptr), to_device(t.indices), to_device(t.last_page_len),
                        int32_t(t.last_page_len.size()), config.page_size};
  };
  const std::vector<bf16_t> q = random_bf16(ids.size() * config.num_qo_heads * d);
  std::vector<float> qf(q.size()), ref(q.size());
  for (size_t i = 0; i < q.size(); ++i) qf[i] = bf16_to_float(q[i]);
  CHECK_OK(reference->decode(layer, ids, qf.data(), ref.data(), nullptr));
  // Attention reads one layer: the layer-strided view sliced to it (pools and rotations).
  const LayeredKvPools one = pools.layer_view(layer);
  PagedAttentionParams p;
  p.kv = {one.k_bf16, one.v_bf16, one.k_int2, one.v_int2,
          upload_table(tables.sink), upload_table(tables.int2), upload_table(tables.recent)};
  p.num_qo_heads = config.num_qo_heads;
  p.q = to_device(q);
  p.q_rotation = one.k_rotation;
  p.output_unrotation = one.v_rotation;
  bf16_t* out = nullptr;
  CHECK_CUDA(cudaMalloc(&out, q.size() * sizeof(bf16_t)));
  p.out = out;
  CHECK_OK(paged_attention(*plan, p, workspace, plan->workspace_bytes()));
  const std::vector<bf16_t> got = to_host(out, q.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    worst = std::max(worst, std::fabs(double(bf16_to_float(got[i])) - ref[i]));
    scale = std::max(scale, std::fabs(double(ref[i])));
  }
  // The output is rounded to bf16 (2^-9 relative) and the two sum in different orders:
  // 2^-7 of the largest output leaves room for both and catches any wrong token or page.
  const bool ok = differing == 0 && worst <= std::ldexp(scale, -7);
  std::printf("%zu stored bytes differ from the CPU cache; decode attention worst |error| %.3g (largest output %.3g): %s\n",
              differing, worst, scale, ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
