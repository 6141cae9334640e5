// CUDA_REQUIRE: fails the current doctest test case with the CUDA error text.
#pragma once

#include <doctest/doctest.h>
#include <cuda_runtime.h>

// Fails the current test with the CUDA error text.
#define CUDA_REQUIRE(expr)                                                         \
  do {                                                                             \
    const cudaError_t cuda_error_ = (expr);                                        \
    REQUIRE_MESSAGE(cuda_error_ == cudaSuccess, #expr ": " << cudaGetErrorString(cuda_error_)); \
  } while (0)
