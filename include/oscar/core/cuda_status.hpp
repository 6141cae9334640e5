// A CUDA runtime return code as a Status: Ok, or kCudaError naming the call and CUDA's text.
// The launchers and the engine-side code around them check every return code through it.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "oscar/core/status.hpp"

namespace oscar {

// `what` stays a C string: launchers call this on every launch, and success builds no string.
inline Status cuda_status(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status::Ok();
  return {StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorString(error)};
}

}  // namespace oscar
