// The launch-time attributes of a kernel on the current device: its dynamic shared-memory
// opt-in and the number of its blocks resident per SM.
//
// Why not a once-per-process flag: a function attribute belongs to the device's context. A
// static flag set on device 0 leaves device 1 at the 48 KB default, and cudaDeviceReset drops
// it on the same device, so the next launch fails with "invalid argument". The opt-in is
// therefore remembered per (kernel, context), by the context's id (cuCtxGetId: unique for the
// life of the process, so a context made after a reset is a new one). The first launch in a
// context makes the host call; later ones skip it (~0.4 us event-timed per launch on an H100
// when it was made every time, 2026-12-08). Occupancy depends only on the device and the
// kernel's compiled resources, so it is cached per device ordinal and survives a reset.
#pragma once

#include <cuda.h>  // CUcontext and the driver's function types (no link to libcuda: entry points)
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <utility>

namespace oscar {

namespace kernel_attributes_detail {

// The current thread's context id, or 0 where there is none yet or the driver cannot say (the
// caller then makes its host call every time, which is always correct).
inline unsigned long long current_context_id() {
  using GetCurrent = CUresult (*)(CUcontext*);
  using GetId = CUresult (*)(CUcontext, unsigned long long*);
  static const std::pair<GetCurrent, GetId> driver = [] {
    const auto lookup = [](const char* symbol, void** function) {
      cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
      const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, function, 12000, cudaEnableDefault, &found);
#else
      const cudaError_t e = cudaGetDriverEntryPoint(symbol, function, cudaEnableDefault, &found);
#endif
      return e == cudaSuccess && found == cudaDriverEntryPointSuccess && *function != nullptr;
    };
    void* current = nullptr;
    void* id = nullptr;
    if (!lookup("cuCtxGetCurrent", &current) || !lookup("cuCtxGetId", &id)) {
      (void)cudaGetLastError();
      return std::pair<GetCurrent, GetId>{nullptr, nullptr};
    }
    return std::pair{reinterpret_cast<GetCurrent>(current), reinterpret_cast<GetId>(id)};
  }();
  if (!driver.first || !driver.second) return 0;
  CUcontext context = nullptr;
  unsigned long long id = 0;
  if (driver.first(&context) != CUDA_SUCCESS || !context || driver.second(context, &id) != CUDA_SUCCESS) return 0;
  return id;
}

}  // namespace kernel_attributes_detail

// Raises kernel's dynamic shared-memory limit to `bytes` in the current context. The call is
// made whenever bytes > 0, not only above 48 KB: the 48 KB default covers static and dynamic
// shared memory together, so a kernel with some static shared memory needs the opt-in below
// 48 KB of dynamic (extend_attention_kernel at d = 64 does). Skipped where this kernel already
// has at least `bytes` in this context.
template <typename... KernelArgs>
cudaError_t opt_in_dynamic_shared_memory(void (*kernel)(KernelArgs...), int bytes) {
  if (bytes <= 0) return cudaSuccess;
  using Key = std::pair<const void*, unsigned long long>;
  static std::mutex mutex;
  static std::map<Key, int> granted;  // (kernel, context id) -> bytes opted in
  const Key key{reinterpret_cast<const void*>(kernel), kernel_attributes_detail::current_context_id()};
  if (key.second != 0) {
    std::lock_guard<std::mutex> lock(mutex);
    if (const auto it = granted.find(key); it != granted.end() && it->second >= bytes) return cudaSuccess;
  }
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess && key.second != 0) {
    std::lock_guard<std::mutex> lock(mutex);
    granted[key] = bytes;
  }
  return e;
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
