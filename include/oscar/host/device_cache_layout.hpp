// What an engine allocates and uploads to run a cache of a given CacheConfig on the GPU, and
// the LayeredKvPools view over it (docs/gpu.md §1). Host code only: it computes sizes and
// host arrays, and builds the view from device addresses the engine got from its own
// allocator; it never allocates or copies device memory itself.
//
//   auto arrays = host::device_cache_arrays(config, quantizers);      // sizes, R_K/R_V, clip ranks
//   ... allocate arrays->int2_pool_bytes twice and arrays->bf16_pool_bytes twice, upload
//   ... arrays->k_rotations / v_rotations / k_clip_ranks / v_clip_ranks ...
//   auto pools = host::layered_kv_pools(config, *arrays, {k_int2, v_int2, k_bf16, v_bf16,
//                                                         k_rot, v_rot, k_rank, v_rank});
//
// Pools are layer-strided: one allocation per pool holds every layer, so one append_kv or
// demote_kv writes all layers. Rotations follow the CPU cache's rule per tensor: when no layer
// rotates K (or V), the device pointer is null (the identity, no rotation work); when some do,
// a layer without one gets the identity matrix in the stacked array, so every layer reads a
// rotation and the bytes stay those of host::PagedCache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "oscar/core/status.hpp"
#include "oscar/host/paged_cache.hpp"
#include "oscar/kv/write_params.hpp"
#include "oscar/quant/clip.hpp"

namespace oscar::host {

// Sizes of the device pools and the host arrays to upload, for one CacheConfig and its
// layers' quantizers.
struct DeviceCacheArrays {
  // The config's shape the arrays were made for: layered_kv_pools refuses arrays of another
  // (two configs can share both layer strides, e.g. d = 64 with 2 KV heads and d = 128 with 1
  // at group 32, while their rotations and clip ranks differ).
  int32_t num_layers = 0, num_kv_heads = 0, head_dim = 0, quant_group_size = 0, page_size = 0;
  int64_t int2_stride_layer = 0;  // bytes of one layer of an INT2 pool (LayeredKvPools' stride)
  int64_t bf16_stride_layer = 0;  // elements of one layer of a BF16 pool
  size_t int2_pool_bytes = 0;     // one INT2 pool (K or V), all layers
  size_t bf16_pool_bytes = 0;     // one BF16 pool (K or V), all layers
  // float32 [num_layers][head_dim][head_dim] row-major, or empty: no layer rotates that tensor.
  std::vector<float> k_rotations, v_rotations;
  // clip_rank(rho, head_dim) per layer, -1 where clipping is off.
  std::vector<int32_t> k_clip_ranks, v_clip_ranks;
  // LayeredKvPools::max_clip_distance: the widest clip distance over every layer, K and V.
  int32_t max_clip_distance = 0;
};

// Device addresses of the allocations that DeviceCacheArrays sized, and of the device copies of
// its arrays (null rotations exactly where the host arrays are empty).
struct DeviceCacheBuffers {
  uint8_t* k_int2 = nullptr;
  uint8_t* v_int2 = nullptr;
  bf16_t* k_bf16 = nullptr;
  bf16_t* v_bf16 = nullptr;
  const float* k_rotations = nullptr;
  const float* v_rotations = nullptr;
  const int32_t* k_clip_ranks = nullptr;
  const int32_t* v_clip_ranks = nullptr;
};

namespace detail {

// R of every layer stacked, the identity for a layer without one; empty when no layer has one.
inline std::vector<float> stacked_rotations(std::span<const LayerQuantizer> layers, int32_t d, bool keys) {
  auto rotation = [&](const LayerQuantizer& l) -> const std::vector<float>& { return keys ? l.k_rotation : l.v_rotation; };
  bool any = false;
  for (const auto& l : layers) any = any || !rotation(l).empty();
  std::vector<float> out;
  if (!any) return out;
  out.reserve(layers.size() * size_t(d) * size_t(d));
  for (const auto& l : layers) {
    if (rotation(l).empty()) {
      for (int32_t i = 0; i < d; ++i) {
        for (int32_t j = 0; j < d; ++j) out.push_back(i == j ? 1.0f : 0.0f);
      }
    } else {
      out.insert(out.end(), rotation(l).begin(), rotation(l).end());
    }
  }
  return out;
}

}  // namespace detail

// Checks config and quantizers as PagedCache::create does (validate_layer_quantizers), then sizes the pools and stacks the
// arrays. The pool sizes do not depend on the quantizers.
inline Result<DeviceCacheArrays> device_cache_arrays(const CacheConfig& config, std::span<const LayerQuantizer> layers) {
  OSCAR_RETURN_IF_ERROR(validate(config));
  OSCAR_RETURN_IF_ERROR(validate_layer_quantizers(config, layers));
  const int32_t d = config.head_dim;
  DeviceCacheArrays a;
  a.num_layers = config.num_layers;
  a.num_kv_heads = config.num_kv_heads;
  a.head_dim = config.head_dim;
  a.quant_group_size = config.int2_layout().quant_group_size;
  a.page_size = config.page_size;
  a.int2_stride_layer = config.int2_pool_layer_bytes();
  a.bf16_stride_layer = config.bf16_pool_layer_elements();
  a.int2_pool_bytes = size_t(a.int2_stride_layer) * size_t(config.num_layers);
  a.bf16_pool_bytes = size_t(a.bf16_stride_layer) * size_t(config.num_layers) * sizeof(bf16_t);
  a.k_rotations = detail::stacked_rotations(layers, d, true);
  a.v_rotations = detail::stacked_rotations(layers, d, false);
  for (const auto& l : layers) {
    a.k_clip_ranks.push_back(clip_rank(l.k_clip_ratio, d));
    a.v_clip_ranks.push_back(clip_rank(l.v_clip_ratio, d));
  }
  a.max_clip_distance = widest_clip_distance(a.k_clip_ranks, a.v_clip_ranks, d);
  return a;
}

// The view the write and attention launchers take, over the engine's buffers, validated
// (null or misaligned pools, a rotation pointer where the arrays say none or none where they
// say one, null clip ranks: each refused by name).
inline Result<LayeredKvPools> layered_kv_pools(const CacheConfig& config, const DeviceCacheArrays& arrays,
                                               const DeviceCacheBuffers& b) {
  OSCAR_RETURN_IF_ERROR(validate(config));
  auto rotation_pointer = [](const std::vector<float>& host, const float* device, const char* name) -> Status {
    if (host.empty() != (device == nullptr)) {
      return invalid_argument(std::string("device cache: ") + name +
                              (host.empty() ? " must be null: no layer rotates it" : " must not be null: layers rotate it"));
    }
    return Status::Ok();
  };
  OSCAR_RETURN_IF_ERROR(rotation_pointer(arrays.k_rotations, b.k_rotations, "k_rotations"));
  OSCAR_RETURN_IF_ERROR(rotation_pointer(arrays.v_rotations, b.v_rotations, "v_rotations"));
  const int32_t heads = config.num_kv_heads;
  const Int2Layout layout = config.int2_layout();
  const size_t rotation_floats = size_t(config.num_layers) * size_t(config.head_dim) * size_t(config.head_dim);
  if (arrays.num_layers != config.num_layers || arrays.num_kv_heads != heads || arrays.head_dim != config.head_dim ||
      arrays.quant_group_size != layout.quant_group_size || arrays.page_size != config.page_size ||
      arrays.int2_stride_layer != config.int2_pool_layer_bytes() ||
      arrays.bf16_stride_layer != config.bf16_pool_layer_elements() ||
      static_cast<int32_t>(arrays.k_clip_ranks.size()) != config.num_layers ||
      static_cast<int32_t>(arrays.v_clip_ranks.size()) != config.num_layers ||
      (!arrays.k_rotations.empty() && arrays.k_rotations.size() != rotation_floats) ||
      (!arrays.v_rotations.empty() && arrays.v_rotations.size() != rotation_floats)) {
    return invalid_argument("device cache: the arrays were made for another config (" + std::to_string(arrays.num_layers) +
                            " layers, " + std::to_string(arrays.num_kv_heads) + " KV heads, head_dim " +
                            std::to_string(arrays.head_dim) + ", group " + std::to_string(arrays.quant_group_size) +
                            ", page_size " + std::to_string(arrays.page_size) + ")");
  }
  LayeredKvPools p;
  p.k_int2 = Int2PoolRef::packed(b.k_int2, config.num_int2_pages, heads, layout);
  p.v_int2 = Int2PoolRef::packed(b.v_int2, config.num_int2_pages, heads, layout);
  p.k_bf16 = Bf16PoolRef::packed(b.k_bf16, config.num_bf16_pages, heads, config.page_size, config.head_dim);
  p.v_bf16 = Bf16PoolRef::packed(b.v_bf16, config.num_bf16_pages, heads, config.page_size, config.head_dim);
  p.int2_stride_layer = arrays.int2_stride_layer;
  p.bf16_stride_layer = arrays.bf16_stride_layer;
  p.num_layers = config.num_layers;
  p.k_rotation = b.k_rotations;
  p.v_rotation = b.v_rotations;
  p.k_clip_rank = b.k_clip_ranks;
  p.v_clip_rank = b.v_clip_ranks;
  p.max_clip_distance = arrays.max_clip_distance;
  OSCAR_RETURN_IF_ERROR(validate(p));
  return p;
}

}  // namespace oscar::host
