// A device mirror of a host::PagedCache's pools, laid out layer-strided the way an engine
// allocates them, for checking GPU kernels against the CPU reference byte for byte.
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <utility>
#include <vector>

#include "common/cuda_check.hpp"
#include "oscar/host/paged_cache.hpp"
#include "oscar/kv/write_params.hpp"

namespace oscar::testing {

template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  size_t count = 0;
  DeviceArray() = default;
  explicit DeviceArray(size_t n) : count(n) {
    if (n) CUDA_REQUIRE(cudaMalloc(&ptr, n * sizeof(T)));
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& other) noexcept : ptr(other.ptr), count(other.count) { other.ptr = nullptr, other.count = 0; }
  DeviceArray& operator=(DeviceArray&& other) noexcept {
    std::swap(ptr, other.ptr);
    std::swap(count, other.count);
    return *this;
  }
  ~DeviceArray() { cudaFree(ptr); }
  void upload(const T* host, size_t n) {
    REQUIRE(n <= count);
    if (n) CUDA_REQUIRE(cudaMemcpy(ptr, host, n * sizeof(T), cudaMemcpyHostToDevice));
  }
  void upload(const std::vector<T>& host) { upload(host.data(), host.size()); }
  std::vector<T> download() const {
    std::vector<T> host(count);
    if (count) CUDA_REQUIRE(cudaMemcpy(host.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  void fill_bytes(int value) {
    if (count) CUDA_REQUIRE(cudaMemset(ptr, value, count * sizeof(T)));
  }
};

class DevicePools {
 public:
  // bf16_offset shifts the BF16 pools by that many elements from their 256-byte-aligned
  // allocation: 1 makes them only 2-byte aligned, which the 16-byte-copying kernels refuse and
  // the launchers then route to their element-wise fallbacks.
  explicit DevicePools(const host::PagedCache& cache, size_t bf16_offset = 0)
      : config_(cache.config()),
        bf16_offset_(bf16_offset),
        int2_bytes_(size_t(config_.num_int2_pages) * config_.num_kv_heads * cache.int2_layout().block_bytes()),
        bf16_elems_(size_t(config_.num_bf16_pages) * config_.num_kv_heads * config_.page_size * config_.head_dim),
        k_int2_(int2_bytes_ * config_.num_layers),
        v_int2_(k_int2_.count),
        k_bf16_(bf16_elems_ * config_.num_layers + bf16_offset),
        v_bf16_(k_bf16_.count),
        k_rot_(size_t(config_.num_layers) * config_.head_dim * config_.head_dim),
        v_rot_(k_rot_.count),
        k_rank_(config_.num_layers),
        v_rank_(config_.num_layers) {
    std::vector<float> k_rot, v_rot;
    std::vector<int32_t> k_rank, v_rank;
    bool rotated = true;
    for (int l = 0; l < config_.num_layers; ++l) {
      const auto& q = cache.layer_quantizer(l);
      rotated = rotated && !q.k_rotation.empty() && !q.v_rotation.empty();
      k_rot.insert(k_rot.end(), q.k_rotation.begin(), q.k_rotation.end());
      v_rot.insert(v_rot.end(), q.v_rotation.begin(), q.v_rotation.end());
      k_rank.push_back(clip_rank(q.k_clip_ratio, config_.head_dim));
      v_rank.push_back(clip_rank(q.v_clip_ratio, config_.head_dim));
    }
    if (rotated) {
      k_rot_.upload(k_rot);
      v_rot_.upload(v_rot);
    }
    k_rank_.upload(k_rank);
    v_rank_.upload(v_rank);
    const Int2PoolRef i2 = cache.int2_pool(0, host::PagedCache::Tensor::kKeys);
    const Bf16PoolRef b16 = cache.bf16_pool(0, host::PagedCache::Tensor::kKeys);
    view_.k_int2 = i2;
    view_.k_int2.data = k_int2_.ptr;
    view_.v_int2 = i2;
    view_.v_int2.data = v_int2_.ptr;
    view_.k_bf16 = b16;
    view_.k_bf16.data = k_bf16_.ptr + bf16_offset_;
    view_.v_bf16 = b16;
    view_.v_bf16.data = v_bf16_.ptr + bf16_offset_;
    view_.int2_stride_layer = static_cast<int64_t>(int2_bytes_);
    view_.bf16_stride_layer = static_cast<int64_t>(bf16_elems_);
    view_.num_layers = config_.num_layers;
    view_.k_rotation = rotated ? k_rot_.ptr : nullptr;
    view_.v_rotation = rotated ? v_rot_.ptr : nullptr;
    view_.k_clip_rank = k_rank_.ptr;
    view_.v_clip_rank = v_rank_.ptr;
    view_.max_clip_distance = widest_clip_distance(k_rank, v_rank, config_.head_dim);
  }

  const LayeredKvPools& view() const { return view_; }
  // Overrides the hint that picks the quantizer's compiled form (set from the ranks above, as
  // an engine sets it): the bytes must be the same for any value.
  void set_max_clip_distance(int32_t distance) { view_.max_clip_distance = distance; }

  // Host pools -> device (every layer).
  void upload(const host::PagedCache& cache) {
    for (int l = 0; l < config_.num_layers; ++l) {
      copy(k_int2_.ptr + l * int2_bytes_, cache.int2_pool(l, host::PagedCache::Tensor::kKeys).data, int2_bytes_);
      copy(v_int2_.ptr + l * int2_bytes_, cache.int2_pool(l, host::PagedCache::Tensor::kValues).data, int2_bytes_);
      copy(k_bf16_.ptr + bf16_offset_ + l * bf16_elems_, cache.bf16_pool(l, host::PagedCache::Tensor::kKeys).data,
           bf16_elems_ * 2);
      copy(v_bf16_.ptr + bf16_offset_ + l * bf16_elems_, cache.bf16_pool(l, host::PagedCache::Tensor::kValues).data,
           bf16_elems_ * 2);
    }
  }

  // Number of bytes that differ between the device pools and the host cache's.
  size_t count_differences(const host::PagedCache& cache) const {
    size_t differences = 0;
    const auto k_int2 = k_int2_.download(), v_int2 = v_int2_.download();
    const auto k_bf16 = k_bf16_.download(), v_bf16 = v_bf16_.download();
    auto diff = [&](const void* a, const void* b, size_t bytes) {
      const auto* x = static_cast<const uint8_t*>(a);
      const auto* y = static_cast<const uint8_t*>(b);
      for (size_t i = 0; i < bytes; ++i) differences += x[i] != y[i];
    };
    for (int l = 0; l < config_.num_layers; ++l) {
      diff(k_int2.data() + l * int2_bytes_, cache.int2_pool(l, host::PagedCache::Tensor::kKeys).data, int2_bytes_);
      diff(v_int2.data() + l * int2_bytes_, cache.int2_pool(l, host::PagedCache::Tensor::kValues).data, int2_bytes_);
      diff(k_bf16.data() + bf16_offset_ + l * bf16_elems_, cache.bf16_pool(l, host::PagedCache::Tensor::kKeys).data,
           bf16_elems_ * 2);
      diff(v_bf16.data() + bf16_offset_ + l * bf16_elems_, cache.bf16_pool(l, host::PagedCache::Tensor::kValues).data,
           bf16_elems_ * 2);
    }
    return differences;
  }

  // A snapshot of all device pool bytes (to check that a failed launch wrote nothing).
  std::vector<uint8_t> snapshot() const {
    std::vector<uint8_t> all;
    for (auto bytes : {k_int2_.download(), v_int2_.download()}) all.insert(all.end(), bytes.begin(), bytes.end());
    for (const auto& elems : {k_bf16_.download(), v_bf16_.download()}) {
      const auto* p = reinterpret_cast<const uint8_t*>(elems.data());
      all.insert(all.end(), p, p + elems.size() * 2);
    }
    return all;
  }

 private:
  static void copy(void* device, const void* host, size_t bytes) {
    CUDA_REQUIRE(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
  }

  host::CacheConfig config_;
  size_t bf16_offset_;
  size_t int2_bytes_, bf16_elems_;
  DeviceArray<uint8_t> k_int2_, v_int2_;
  DeviceArray<bf16_t> k_bf16_, v_bf16_;
  DeviceArray<float> k_rot_, v_rot_;
  DeviceArray<int32_t> k_rank_, v_rank_;
  LayeredKvPools view_;
};

}  // namespace oscar::testing
