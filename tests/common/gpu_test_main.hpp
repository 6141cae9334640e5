// main() for GPU test executables: exit 77 (ctest: skipped) where no CUDA device is visible,
// so a machine without a GPU never reports these tests as passed. Include in exactly one
// translation unit of each GPU test.
#pragma once

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdio>

#include "common/cuda_check.hpp"
#include "common/cuda_device.hpp"

int main(int argc, char** argv) {
  if (!cuda_device_visible()) return 77;
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("running on %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  doctest::Context context(argc, argv);
  return context.run();
}

