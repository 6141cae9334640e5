// The real-model data of the GPU tests, loaded on the host by a C++ translation unit (the plan
// and safetensors readers use Eigen and nlohmann-json, which stay out of nvcc's way).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "oscar/host/paged_cache.hpp"

namespace oscar::testing {

// Post-RoPE q/k/v of some layers of a real model (oscar-decode dump), float32, with the
// quantizers a plan calibrated on a different text assigns to those layers.
struct RealActivations {
  int64_t tokens = 0;
  int num_qo_heads = 0, num_kv_heads = 0, head_dim = 0;
  std::vector<int> layers;                   // model layer of each entry below
  std::vector<std::vector<float>> q, k, v;   // [entry] -> [tokens, heads, head_dim]
  std::vector<host::LayerQuantizer> quantizers;  // [entry]
};

// Reads `dir`/activations.safetensors and `dir`/plan.safetensors for `layers`. An error string
// names what is missing or inconsistent; empty on success.
std::string load_real_activations(const std::string& dir, const std::vector<int>& layers, RealActivations& out);

}  // namespace oscar::testing
