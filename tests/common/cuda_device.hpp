// Whether a GPU test can run here: false (after printing why, as ctest's skip message) where
// no CUDA device is visible. The test's main() then returns 77, which ctest reports as
// skipped, so a machine without a GPU never reports a GPU test as passed.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

inline bool cuda_device_visible() {
  int devices = 0;
  const cudaError_t error = cudaGetDeviceCount(&devices);
  if (error != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device visible (%s)\n", error == cudaSuccess ? "0 devices" : cudaGetErrorString(error));
    return false;
  }
  return true;
}
