// A device mirror of a host::PagedCache's pools, laid out layer-strided the way an engine
// allocates them, for checking GPU kernels against the CPU reference byte for byte.
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <utility>
#include <vector>

#include "common/cuda_check.hpp"
#include "oscar/host/device_cache_layout.hpp"
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
      : config_(cache.config()), bf16_offset_(bf16_offset), arrays_(arrays_of(cache)) {
    k_int2_ = DeviceArray<uint8_t>(arrays_.int2_pool_bytes);
    v_int2_ = DeviceArray<uint8_t>(arrays_.int2_pool_bytes);
    k_bf16_ = DeviceArray<bf16_t>(bf16_elems() * config_.num_layers + bf16_offset);
    v_bf16_ = DeviceArray<bf16_t>(k_bf16_.count);
    k_rot_ = DeviceArray<float>(arrays_.k_rotations.size());
    v_rot_ = DeviceArray<float>(arrays_.v_rotations.size());
    k_rank_ = DeviceArray<int32_t>(arrays_.k_clip_ranks.size());
    v_rank_ = DeviceArray<int32_t>(arrays_.v_clip_ranks.size());
    k_rot_.upload(arrays_.k_rotations);
    v_rot_.upload(arrays_.v_rotations);
    k_rank_.upload(arrays_.k_clip_ranks);
    v_rank_.upload(arrays_.v_clip_ranks);
    // The library's view (host/device_cache_layout.hpp), as an engine builds it; the BF16
    // pools then move by bf16_offset (layered_kv_pools would refuse nothing about that: the
    // launchers route misaligned pools to their element-wise paths).
    auto view = host::layered_kv_pools(config_, arrays_,
                                       {k_int2_.ptr, v_int2_.ptr, k_bf16_.ptr, v_bf16_.ptr, k_rot_.ptr, v_rot_.ptr,
                                        k_rank_.ptr, v_rank_.ptr});
    REQUIRE_MESSAGE(view.ok(), view.status().message());
    view_ = *view;
    view_.k_bf16.data += bf16_offset_;
    view_.v_bf16.data += bf16_offset_;
  }

  const LayeredKvPools& view() const { return view_; }
  // Overrides the hint that picks the quantizer's compiled form (set from the ranks above, as
  // an engine sets it): the bytes must be the same for any value.
  void set_max_clip_distance(int32_t distance) { view_.max_clip_distance = distance; }

  // Host pools -> device (every layer).
  void upload(const host::PagedCache& cache) {
    for (int l = 0; l < config_.num_layers; ++l) {
      copy(k_int2_.ptr + l * int2_bytes(), cache.int2_pool(l, host::PagedCache::Tensor::kKeys).data, int2_bytes());
      copy(v_int2_.ptr + l * int2_bytes(), cache.int2_pool(l, host::PagedCache::Tensor::kValues).data, int2_bytes());
      copy(k_bf16_.ptr + bf16_offset_ + l * bf16_elems(), cache.bf16_pool(l, host::PagedCache::Tensor::kKeys).data,
           bf16_elems() * 2);
      copy(v_bf16_.ptr + bf16_offset_ + l * bf16_elems(), cache.bf16_pool(l, host::PagedCache::Tensor::kValues).data,
           bf16_elems() * 2);
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
      diff(k_int2.data() + l * int2_bytes(), cache.int2_pool(l, host::PagedCache::Tensor::kKeys).data, int2_bytes());
      diff(v_int2.data() + l * int2_bytes(), cache.int2_pool(l, host::PagedCache::Tensor::kValues).data, int2_bytes());
      diff(k_bf16.data() + bf16_offset_ + l * bf16_elems(), cache.bf16_pool(l, host::PagedCache::Tensor::kKeys).data,
           bf16_elems() * 2);
      diff(v_bf16.data() + bf16_offset_ + l * bf16_elems(), cache.bf16_pool(l, host::PagedCache::Tensor::kValues).data,
           bf16_elems() * 2);
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

  static host::DeviceCacheArrays arrays_of(const host::PagedCache& cache) {
    auto arrays = host::device_cache_arrays(cache.config(), cache.layer_quantizers());
    REQUIRE_MESSAGE(arrays.ok(), arrays.status().message());
    return std::move(*arrays);
  }

  // One layer of one pool: INT2 bytes, BF16 elements (the view's layer strides).
  size_t int2_bytes() const { return size_t(arrays_.int2_stride_layer); }
  size_t bf16_elems() const { return size_t(arrays_.bf16_stride_layer); }

  host::CacheConfig config_;
  size_t bf16_offset_;
  host::DeviceCacheArrays arrays_;
  DeviceArray<uint8_t> k_int2_, v_int2_;
  DeviceArray<bf16_t> k_bf16_, v_bf16_;
  DeviceArray<float> k_rot_, v_rot_;
  DeviceArray<int32_t> k_rank_, v_rank_;
  LayeredKvPools view_;
};

}  // namespace oscar::testing
