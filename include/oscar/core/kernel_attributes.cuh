// The launch-time attributes of a kernel on the current device: its dynamic shared-memory
// opt-in and the number of its blocks resident per SM.
//
// Why not a once-per-process flag: a function attribute belongs to the device's context. A
// static flag set on device 0 leaves device 1 at the 48 KB default, and cudaDeviceReset drops
// it on the same device, so the next launch fails with "invalid argument". The opt-in is
// therefore made at every launch (a host call, absent from a CUDA graph's replay), as
// paged_attention and demote_kv do. Occupancy depends only on the device and the kernel's
// compiled resources, so it is cached per device ordinal and survives a reset.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>

namespace oscar {

// Dynamic shared memory a kernel gets without opting in.
inline constexpr int kDefaultDynamicSharedMemoryBytes = 48 * 1024;

// Raises kernel's dynamic shared-memory limit to `bytes` on the current device where it is
// above the default (below it the call would be a no-op: none is made).
template <typename... KernelArgs>
cudaError_t opt_in_dynamic_shared_memory(void (*kernel)(KernelArgs...), int bytes) {
  if (bytes <= kDefaultDynamicSharedMemoryBytes) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// Blocks of kKernel resident per SM of the current device with kThreads threads and kSmem
// bytes of dynamic shared memory, at least 1 (a failed query falls back to 1: launchers size
// grids by it, and a grid of one block per SM is always valid). The opt-in is made first: the
// occupancy query counts 0 blocks for shared memory above the kernel's current limit.
template <auto kKernel, int kThreads, int kSmem>
int resident_blocks_per_sm() {
  constexpr int kCachedDevices = 64;
  static std::array<std::atomic<int>, kCachedDevices> cache{};  // 0: not yet queried
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  const bool cached = device >= 0 && device < kCachedDevices;
  if (cached) {
    if (const int known = cache[device].load(std::memory_order_relaxed); known > 0) return known;
  }
  int blocks = 0;
  if (opt_in_dynamic_shared_memory(kKernel, kSmem) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, kThreads, kSmem) != cudaSuccess || blocks < 1) {
    (void)cudaGetLastError();  // the launch's own error check must not report this query's
    return 1;                  // not cached: a later call may succeed
  }
  if (cached) cache[device].store(blocks, std::memory_order_relaxed);
  return blocks;
}

}  // namespace oscar
