// host/device_cache_layout.hpp: the pool sizes, stacked rotations and clip ranks an engine
// uploads, and the LayeredKvPools view over its buffers. Host memory stands in for the
// device's here (the view is only addresses and strides): the per-layer pools of a CPU cache,
// copied into layer-strided buffers of the sizes the helper gives, must be found through the
// view at the same (layer, page, head, slot) addresses. The GPU side of the same view runs in
// test_write_gpu, test_attention_gpu and oscar-gpu-step, which build their pools with it.
#include <doctest/doctest.h>

#include <cstring>
#include <tuple>
#include <vector>

#include "host/cache_test_util.hpp"
#include "oscar/core/aligned_buffer.hpp"
#include "oscar/host/device_cache_layout.hpp"

using namespace oscar;
using namespace oscar::testing;
using host::CacheConfig;
using host::LayerQuantizer;

namespace {

CacheConfig small_config(int layers, int d, int page, int quant_group = 0) {
  CacheConfig c;
  c.num_layers = layers;
  c.num_kv_heads = 2;
  c.num_qo_heads = 6;
  c.head_dim = d;
  c.quant_group_size = quant_group;
  c.page_size = page;
  c.sink_tokens = 4;
  c.recent_tokens = 16;
  c.num_int2_pages = 24;
  c.num_bf16_pages = 12;
  c.max_requests = 2;
  return c;
}

std::vector<LayerQuantizer> quantizers(const CacheConfig& c, uint64_t seed) {
  std::vector<LayerQuantizer> layers;
  for (int l = 0; l < c.num_layers; ++l) layers.push_back(make_quantizer(c.head_dim, seed + l, true, 0.96f, 0.9f));
  return layers;
}

bool is_identity(const float* r, int d) {
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j)
      if (r[i * d + j] != (i == j ? 1.0f : 0.0f)) return false;
  return true;
}

}  // namespace

TEST_CASE("the layered view finds every layer's pages where the CPU cache keeps them") {
  for (auto [d, page, group] : {std::tuple{64, 8, 0}, std::tuple{128, 16, 32}, std::tuple{256, 32, 64}}) {
    CAPTURE(d);
    CAPTURE(page);
    const CacheConfig config = small_config(3, d, page, group);
    const auto layers = quantizers(config, 7);
    auto cache = host::PagedCache::create(config, layers);
    REQUIRE(cache.ok());
    // Rows in every segment: sink, INT2 pages and window.
    const auto id = cache->add_request();
    REQUIRE(id.ok());
    RowGenerator keys(11, d), values(12, d);
    append_in_chunks(*cache, *id, 3 * page + 40, {7, 1, 13}, keys, values);

    auto arrays = host::device_cache_arrays(config, layers);
    REQUIRE_MESSAGE(arrays.ok(), arrays.status().to_string());
    using T = host::PagedCache::Tensor;
    const Int2PoolRef host_int2 = cache->int2_pool(0, T::kKeys);
    const Bf16PoolRef host_bf16 = cache->bf16_pool(0, T::kKeys);
    CHECK(arrays->int2_stride_layer == host_int2.stride_page * host_int2.num_pages);
    CHECK(arrays->bf16_stride_layer == host_bf16.stride_page * host_bf16.num_pages);
    CHECK(arrays->int2_pool_bytes == size_t(arrays->int2_stride_layer) * 3);
    CHECK(arrays->bf16_pool_bytes == size_t(arrays->bf16_stride_layer) * 3 * sizeof(bf16_t));

    // The "device" buffers: each layer's host pool copied to its layer stride.
    AlignedBuffer k_int2(arrays->int2_pool_bytes), v_int2(arrays->int2_pool_bytes);
    AlignedBuffer k_bf16(arrays->bf16_pool_bytes), v_bf16(arrays->bf16_pool_bytes);
    for (int l = 0; l < 3; ++l) {
      std::memcpy(k_int2.as<uint8_t>() + l * arrays->int2_stride_layer, cache->int2_pool(l, T::kKeys).data,
                  size_t(arrays->int2_stride_layer));
      std::memcpy(v_int2.as<uint8_t>() + l * arrays->int2_stride_layer, cache->int2_pool(l, T::kValues).data,
                  size_t(arrays->int2_stride_layer));
      std::memcpy(k_bf16.as<bf16_t>() + l * arrays->bf16_stride_layer, cache->bf16_pool(l, T::kKeys).data,
                  size_t(arrays->bf16_stride_layer) * sizeof(bf16_t));
      std::memcpy(v_bf16.as<bf16_t>() + l * arrays->bf16_stride_layer, cache->bf16_pool(l, T::kValues).data,
                  size_t(arrays->bf16_stride_layer) * sizeof(bf16_t));
    }
    AlignedBuffer k_rot(arrays->k_rotations.size() * 4), v_rot(arrays->v_rotations.size() * 4);
    AlignedBuffer k_rank(12), v_rank(12);
    auto view = host::layered_kv_pools(config, *arrays,
                                       {k_int2.as<uint8_t>(), v_int2.as<uint8_t>(), k_bf16.as<bf16_t>(),
                                        v_bf16.as<bf16_t>(), k_rot.as<float>(), v_rot.as<float>(),
                                        k_rank.as<int32_t>(), v_rank.as<int32_t>()});
    REQUIRE_MESSAGE(view.ok(), view.status().to_string());
    CHECK(view->num_layers == 3);
    CHECK(view->max_clip_distance == arrays->max_clip_distance);

    // Each layer through its one-layer view (layer_view), as attention and per-layer launches
    // read it.
    size_t compared = 0, differing = 0;
    for (int l = 0; l < 3; ++l) {
      const LayeredKvPools one = view->layer_view(l);
      CHECK(one.num_layers == 1);
      CHECK(one.k_rotation == k_rot.as<float>() + size_t(l) * d * d);
      CHECK(one.v_rotation == v_rot.as<float>() + size_t(l) * d * d);
      CHECK(one.k_clip_rank == k_rank.as<int32_t>() + l);
      CHECK(one.v_clip_rank == v_rank.as<int32_t>() + l);
      for (int32_t p = 0; p < config.num_int2_pages; ++p) {
        for (int32_t h = 0; h < config.num_kv_heads; ++h) {
          const size_t bytes = size_t(view->k_int2.layout.block_bytes());
          const uint8_t* k = one.k_int2.block(p, h);
          const uint8_t* v = one.v_int2.block(p, h);
          differing += std::memcmp(k, cache->int2_pool(l, T::kKeys).block(p, h), bytes) != 0;
          differing += std::memcmp(v, cache->int2_pool(l, T::kValues).block(p, h), bytes) != 0;
          compared += 2;
        }
      }
      for (int32_t p = 0; p < config.num_bf16_pages; ++p) {
        for (int32_t h = 0; h < config.num_kv_heads; ++h) {
          for (int32_t s = 0; s < page; ++s) {
            differing += std::memcmp(one.k_bf16.row(p, h, s), cache->bf16_pool(l, T::kKeys).row(p, h, s),
                                     size_t(d) * 2) != 0;
            differing += std::memcmp(one.v_bf16.row(p, h, s), cache->bf16_pool(l, T::kValues).row(p, h, s),
                                     size_t(d) * 2) != 0;
            compared += 2;
          }
        }
      }
    }
    CHECK(compared > 0);
    CHECK(differing == 0);
  }
}

TEST_CASE("stacked rotations: none, all, and layers without one among rotated layers") {
  const CacheConfig config = small_config(3, 64, 16);
  const int d = 64;
  auto layers = quantizers(config, 3);
  SUBCASE("every layer rotates both: R_K and R_V of each layer in order") {
    auto a = host::device_cache_arrays(config, layers);
    REQUIRE(a.ok());
    REQUIRE(a->k_rotations.size() == size_t(3) * d * d);
    REQUIRE(a->v_rotations.size() == size_t(3) * d * d);
    for (int l = 0; l < 3; ++l) {
      CHECK(std::memcmp(a->k_rotations.data() + l * d * d, layers[l].k_rotation.data(), size_t(d) * d * 4) == 0);
      CHECK(std::memcmp(a->v_rotations.data() + l * d * d, layers[l].v_rotation.data(), size_t(d) * d * 4) == 0);
    }
  }
  SUBCASE("no layer rotates V: no V rotation at all, K kept") {
    for (auto& l : layers) l.v_rotation.clear();
    auto a = host::device_cache_arrays(config, layers);
    REQUIRE(a.ok());
    CHECK(a->v_rotations.empty());
    CHECK(a->k_rotations.size() == size_t(3) * d * d);
  }
  SUBCASE("layer 1 without rotations among rotated layers: the identity in its place") {
    layers[1].k_rotation.clear();
    layers[1].v_rotation.clear();
    auto a = host::device_cache_arrays(config, layers);
    REQUIRE(a.ok());
    REQUIRE(a->k_rotations.size() == size_t(3) * d * d);
    CHECK(is_identity(a->k_rotations.data() + d * d, d));
    CHECK(is_identity(a->v_rotations.data() + d * d, d));
    CHECK_FALSE(is_identity(a->k_rotations.data(), d));
    CHECK(std::memcmp(a->k_rotations.data() + 2 * d * d, layers[2].k_rotation.data(), size_t(d) * d * 4) == 0);
  }
  SUBCASE("an unrotated cache uploads no rotation, and a layer's view keeps none") {
    for (auto& l : layers) l.k_rotation.clear(), l.v_rotation.clear();
    auto a = host::device_cache_arrays(config, layers);
    REQUIRE(a.ok());
    CHECK(a->k_rotations.empty());
    CHECK(a->v_rotations.empty());
    AlignedBuffer pool_k(a->int2_pool_bytes), pool_v(a->int2_pool_bytes), bf_k(a->bf16_pool_bytes),
        bf_v(a->bf16_pool_bytes), rank_k(16), rank_v(16);
    auto view = host::layered_kv_pools(config, *a,
                                       {pool_k.as<uint8_t>(), pool_v.as<uint8_t>(), bf_k.as<bf16_t>(),
                                        bf_v.as<bf16_t>(), nullptr, nullptr, rank_k.as<int32_t>(),
                                        rank_v.as<int32_t>()});
    REQUIRE_MESSAGE(view.ok(), view.status().to_string());
    const LayeredKvPools last = view->layer_view(2);
    CHECK(last.k_rotation == nullptr);  // null stays null: no rotation, not an offset from null
    CHECK(last.v_rotation == nullptr);
    CHECK(last.k_int2.data == pool_k.as<uint8_t>() + 2 * a->int2_stride_layer);
    CHECK(last.v_bf16.data == bf_v.as<bf16_t>() + 2 * a->bf16_stride_layer);
  }
}

TEST_CASE("clip ranks per layer and the widest clip distance") {
  const CacheConfig config = small_config(2, 128, 16);
  auto layers = quantizers(config, 5);
  layers[0].k_clip_ratio = 0.96f;
  layers[0].v_clip_ratio = 1.0f;  // no clipping: rank -1, distance 0
  layers[1].k_clip_ratio = 0.92f;
  layers[1].v_clip_ratio = 0.87f;
  auto a = host::device_cache_arrays(config, layers);
  REQUIRE(a.ok());
  CHECK(a->k_clip_ranks == std::vector<int32_t>{clip_rank(0.96f, 128), clip_rank(0.92f, 128)});
  CHECK(a->v_clip_ranks == std::vector<int32_t>{-1, clip_rank(0.87f, 128)});
  CHECK(a->max_clip_distance == 128 - clip_rank(0.87f, 128));
  CHECK(a->max_clip_distance > 16);  // past the narrow selection: the launchers pick the wide form
}

TEST_CASE("bad quantizers are refused by name") {
  const CacheConfig config = small_config(2, 64, 16);
  auto layers = quantizers(config, 9);
  SUBCASE("a quantizer per layer") {
    layers.pop_back();
    auto a = host::device_cache_arrays(config, layers);
    REQUIRE_FALSE(a.ok());
    CHECK(a.status().message().find("layer quantizers") != std::string::npos);
  }
  SUBCASE("a rotation of the wrong size") {
    layers[1].v_rotation.resize(32 * 32);
    auto a = host::device_cache_arrays(config, layers);
    REQUIRE_FALSE(a.ok());
    CHECK(a.status().message().find("layer 1 v_rotation") != std::string::npos);
  }
  SUBCASE("a rotation that is not orthogonal") {
    layers[0].k_rotation[5] += 0.5f;
    auto a = host::device_cache_arrays(config, layers);
    REQUIRE_FALSE(a.ok());
    CHECK(a.status().message().find("not orthogonal") != std::string::npos);
  }
  SUBCASE("an unsupported head_dim") {
    CacheConfig bad = config;
    bad.head_dim = 96;
    auto a = host::device_cache_arrays(bad, layers);
    REQUIRE_FALSE(a.ok());
    CHECK(a.status().message().find("head_dim") != std::string::npos);
  }
}

TEST_CASE("bad buffers are refused by name") {
  const CacheConfig config = small_config(2, 64, 16);
  const auto layers = quantizers(config, 9);
  auto arrays = host::device_cache_arrays(config, layers);
  REQUIRE(arrays.ok());
  AlignedBuffer int2(arrays->int2_pool_bytes * 2), bf16(arrays->bf16_pool_bytes * 2), rot(64 * 64 * 2 * 4 + 16),
      rank(64);
  host::DeviceCacheBuffers good{int2.as<uint8_t>(),
                                int2.as<uint8_t>() + arrays->int2_pool_bytes,
                                bf16.as<bf16_t>(),
                                bf16.as<bf16_t>() + arrays->bf16_pool_bytes / 2,
                                rot.as<float>(),
                                rot.as<float>(),
                                rank.as<int32_t>(),
                                rank.as<int32_t>() + 4};
  REQUIRE(host::layered_kv_pools(config, *arrays, good).ok());
  auto refused = [&](host::DeviceCacheBuffers b, const char* words, const CacheConfig& c) {
    auto view = host::layered_kv_pools(c, *arrays, b);
    REQUIRE_FALSE(view.ok());
    CHECK_MESSAGE(view.status().message().find(words) != std::string::npos, view.status().message());
  };
  SUBCASE("null and misaligned pools") {
    host::DeviceCacheBuffers b = good;
    b.v_int2 = nullptr;
    refused(b, "v_int2 pool: data must not be null", config);
    b = good;
    b.k_int2 += 8;
    refused(b, "16-byte aligned", config);
  }
  SUBCASE("rotation pointers against the arrays") {
    host::DeviceCacheBuffers b = good;
    b.k_rotations = nullptr;
    refused(b, "k_rotations must not be null", config);
    b = good;
    b.v_rotations = rot.as<float>() + 1;
    refused(b, "16-byte aligned", config);
    auto unrotated = layers;
    for (auto& l : unrotated) l.v_rotation.clear();
    auto a = host::device_cache_arrays(config, unrotated);
    REQUIRE(a.ok());
    auto view = host::layered_kv_pools(config, *a, good);
    REQUIRE_FALSE(view.ok());
    CHECK(view.status().message().find("v_rotations must be null") != std::string::npos);
  }
  SUBCASE("null clip ranks") {
    host::DeviceCacheBuffers b = good;
    b.k_clip_ranks = nullptr;
    refused(b, "k_clip_rank and v_clip_rank must not be null", config);
  }
  SUBCASE("arrays made for another config") {
    CacheConfig other = config;
    other.num_int2_pages += 1;
    refused(good, "made for another config", other);
  }
  SUBCASE("arrays of another shape with the same layer strides") {
    // d = 64 with 2 KV heads and d = 128 with 1, both at group 32: the same INT2 and BF16
    // layer strides, but R and the clip ranks are for d = 64 (a kernel would read 4x the
    // rotation floats uploaded).
    CacheConfig wide = config;
    wide.head_dim = 128;
    wide.num_kv_heads = 1;
    wide.num_qo_heads = 3;
    wide.quant_group_size = 32;
    CacheConfig narrow = config;
    narrow.quant_group_size = 32;
    auto a = host::device_cache_arrays(narrow, quantizers(narrow, 9));
    REQUIRE(a.ok());
    REQUIRE(a->int2_stride_layer == wide.int2_pool_layer_bytes());
    REQUIRE(a->bf16_stride_layer == wide.bf16_pool_layer_elements());
    auto view = host::layered_kv_pools(wide, *a, good);
    REQUIRE_FALSE(view.ok());
    CHECK_MESSAGE(view.status().message().find("made for another config (2 layers, 2 KV heads, head_dim 64, group 32") !=
                      std::string::npos,
                  view.status().message());
  }
}
